"""A multi-label tagger over the records feature_spec.json describes."""

import keras


def build_tagger(spec, width: int = 64) -> keras.Model:
  """Signal and channel in, one sigmoid per tag out.

  Args:
    spec: the run's `tfdist.DatasetSpec`; with `--feature_spec`,
      `spec.features` describes the inputs and the labels.
    width: hidden units.

  Returns:
    A compiled `keras.Model` (binary cross-entropy per tag, ROC AUC over
    tags and per-tag accuracy); tfdist supplies the optimizer.
  """
  inputs = spec.features.keras_inputs()  # {"signal", "channel"}
  num_tags = spec.features.label_shape[0]
  channel = keras.layers.Embedding(8, 4, name="channel_embedding")(
      inputs["channel"])
  x = keras.layers.Concatenate()([inputs["signal"], channel])
  x = keras.layers.Dense(width, activation="relu")(x)
  logits = keras.layers.Dense(num_tags)(x)
  outputs = keras.layers.Activation("sigmoid", dtype="float32",
                                    name="tags")(logits)
  model = keras.Model(inputs, outputs, name="tagger")
  model.compile(loss="binary_crossentropy",
                metrics=[keras.metrics.AUC(multi_label=True, name="auc"),
                         keras.metrics.BinaryAccuracy(name="accuracy")])
  return model
