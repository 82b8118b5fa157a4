"""`run_experiment`: the whole run, from a `TrainConfig` to artifacts.

Data flows one way: config -> strategy -> batch plan and LR schedule ->
input pipeline -> model -> training loop -> artifacts (checkpoints, SavedModel,
TensorBoard, run manifest). Every input is checked before the first expensive
step (model building, data conversion aside).
"""

import atexit
import dataclasses
import os
import shutil
import tempfile
import time
from typing import Optional, Sequence

from absl import logging
import keras
import tensorflow as tf

import models
from tfdist import allocator
from tfdist import auto_select
from tfdist import batch_plan as batch_plan_lib
from tfdist import cluster as cluster_lib
from tfdist import datasets
from tfdist import devices
from tfdist import export
from tfdist import input_pipeline
from tfdist import lr_schedule
from tfdist import manifest as manifest_lib
from tfdist import optimizers
from tfdist import precision
from tfdist import preemption
from tfdist import strategy as strategy_lib
from tfdist import tpu as tpu_lib
from tfdist.config import ConfigError, TrainConfig
from tfdist.controller import Controller, ControllerOptions
from tfdist.train_loop import Trainer


def resolve_data_files(config: TrainConfig, spec: datasets.DatasetSpec):
  """Returns (train_files, eval_files), converting the named data set if the
  flags do not give files.

  Raises:
    DataNotFoundError: a glob matches nothing, or the raw data is missing.
  """
  train_pattern, eval_pattern = config.train_files, config.eval_files
  if not train_pattern or not eval_pattern:
    default_train, default_eval = spec.prepare(
        config.data_dir or datasets.default_data_dir(), config.raw_data_dir)
    train_pattern = train_pattern or default_train
    eval_pattern = eval_pattern or default_eval
  return (input_pipeline.list_files(train_pattern, flag="--train_files"),
          input_pipeline.list_files(eval_pattern, flag="--eval_files"))


def describe_plan(plan: batch_plan_lib.BatchPlan, *, strategy_name: str,
                  base_lr: float, base_batch_size: int, rule: str,
                  peak_lr: float, warmup_steps: int, total_steps: int,
                  dtype: str) -> str:
  """The batch and learning-rate plan as printed at start."""
  return "\n".join([
      "tfdist plan:",
      f"  strategy               {strategy_name}",
      f"  num_replicas_in_sync   {plan.num_replicas_in_sync}",
      f"  per_replica_batch_size {plan.per_replica_batch_size}",
      f"  gradient_accumulation  {plan.gradient_accumulation_steps}",
      f"  global_batch_size      {plan.global_batch_size}",
      f"  train examples         {plan.num_train_examples}",
      f"  steps_per_epoch        {plan.steps_per_epoch} (remainder dropped)",
      f"  train steps            {total_steps}",
      f"  learning rate          {base_lr:g} at batch {base_batch_size} -> "
      f"{peak_lr:g} at batch {plan.global_batch_size} ({rule} rule)",
      f"  warmup_steps           {warmup_steps}",
      f"  dtype                  {dtype} "
      f"({precision.policy_name(dtype)})",
  ])


def data_patterns(config: TrainConfig) -> list:
  """`(flag, path)` pairs of what the run reads, for the TPU `gs://` rule."""
  out = []
  for flag, value in (("--train_files", config.train_files),
                      ("--eval_files", config.eval_files)):
    if value:
      out.append((flag, value))
  if not (config.train_files and config.eval_files):
    out.append(("--data_dir", config.data_dir or datasets.default_data_dir()))
  return out


def _worker_scratch_dir(cluster: cluster_lib.ClusterInfo) -> str:
  """A local folder for a non-chief worker's writes, deleted at exit."""
  path = tempfile.mkdtemp(
      prefix=f"tfdist-{cluster.task_type}{cluster.task_index}-",
      dir=os.environ.get("TEST_TMPDIR") or None)
  atexit.register(shutil.rmtree, path, True)
  return path


def resolve_strategy_and_precision(config: TrainConfig, *,
                                   strategy_reason: Optional[str] = None):
  """Resolves `auto`, applies the TPU defaults and checks the TPU rules.

  Runs before anything expensive: nothing is probed unless the strategy or
  the dtype is `auto` (then the TPU probe is bounded), and with an explicit
  `--distribution_strategy=tpu` the TPU rules are checked before connecting.
  Prints the decision and its reasons.

  Args:
    config: the run's config.
    strategy_reason: the reason to report when the strategy was already
      decided (multi-worker clusters decide before this runs).

  Returns:
    `(config, decision)`: the config with concrete strategy and dtype, and
    the `auto_select.Decision`.

  Raises:
    ConfigError: fp16 on TPU, local input files with a remote TPU, invalid
      cluster variables.
  """
  decision = auto_select.resolve(config)
  if strategy_reason:
    decision = dataclasses.replace(decision, strategy_reason=strategy_reason)
  config = auto_select.apply_decision(config, decision)
  if decision.strategy == "tpu":
    tpu_lib.validate_tpu_config(config, data_patterns=data_patterns(config))
  print(decision.describe(), flush=True)
  logging.info("%s", decision.describe())
  return config, decision


def run_experiment(config: TrainConfig, *,
                   callbacks: Sequence[keras.callbacks.Callback] = ()) -> dict:
  """Trains, evaluates and exports as `config` says.

  Args:
    config: a validated `TrainConfig`.
    callbacks: extra Keras callbacks for the training loop.

  Returns:
    The run manifest (also written to `model_dir/run_manifest.json`).

  Raises:
    ConfigError: invalid or inconsistent configuration (before training).
    DataNotFoundError: missing data.
    tfdist.preemption.PreemptedError: SIGTERM or SIGINT stopped training
      after a checkpoint was saved (rerun to resume).
  """
  allocator.configure_allocator(config.tune_allocator)
  # Every role of a parameter-server cluster (chief, worker, ps, evaluator)
  # runs its own program there.
  from tfdist import parameter_server  # pylint: disable=g-import-not-at-top
  if parameter_server.uses_parameter_server(config):
    from tfdist import ps_loop  # pylint: disable=g-import-not-at-top
    return ps_loop.run_ps_experiment(config, callbacks=callbacks)
  started = time.time()
  cluster = cluster_lib.resolve_cluster(worker_hosts=config.worker_hosts,
                                        task_index=config.task_index)
  if cluster.source != "single_process":
    print(cluster.describe(), flush=True)
  logging.info("%s", cluster.describe())
  early_choice = None
  if config.distribution_strategy == "multi_worker_mirrored" or (
      config.distribution_strategy == "auto" and cluster.num_workers > 1 and
      not cluster.num_ps):
    # MultiWorkerMirroredStrategy must be built before anything starts
    # TensorFlow's runtime (listing devices does); the factory decides `auto`
    # for such a cluster from the cluster alone.
    early_choice = strategy_lib.make_strategy(config)
    config = config.replace(distribution_strategy=early_choice.name)
  devices.configure_cpu_devices(config.num_cpu_devices)
  if config.seed is not None:
    keras.utils.set_random_seed(config.seed)
  spec = datasets.get_dataset_spec(config.dataset)
  if config.model not in models.model_names():
    raise ConfigError(f"--model={config.model!r} is unknown. Known: "
                      f"{', '.join(models.model_names())}.")
  config, decision = resolve_strategy_and_precision(
      config, strategy_reason=early_choice.reason if early_choice else None)
  choice = early_choice or strategy_lib.make_strategy(config)
  choice = dataclasses.replace(choice, reason=decision.strategy_reason)
  on_tpu = choice.name == "tpu"
  strategy = choice.strategy
  # Under MultiWorkerMirroredStrategy every worker reads its own part of the
  # data, and only the chief writes to --model_dir; the others write what
  # they must (checkpoint saving and export are collective) to a scratch
  # folder they delete (Model Garden's pattern).
  multi_worker = choice.name == "multi_worker_mirrored"
  num_workers = cluster.num_workers if multi_worker else 1
  is_writer = cluster.is_chief if multi_worker else True
  scratch_dir = None if is_writer else _worker_scratch_dir(cluster)
  # Replaces TensorFlow's own SIGTERM handler (installed with the strategy).
  watcher = preemption.PreemptionWatcher(
      strategy=strategy, num_workers=num_workers,
      grace_seconds=config.preemption_grace_seconds).install()
  train_files, eval_files = resolve_data_files(config, spec)
  num_train_examples = input_pipeline.count_records(train_files)
  plan = batch_plan_lib.make_batch_plan(
      num_replicas_in_sync=strategy.num_replicas_in_sync,
      batch_size=config.batch_size,
      per_replica_batch_size=config.per_replica_batch_size,
      gradient_accumulation_steps=config.gradient_accumulation_steps,
      num_train_examples=num_train_examples,
      num_input_pipelines=num_workers)
  total_steps = batch_plan_lib.resolve_train_steps(
      train_steps=config.train_steps, train_epochs=config.train_epochs,
      steps_per_epoch=plan.steps_per_epoch)
  lr_plan = lr_schedule.plan_learning_rate(
      config, global_batch_size=plan.global_batch_size,
      steps_per_epoch=plan.steps_per_epoch, total_steps=total_steps)
  peak_lr, warmup_steps, schedule = (lr_plan.peak_learning_rate,
                                     lr_plan.warmup_steps, lr_plan.schedule)
  plan_text = describe_plan(
      plan, strategy_name=f"{choice.name} ({choice.reason})",
      base_lr=config.base_learning_rate, base_batch_size=config.base_batch_size,
      rule=config.lr_scaling, peak_lr=peak_lr, warmup_steps=warmup_steps,
      total_steps=total_steps, dtype=config.dtype)
  logging.info("%s", plan_text)

  policy = precision.configure_precision(config.dtype)
  with strategy.scope():
    model = models.build_model(config.model, input_shape=spec.input_shape,
                               num_classes=spec.num_classes,
                               embedding_dim=config.embedding_dim,
                               hash_buckets=config.hash_buckets)
    optimizer = precision.wrap_optimizer_for_precision(
        optimizers.build_optimizer(config.optimizer, schedule,
                                   momentum=config.momentum,
                                   weight_decay=config.weight_decay),
        dtype=config.dtype, loss_scale=config.loss_scale)
    # Create every optimizer variable now, under the scope (not lazily inside
    # the first step, where ParameterServerStrategy would place it on the
    # coordinator).
    optimizer.build(model.trainable_variables)
  model.optimizer = optimizer  # Keras callbacks read `model.optimizer`.
  trainer = Trainer(strategy=strategy, model=model, optimizer=optimizer,
                    global_batch_size=plan.global_batch_size,
                    steps_per_execution=config.steps_per_execution,
                    # TPUs compile everything with XLA already.
                    enable_xla=config.enable_xla and not on_tpu,
                    run_eagerly=config.run_eagerly, task=spec.task,
                    eval_example_weights=on_tpu)
  if config.enable_xla:
    logging.info(
        "--enable_xla: %s", "TPUs compile every step with XLA already."
        if on_tpu else "Keras 3 turns XLA off under a tf.distribute "
        "strategy, so tfdist jit-compiles its own per-replica forward and "
        "backward pass (the optimizer update stays outside XLA).")

  checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer,
                                   global_step=trainer.global_step)
  manager = tf.train.CheckpointManager(
      checkpoint, (config.resolved_checkpoint_dir if is_writer else
                   os.path.join(scratch_dir, "checkpoints")),
      max_to_keep=config.max_checkpoints, step_counter=trainer.global_step)

  train_data = input_pipeline.distribute(strategy, input_pipeline.PipelineOptions(
      files=train_files, parse_fn=spec.parse_fn,
      global_batch_size=plan.global_batch_size, is_training=True,
      shuffle_buffer_size=config.shuffle_buffer_size,
      cache=config.cache_dataset, seed=config.seed))
  eval_data = input_pipeline.distribute(strategy, input_pipeline.PipelineOptions(
      files=eval_files, parse_fn=spec.parse_fn,
      global_batch_size=plan.global_batch_size, is_training=False,
      cache=config.cache_dataset,
      # TPUs need static shapes: pad the last batches, masked in the metrics.
      pad_to_static_batches=on_tpu))

  tb_dir = (config.resolved_tensorboard_dir if is_writer else
            os.path.join(scratch_dir, "tensorboard"))
  summary_writer = tf.summary.create_file_writer(os.path.join(tb_dir, "train"))
  all_callbacks = [keras.callbacks.TensorBoard(log_dir=tb_dir,
                                               write_graph=False)]
  all_callbacks += list(callbacks)
  controller = Controller(
      trainer=trainer,
      options=ControllerOptions(
          total_steps=total_steps, steps_per_epoch=plan.steps_per_epoch,
          log_steps=config.log_steps, checkpoint_steps=config.checkpoint_steps,
          epochs_between_evals=config.epochs_between_evals,
          steps_per_execution=config.steps_per_execution),
      train_iterator=iter(train_data), eval_dataset=eval_data,
      checkpoint_manager=manager, summary_writer=summary_writer,
      callbacks=all_callbacks, preemption=watcher,
      restore_dir=None if is_writer else config.resolved_checkpoint_dir)
  train_started = time.time()
  try:
    final_eval = controller.run()
  finally:
    watcher.uninstall()
  train_seconds = time.time() - train_started
  summary_writer.flush()

  export_dir = export.export_saved_model(
      model, config.resolved_export_dir if is_writer else
      os.path.join(scratch_dir, "saved_model"))
  throughput = controller.meter.summary()
  record = {
      **manifest_lib.run_header(config),
      "devices": devices.describe_devices(),
      "strategy": choice.name,
      "strategy_reason": choice.reason,
      "dtype": config.dtype,
      "dtype_reason": decision.dtype_reason,
      "replica_devices": list(choice.devices),
      "num_replicas_in_sync": plan.num_replicas_in_sync,
      "num_workers": num_workers,
      "cluster": {"source": cluster.source, "task_type": cluster.task_type,
                  "task_index": cluster.task_index,
                  "jobs": cluster.cluster_dict()},
      "per_replica_batch_size": plan.per_replica_batch_size,
      "global_batch_size": plan.global_batch_size,
      "gradient_accumulation_steps": plan.gradient_accumulation_steps,
      "steps_per_epoch": plan.steps_per_epoch,
      "train_steps": total_steps,
      "final_step": controller.step,
      "base_learning_rate": config.base_learning_rate,
      "base_batch_size": config.base_batch_size,
      "lr_scaling": config.lr_scaling,
      "peak_learning_rate": peak_lr,
      "warmup_steps": warmup_steps,
      "lr_schedule": keras.saving.serialize_keras_object(schedule),
      "dtype_policy": policy.name,
      "loss_scale": precision.current_loss_scale(optimizer),
      "data": {
          "dataset": config.dataset,
          "num_train_examples": num_train_examples,
          "train_files": manifest_lib.file_fingerprints(train_files),
          "eval_files": manifest_lib.file_fingerprints(eval_files),
      },
      "throughput": throughput,
      "history": controller.history,
      "eval_history": controller.eval_history,
      "final_metrics": {
          "eval_loss": final_eval["loss"] if final_eval else None,
          "eval_accuracy": final_eval["accuracy"] if final_eval else None,
          "eval_auc": final_eval.get("auc") if final_eval else None,
          "eval_examples": final_eval["num_examples"] if final_eval else None,
          "train_loss": (controller.history[-1]["loss"]
                         if controller.history else None),
      },
      "artifacts": {
          "checkpoint": manager.latest_checkpoint,
          "saved_model": export_dir,
          "tensorboard": tb_dir,
      },
      "seconds": {"total": time.time() - started, "training": train_seconds},
  }
  if not is_writer:
    shutil.rmtree(scratch_dir, ignore_errors=True)
    logging.info("%s %d done; the chief writes the artifacts.",
                 cluster.task_type, cluster.task_index)
    return record
  path = manifest_lib.write_manifest(config.model_dir, record)
  logging.info("Run manifest: %s", path)
  print(f"Final eval: loss {record['final_metrics']['eval_loss']:.4f}, "
        f"accuracy {record['final_metrics']['eval_accuracy']:.4f} "
        f"({record['final_metrics']['eval_examples']} examples). "
        f"Artifacts in {config.model_dir}", flush=True)
  return record
