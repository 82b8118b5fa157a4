"""Unit tests of tfdist.parallel.tensor.from_layout_map's refusals and of
the config checks that let `tfdist.fit(layout_map=...)` through (no
training, no devices: Keras's DeviceMesh under TensorFlow is data).

The split models themselves train in tests/tensor_parallel_test.py (its
`LayoutMapTest`: a user's MLP at T = 2 and D x T = 2 x 2 against one
device, and an attention model at T = 2).
"""

import os

from absl.testing import absltest
import keras
import numpy as np

from tfdist import config as config_lib
from tfdist import errors
import tfdist
from tfdist.parallel.tensor import from_layout_map
from tfdist.parallel.tensor import options as tensor_options


def _map(degree=2, axis_names=("batch", "model"), **entries):
  mesh = keras.distribution.DeviceMesh(
      shape=(1, degree), axis_names=list(axis_names),
      devices=[f"cpu:{i}" for i in range(degree)])
  layout_map = keras.distribution.LayoutMap(mesh)
  for key, axes in entries.items():
    layout_map[key] = axes
  return layout_map


def _mlp_map(degree=2):
  layout_map = _map(degree)
  layout_map["up/kernel"] = (None, "model")
  layout_map["down/kernel"] = ("model", None)
  return layout_map


def _mlp(**up):
  inputs = keras.Input((8,))
  up = {"activation": "relu", **up}
  x = keras.layers.Dense(32, name="up", **up)(inputs)
  outputs = keras.layers.Dense(4, name="down")(x)
  return keras.Model(inputs, outputs)


_HEADS = (("mha/(query|key|value)/kernel", (None, "model", None)),
          ("mha/(query|key|value)/bias", ("model", None)),
          ("mha/attention_output/kernel", ("model", None, None)))


def _attention_map():
  layout_map = _map()
  for key, axes in _HEADS:
    layout_map[key] = axes
  return layout_map


def _attention(call=None, **options):
  inputs = keras.Input((5, 8))
  layer = keras.layers.MultiHeadAttention(4, 2, name="mha", **options)
  x = (call or (lambda l, x: l(x, x)))(layer, inputs)
  return keras.Model(inputs, x)


class _Subclassed(keras.Model):

  def __init__(self):
    super().__init__()
    self.up = keras.layers.Dense(32, name="up")
    self.down = keras.layers.Dense(4, name="down")

  def call(self, x):
    return self.down(self.up(x))


class _MyDense(keras.layers.Dense):
  pass


class RefusalTest(absltest.TestCase):
  """Each refusal names the layer, the map entry and what is supported."""

  def assert_refused(self, model, layout_map, *patterns):
    with self.assertRaises(errors.ConfigError) as caught:
      from_layout_map.check(model, layout_map)
    for pattern in patterns:
      self.assertRegex(str(caught.exception), pattern)
    return str(caught.exception)

  def test_the_mlp_plan_passes(self):
    plan = from_layout_map.check(_mlp(), _mlp_map())
    self.assertEqual(plan.layers, {"up": "column", "down": "row"})

  def test_a_subclassed_model_is_refused(self):
    model = _Subclassed()
    model(np.zeros((1, 8), np.float32))
    self.assert_refused(model, _mlp_map(), r"subclassed keras\.Model "
                        r"\(class _Subclassed\)", "clone_model",
                        r"keras\.Model\(inputs, outputs\) or "
                        r"keras\.Sequential")

  def test_an_embedding_split_is_refused(self):
    for axes, how in (((("model", None)), "by vocabulary"),
                      (((None, "model")), "by columns")):
      with self.subTest(how=how):
        inputs = keras.Input((5,), dtype="int32")
        x = keras.layers.Embedding(10, 8, name="emb")(inputs)
        x = keras.layers.Dense(4, name="down")(x)
        layout_map = _map(**{"emb/embeddings": axes})
        if how == "by columns":
          layout_map["down/kernel"] = ("model", None)
        self.assert_refused(keras.Model(inputs, x), layout_map,
                            r"entry 'emb/embeddings' splits Embedding 'emb' "
                            + how, "no tensor-parallel Embedding",
                            "Dense split by columns",
                            "Leave 'emb' replicated")

  def test_an_einsum_dense_split_is_refused(self):
    inputs = keras.Input((8,))
    x = keras.layers.EinsumDense("ab,bc->ac", output_shape=16,
                                 name="up")(inputs)
    x = keras.layers.Dense(4, name="down")(x)
    layout_map = _mlp_map()
    self.assert_refused(keras.Model(inputs, x), layout_map,
                        r"'up/kernel' splits EinsumDense 'up' by columns",
                        "no tensor-parallel EinsumDense")

  def test_a_dense_with_a_regularizer_or_a_subclass_is_refused(self):
    self.assert_refused(_mlp(kernel_regularizer="l2"), _mlp_map(),
                        r"entry 'up/kernel' splits Dense 'up' by columns",
                        "kernel_regularizer", "leave it replicated")
    # A softmax over a column layer's units would see 1/T of them.
    self.assert_refused(_mlp(activation="softmax"), _mlp_map(),
                        r"activation='softmax' \(not elementwise")
    inputs = keras.Input((8,))
    x = _MyDense(32, name="up")(inputs)
    x = keras.layers.Dense(4, name="down")(x)
    # (read_layout_map's refusal: the rules go by the layer's class.)
    self.assert_refused(keras.Model(inputs, x), _mlp_map(),
                        "'up/kernel' of a _MyDense layer",
                        "no tensor-parallel rule for _MyDense")

  def test_attention_with_arguments_the_split_layer_lacks_is_refused(self):
    plan = from_layout_map.check(_attention(), _attention_map())
    self.assertEqual(plan.layers, {"mha": "heads"})
    self.assert_refused(_attention(kernel_regularizer="l2"),
                        _attention_map(),
                        "splits MultiHeadAttention 'mha' by heads",
                        "kernel_regularizer",
                        "ParallelMultiHeadAttention does not take")

  def test_attention_called_with_masks_is_refused_at_the_split(self):
    model = _attention(lambda l, x: l(x, x, return_attention_scores=True)[0])
    with self.assertRaisesRegex(
        errors.ConfigError,
        r"MultiHeadAttention 'mha' is split by heads, and the model calls "
        r"it with return_attention_scores.*attention_mask"):
      from_layout_map.split_model(model, _attention_map(), 2)

  def test_a_nested_model_with_a_split_weight_is_refused(self):
    inner = keras.Sequential([keras.Input((8,)),
                              keras.layers.Dense(32, name="up")],
                             name="inner")
    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(4, name="down")(inner(inputs))
    model = keras.Model(inputs, outputs)
    layout_map = _map()
    layout_map[inner.weights[0].path] = (None, "model")
    self.assert_refused(model, layout_map, "nested model 'inner'")

  def test_the_degree_must_match_the_run(self):
    with self.assertRaisesRegex(errors.ConfigError,
                                r"'model' axis has size 2; the run splits "
                                r"its model 4 ways"):
      from_layout_map.split_model(_mlp(), _mlp_map(), 4)


class DropoutTest(absltest.TestCase):

  def test_a_dropout_inside_a_pair_is_named(self):
    inputs = keras.Input((8,))
    x = keras.layers.Dense(32, activation="relu", name="up")(inputs)
    x = keras.layers.Dropout(0.1, name="inside")(x)
    x = keras.layers.Dense(4, name="down")(x)
    x = keras.layers.Dropout(0.1, name="after")(x)
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(x))
    plan = from_layout_map.check(model, _mlp_map())
    self.assertEqual(from_layout_map.dropouts_inside_pairs(model, plan),
                     ["inside"])
    self.assertEqual(from_layout_map.dropouts_inside_pairs(
        _mlp(), from_layout_map.check(_mlp(), _mlp_map())), [])


class ConfigTest(absltest.TestCase):

  def test_config_changes_set_t_and_record_the_entries(self):
    config = config_lib.TrainConfig(model_dir="/tmp/x")
    changes = from_layout_map.config_changes(config, _mlp_map())
    self.assertEqual(changes, {
        "tensor_parallel": 2,
        "layout_map": (("up/kernel", "(None, 'model')"),
                       ("down/kernel", "('model', None)"))})
    # The model unset ("cnn") or a model of the user's: let through.
    for model in (None, "mymodule:build_mlp"):
      with self.subTest(model=model):
        split = config.replace(**changes, **({"model": model} if model
                                             else {}))
        self.assertEqual(split.tensor_parallel, 2)
        self.assertEqual(split.layout_map, changes["layout_map"])
        # Recorded in the manifest's config (JSON).
        self.assertEqual(split.to_dict()["layout_map"],
                         [list(kv) for kv in changes["layout_map"]])
    # A map of one 'model' device splits nothing.
    self.assertEqual(from_layout_map.config_changes(config, _mlp_map(1)),
                     {})

  def test_a_t_that_disagrees_with_the_map_is_refused(self):
    config = config_lib.TrainConfig(model_dir="/tmp/x", model="transformer",
                                    tensor_parallel=4)
    with self.assertRaisesRegex(
        errors.ConfigError,
        r"tensor_parallel=4 and the layout map's 'model' axis of size 2 "
        r"disagree"):
      from_layout_map.config_changes(config, _mlp_map())

  def test_not_a_layout_map_or_no_model_axis_is_refused(self):
    config = config_lib.TrainConfig(model_dir="/tmp/x")
    with self.assertRaisesRegex(errors.ConfigError,
                                "must be a keras.distribution.LayoutMap; "
                                "received dict"):
      from_layout_map.config_changes(config, {"up/kernel": (None, "model")})
    with self.assertRaisesRegex(errors.ConfigError, "an axis named 'model'"):
      from_layout_map.config_changes(config, _map(axis_names=("batch", "x")))

  def test_without_a_map_other_models_keep_their_refusal(self):
    for model in ("cnn", "mymodule:build_mlp"):
      with self.subTest(model=model):
        with self.assertRaisesRegex(errors.ConfigError,
                                    f"--model={model} has no tensor-parallel "
                                    "layers.*layout_map="):
          config_lib.TrainConfig(model_dir="/tmp/x", model=model,
                                 tensor_parallel=2)

  def test_with_a_map_the_transformer_sizes_are_not_checked(self):
    settings = dict(model="mymodule:build_mlp", distribution_strategy="auto",
                    zero_stage=0, pipeline_stages=1, enable_xla=False,
                    dtype="fp32", clipnorm=None, global_clipnorm=None,
                    init_checkpoint=None, num_gpus=0, num_cpu_devices=3)
    tensor_options.check_flags(tensor_parallel=3, layout_map=True,
                               **settings)
    with self.assertRaisesRegex(errors.ConfigError,
                                "cannot split the built-in Transformer"):
      tensor_options.check_flags(tensor_parallel=3, **{**settings,
                                                       "model": "transformer"})

  def test_fit_refuses_a_disagreeing_map_before_building(self):
    config = config_lib.TrainConfig(
        model_dir=os.path.join(absltest.get_default_test_tmpdir(), "fit"),
        model="transformer", tensor_parallel=4, train_steps=1)
    with self.assertRaisesRegex(errors.ConfigError,
                                "tensor_parallel=4 and the layout map"):
      tfdist.fit(_mlp, x=np.zeros((8, 8), np.float32),
                 y=np.zeros((8, 4), np.float32), config=config,
                 layout_map=_mlp_map(), verbose=0)


if __name__ == "__main__":
  absltest.main()
