"""The inner training loop: one `tf.function` step run with `strategy.run`.

Keras 3's `Model.fit` fails under MultiWorkerMirroredStrategy and
ParameterServerStrategy, so tfdist drives Keras 3 models, optimizers and
losses through its own step (as Model Garden's Orbit does). The same
`train_function` serves every strategy: called directly for one device,
Mirrored, MultiWorkerMirrored and TPU, and passed to
`ClusterCoordinator.schedule` under ParameterServerStrategy.

Loss: the per-example loss is averaged over the *global* batch
(`tf.nn.compute_average_loss(..., global_batch_size=...)`); the optimizer
sums gradients over replicas, so the update equals the single-device update
on the whole global batch.
"""

from typing import Dict

import keras
import numpy as np
import tensorflow as tf

TASKS = ("multiclass", "binary")
# Score buckets of the ROC AUC histograms (binary task): AUC from them is
# within 1 / AUC_BUCKETS of the exact value.
AUC_BUCKETS = 1000


def binary_auc(pos_hist, neg_hist) -> float:
  """ROC AUC from per-score-bucket counts of positives and negatives.

  Args:
    pos_hist, neg_hist: float arrays [buckets]: labels 1 and 0 whose
      predicted probability fell in each of `buckets` equal-width buckets of
      [0, 1], lowest first.

  Returns:
    P(score of a random positive > score of a random negative), ties (same
    bucket) counted one half; NaN when either class is absent.
  """
  pos = np.asarray(pos_hist, np.float64)
  neg = np.asarray(neg_hist, np.float64)
  if pos.sum() == 0 or neg.sum() == 0:
    return float("nan")
  neg_below = np.cumsum(neg) - neg
  return float((pos * (neg_below + 0.5 * neg)).sum() / (pos.sum() * neg.sum()))


class Trainer:
  """Owns the compiled step functions of one run.

  Args:
    strategy: the `tf.distribute.Strategy`; `model` and `optimizer` must have
      been created under its scope.
    model: a Keras 3 model returning float32 logits [batch, num_classes]
      (task `multiclass`) or probabilities [batch, 1] (task `binary`).
    optimizer: a built Keras 3 optimizer (possibly a `LossScaleOptimizer`).
    global_batch_size: examples per update over all replicas.
    steps_per_execution: training steps run inside one `tf.function` call.
    enable_xla: jit-compile the per-replica forward and backward pass (XLA);
      the optimizer update runs outside the compiled function.
    run_eagerly: run without `tf.function` (debugging).
    task: `multiclass` (sparse categorical cross-entropy on logits,
      accuracy) or `binary` (binary cross-entropy on probabilities, accuracy
      at 0.5, and AUC histograms `pos_hist`/`neg_hist` [AUC_BUCKETS] in every
      step's and evaluation's sums).
    eval_example_weights: evaluation batches carry a third element, float32
      weights [batch] (1 for real examples, 0 for padding), as
      `input_pipeline.pad_to_static_batches` makes for TPUs.

  Raises:
    ValueError: unknown `task`.
  """

  def __init__(self, *, strategy: tf.distribute.Strategy, model: keras.Model,
               optimizer: keras.optimizers.Optimizer, global_batch_size: int,
               steps_per_execution: int = 1, enable_xla: bool = False,
               run_eagerly: bool = False, task: str = "multiclass",
               eval_example_weights: bool = False):
    self.strategy = strategy
    self.model = model
    self.optimizer = optimizer
    self.global_batch_size = int(global_batch_size)
    self.steps_per_execution = int(steps_per_execution)
    self.eval_example_weights = bool(eval_example_weights)
    if task not in TASKS:
      raise ValueError(f"task must be one of {TASKS}. Received: task={task!r}")
    self.task = task
    if task == "binary":
      self.loss_fn = keras.losses.BinaryCrossentropy(reduction=None)
    else:
      self.loss_fn = keras.losses.SparseCategoricalCrossentropy(
          from_logits=True, reduction=None)
    self.uses_loss_scale = isinstance(optimizer,
                                      keras.optimizers.LossScaleOptimizer)
    with strategy.scope():
      # Counts updates made by this loop (skipped fp16 steps included), for
      # checkpoint numbering and resumption.
      self.global_step = tf.Variable(
          0, dtype=tf.int64, trainable=False, name="global_step",
          aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    # XLA compiles the per-replica forward and backward pass; Keras 3 turns
    # XLA off under a tf.distribute strategy, so tfdist applies it to its own
    # step. The gradients are applied outside the compiled function: the
    # optimizer's cross-replica all-reduce (a merge_call) and its variables
    # on other devices cannot be compiled into one replica's XLA cluster.
    self.xla_applied = bool(enable_xla) and not run_eagerly
    self._replica_grads = (tf.function(self._replica_forward_backward,
                                       jit_compile=True)
                           if self.xla_applied
                           else self._replica_forward_backward)
    self._replica_train = self._replica_train_step
    compile_fn = (lambda f: f) if run_eagerly else tf.function
    self.train_function = compile_fn(self._train_function)
    self.eval_function = compile_fn(self._eval_function)

  # --- replica functions -------------------------------------------------
  def _metric_sums(self, labels, outputs, weights=None
                   ) -> Dict[str, tf.Tensor]:
    """Per-batch sums: `correct`, `count`, and for `binary` the AUC
    histograms. `weights` (float32 [batch], 1 real / 0 padding) masks the
    padding of static-shape evaluation batches."""
    if weights is None:
      weights = tf.ones(tf.shape(labels)[:1], tf.float32)
    count = tf.reduce_sum(weights)
    if self.task != "binary":
      correct = keras.metrics.sparse_categorical_accuracy(labels, outputs)
      return {"correct": tf.reduce_sum(tf.cast(correct, tf.float32) *
                                       weights),
              "count": count}
    probs = tf.reshape(tf.cast(outputs, tf.float32), [-1])
    truth = tf.cast(tf.reshape(labels, [-1]), tf.float32)
    correct = tf.cast(tf.equal(tf.cast(probs >= 0.5, tf.float32), truth),
                      tf.float32)
    bucket = tf.clip_by_value(
        tf.cast(tf.floor(probs * AUC_BUCKETS), tf.int32), 0, AUC_BUCKETS - 1)
    return {"correct": tf.reduce_sum(correct * weights), "count": count,
            "pos_hist": tf.math.unsorted_segment_sum(truth * weights, bucket,
                                                     AUC_BUCKETS),
            "neg_hist": tf.math.unsorted_segment_sum(
                (1.0 - truth) * weights, bucket, AUC_BUCKETS)}

  def _loss_labels(self, labels):
    if self.task == "binary":
      return tf.reshape(tf.cast(labels, tf.float32), [-1, 1])
    return labels

  def _replica_forward_backward(self, inputs, labels):
    """Loss, gradients and metric sums of one replica's batch (no update)."""
    with tf.GradientTape() as tape:
      logits = self.model(inputs, training=True)
      per_example = self.loss_fn(self._loss_labels(labels),
                                 tf.cast(logits, tf.float32))
      loss = tf.nn.compute_average_loss(
          per_example, global_batch_size=self.global_batch_size)
      if self.model.losses:
        loss += tf.nn.scale_regularization_loss(tf.add_n(self.model.losses))
      scaled = self.optimizer.scale_loss(loss) if self.uses_loss_scale else loss
    grads = tape.gradient(scaled, self.model.trainable_variables)
    return loss, grads, self._metric_sums(labels, logits)

  def _replica_train_step(self, inputs, labels):
    loss, grads, sums = self._replica_grads(inputs, labels)
    self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
    return {"loss": loss, **sums}

  def _replica_eval_sums(self, inputs, labels, weights=None):
    logits = tf.cast(self.model(inputs, training=False), tf.float32)
    per_example = self.loss_fn(self._loss_labels(labels), logits)
    if weights is not None:
      per_example = per_example * weights
    return {"loss_sum": tf.reduce_sum(per_example),
            **self._metric_sums(labels, logits, weights)}

  def _replica_eval_step(self, inputs, labels, weights=None):
    # When the last evaluation round has fewer batches than replicas, the
    # others get an empty batch. TensorFlow 2.21's oneDNN CPU kernels fail on
    # those ("Incompatible shapes: [64] vs. [0,14,14,32]" in the CNN), so an
    # empty batch skips the model and adds zeros.
    def empty():
      sums = {"loss_sum": 0.0, "correct": 0.0, "count": 0.0}
      if self.task == "binary":
        sums.update(pos_hist=tf.zeros([AUC_BUCKETS]),
                    neg_hist=tf.zeros([AUC_BUCKETS]))
      return {k: tf.convert_to_tensor(v, tf.float32) for k, v in sums.items()}

    return tf.cond(tf.shape(labels)[0] > 0,
                   lambda: self._replica_eval_sums(inputs, labels, weights),
                   empty)

  # --- cross-replica functions -------------------------------------------
  def _reduce(self, per_replica: Dict[str, tf.Tensor]) -> Dict[str, tf.Tensor]:
    return {k: self.strategy.reduce(tf.distribute.ReduceOp.SUM, v, axis=None)
            for k, v in per_replica.items()}

  def _train_step(self, iterator) -> Dict[str, tf.Tensor]:
    inputs, labels = next(iterator)[:2]
    return self._reduce(self.strategy.run(self._replica_train,
                                          args=(inputs, labels)))

  def _train_function(self, iterator, num_steps) -> Dict[str, tf.Tensor]:
    """Runs `num_steps` steps from a distributed iterator.

    Args:
      iterator: an iterator over a distributed dataset of `(inputs, labels)`.
      num_steps: int32 scalar tensor, at most `steps_per_execution` (a tensor
        so that shorter final chunks do not retrace the function).

    Returns:
      Sums over the executed steps: `loss` (sum of per-step global mean
      losses, float32 scalar), `correct` and `count` (examples).
    """
    if self.steps_per_execution == 1:
      # One step, no loop (as Keras's fit runs steps_per_execution=1).
      totals = self._train_step(iterator)
      num_steps = 1
    else:
      totals = {"loss": tf.constant(0.0), "correct": tf.constant(0.0),
                "count": tf.constant(0.0)}
      if self.task == "binary":
        totals["pos_hist"] = tf.zeros([AUC_BUCKETS])
        totals["neg_hist"] = tf.zeros([AUC_BUCKETS])
      for _ in tf.range(num_steps):
        step = self._train_step(iterator)
        totals = {k: totals[k] + step[k] for k in totals}
    # Counted once per call, after the steps: a call that fails part-way
    # (a parameter-server worker lost mid-closure, then rerun elsewhere)
    # adds nothing.
    self.global_step.assign_add(tf.cast(num_steps, tf.int64))
    return totals

  def _eval_function(self, batch) -> Dict[str, tf.Tensor]:
    """Evaluates one distributed batch; returns summed loss, correct, count.

    With `eval_example_weights` the batch is `(inputs, labels, weights)`,
    weights float32 [batch] (0 for padding); else `(inputs, labels, ...)`.
    """
    args = tuple(batch[:3] if self.eval_example_weights else batch[:2])
    return self._reduce(self.strategy.run(self._replica_eval_step,
                                          args=args))

  def evaluate(self, dist_dataset) -> Dict[str, float]:
    """Evaluates every example of `dist_dataset` exactly once.

    Returns:
      `{"loss": mean loss, "accuracy": fraction correct, "num_examples": n}`,
      plus `"auc"` (ROC AUC) for task `binary`.
    """
    sums = {"loss_sum": 0.0, "correct": 0.0, "count": 0.0}
    if self.task == "binary":
      sums.update(pos_hist=np.zeros(AUC_BUCKETS), neg_hist=np.zeros(
          AUC_BUCKETS))
    for batch in dist_dataset:
      out = self.eval_function(batch)
      for k in sums:
        sums[k] = sums[k] + np.asarray(out[k], np.float64)
    n = max(float(sums["count"]), 1.0)
    result = {"loss": float(sums["loss_sum"]) / n,
              "accuracy": float(sums["correct"]) / n,
              "num_examples": int(sums["count"])}
    if self.task == "binary":
      result["auc"] = binary_auc(sums["pos_hist"], sums["neg_hist"])
    return result
