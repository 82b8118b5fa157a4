"""The loop section (`config.loop`): how long to train, in what batches,
logging, checkpoints, evaluations, the seed and determinism.

Consumers: `tfdist.training.plan.run_plan` (the batch plan and steps) and the
training loop the runner drives (`tfdist.experiment.runner`,
`tfdist.training.controller`).
"""

import dataclasses
from typing import Optional

from tfdist.config.values import _need
from tfdist.config_tree import setting


# Steps per `tf.function` call on TPU when --steps_per_execution is not
# given: each call is a host -> TPU round trip, so TPUs want many steps each.
TPU_DEFAULT_STEPS_PER_EXECUTION = 100


@dataclasses.dataclass(frozen=True)
class LoopConfig:
  """How long to train, in what batches; logging, checkpoints, evaluations,
  the seed and determinism.

  `batch_size` and `steps_per_execution` None: not resolved yet
  (`TrainConfig`).
  """
  train_steps: int = setting(
      0, "integer", "train", key=True,
      help=("Optimizer updates to train for; when > 0 it overrides "
            "--train_epochs."),
      traits=("operational",))
  train_epochs: int = setting(
      5, "integer", "train", key=True,
      help="Epochs to train for when --train_steps is 0.",
      traits=("operational",))
  epochs_between_evals: int = setting(
      1, "integer", "train",
      help="Evaluate after every this many epochs, and at the end.",
      traits=("operational",))
  batch_size: Optional[int] = setting(
      None, "integer", "train", key=True,
      help=("Global batch size: examples per update over all replicas. Give "
            "this or --per_replica_batch_size. Default (neither given): the "
            "--dataset's recommendation, else 128."),
      traits=("operational", "recommendable"))
  gradient_accumulation_steps: int = setting(
      1, "integer", "train",
      help=("Micro-batches per optimizer update (K): each replica accumulates"
            " the gradients of K micro-batches, then one all-reduce and one "
            "update. The global batch (what --batch_size sets, what the "
            "learning rate is scaled to) is micro-batch x replicas x K, so K "
            "lowers the memory a step needs at the same global batch. Not "
            "with parameter_server."),
      traits=())
  per_replica_batch_size: Optional[int] = setting(
      None, "integer", "train", key=True,
      help=("Examples per replica per step (per micro-step with "
            "--gradient_accumulation_steps); the global batch is this times "
            "num_replicas_in_sync (times --gradient_accumulation_steps)."),
      traits=("operational",))
  log_steps: int = setting(
      100, "integer", "train", key=True,
      help=("Log loss, learning rate, examples/sec and step time every this "
            "many steps."),
      traits=("operational",))
  checkpoint_steps: int = setting(
      0, "integer", "train",
      help=("Save a checkpoint every this many steps; 0 saves at each epoch "
            "end. A checkpoint is always saved at the end."),
      traits=("operational",))
  max_checkpoints: int = setting(
      5, "integer", "train",
      help="Checkpoints to keep.",
      traits=("operational",))
  checkpoint_input_position: bool = setting(
      True, "bool", "train",
      help=("A resumed run continues the epoch where the checkpoint left it, "
            "so each example is still used once per epoch across a restart: "
            "every worker recomputes its position in its shard from the step "
            "(the training input is read in a deterministic order; the "
            "checkpoint records only the input's layout: a change of "
            "files, batch, seed or shuffle buffer discards the position with "
            "a message; on another worker count every worker replays the "
            "checkpoint's workers' order, reading all of the input). "
            "--nocheckpoint_input_position: a resume starts its epoch over."),
      traits=())
  seed: Optional[int] = setting(
      42, "integer", "train",
      help="Random seed for weights and shuffling.",
      traits=())
  run_eagerly: bool = setting(
      False, "bool", "train",
      help="Run the step without tf.function (for debugging).",
      traits=("operational",))
  steps_per_execution: Optional[int] = setting(
      None, "integer", "performance",
      help=("Training steps run inside one tf.function call (fewer round "
            "trips). Default: "
            f"{TPU_DEFAULT_STEPS_PER_EXECUTION} with "
            "--distribution_strategy=tpu, else 1."),
      traits=("decided",))
  deterministic: bool = setting(
      False, "bool", "performance",
      help=("Reproducible runs: TensorFlow's op determinism "
            "(tf.config.experimental.enable_op_determinism) and a "
            "deterministic input order; needs --seed. Slower; not with "
            "parameter_server."),
      traits=())

  def __post_init__(self):
    # How long to train: steps or epochs.
    _need(self.train_steps >= 0, f"--train_steps={self.train_steps} must be "
          ">= 0 (0: use --train_epochs).")
    _need(self.train_epochs >= 0,
          f"--train_epochs={self.train_epochs} must be >= 0.")
    _need(self.train_steps > 0 or self.train_epochs > 0,
          "Set how long to train: --train_steps=N or --train_epochs=N "
          f"(received --train_steps={self.train_steps}, "
          f"--train_epochs={self.train_epochs}).")
    # Batch sizes and gradient accumulation.
    for name in ("batch_size", "per_replica_batch_size"):
      value = getattr(self, name)
      _need(value is None or value > 0,
            f"--{name}={value} must be a positive number of examples.")
    _need(self.gradient_accumulation_steps >= 1,
          f"--gradient_accumulation_steps={self.gradient_accumulation_steps} "
          "must be >= 1 (1: no accumulation).")
    _need(not self.deterministic or self.seed is not None,
          "--deterministic needs a --seed (the seed fixes the initial "
          "weights, dropout and the input order); received no seed. Pass "
          "e.g. --seed=42 or drop --deterministic.")
    # Logging, steps per call, checkpoints and evaluations.
    _need(self.log_steps > 0, f"--log_steps={self.log_steps} must be > 0.")
    _need(self.steps_per_execution is None or self.steps_per_execution > 0,
          f"--steps_per_execution={self.steps_per_execution} must be > 0.")
    _need(self.checkpoint_steps >= 0,
          f"--checkpoint_steps={self.checkpoint_steps} must be >= 0 "
          "(0: checkpoint at the end of every epoch).")
    _need(self.max_checkpoints > 0,
          f"--max_checkpoints={self.max_checkpoints} must be > 0.")
    _need(self.epochs_between_evals > 0,
          f"--epochs_between_evals={self.epochs_between_evals} must be > 0.")
