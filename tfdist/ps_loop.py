"""Asynchronous parameter-server training: the coordinator and the evaluator.

Keras 3's `fit` does not support ParameterServerStrategy, so the chief drives
the `Trainer`'s `train_function` through a `ClusterCoordinator`:

* each worker reads its own copy of the training files
  (`create_per_worker_dataset`; shuffled independently per worker);
* the chief `schedule`s closures of `--steps_per_execution` steps each; the
  workers run them as they come, without waiting for each other (every
  update goes straight to the ps tasks);
* at every log, checkpoint and epoch boundary the chief `join`s (waits for
  every scheduled closure), so boundaries are exact: after the join exactly
  `step` steps have run (a closure lost with a worker is run again on
  another one and counted once);
* the learning rate is a schedule object evaluated from the optimizer's
  step counter, and every optimizer variable is created under the scope
  before the first step (`optimizer.build`), so slots sit beside their
  variables (sharded like their tables);
* checkpoints hold the whole state (sharded tables and their slots, dense
  weights, optimizer, step); `shards.json` beside them records each table's
  shard count, checked on restore.

A lost worker is tolerated. A lost ps task makes the coordinator fail fast
with `ParameterServerError` (exit status 1); restart the cluster (the
launcher's `--max_restarts`) and training resumes from the last checkpoint.

The evaluator (`run_evaluator`) is a side-car: it needs no cluster; it
evaluates each checkpoint once, in step order, and writes `eval/` summaries.
"""

import json
import os
import time
from typing import Optional, Sequence

from absl import logging
import keras
import numpy as np
import tensorflow as tf

import models
from tfdist import batch_plan as batch_plan_lib
from tfdist import datasets
from tfdist import hptune
from tfdist import input_pipeline
from tfdist import lr_schedule
from tfdist import manifest as manifest_lib
from tfdist import optimizers
from tfdist import parameter_server as ps_lib
from tfdist import precision
from tfdist import strategy as strategy_lib
from tfdist.config import ConfigError, TrainConfig
from tfdist.throughput import ThroughputMeter
from tfdist.train_loop import Trainer, binary_auc

# Errors that mean a ps task (or the whole cluster) is gone.
_PS_LOST = (tf.errors.UnavailableError, tf.errors.AbortedError,
            tf.errors.CancelledError, tf.errors.NotFoundError,
            tf.errors.InternalError, tf.errors.UnknownError)
EVAL_RESULTS_FILE = "eval_results.jsonl"


def run_ps_experiment(config: TrainConfig, *,
                      callbacks: Sequence[keras.callbacks.Callback] = ()
                      ) -> dict:
  """Runs this process's role in a parameter-server cluster.

  Returns:
    For the chief, the run manifest; for the evaluator, its results; for
    worker and ps tasks (after the chief finished), `{"role": ...}`.

  Raises:
    ParameterServerError: (chief) a ps task became unreachable.
    ConfigError: invalid configuration or cluster.
  """
  ps_lib.set_grpc_fail_fast()
  if config.distribution_strategy == "auto":
    # `auto` with ps tasks in TF_CONFIG (see uses_parameter_server).
    config = config.replace(distribution_strategy="parameter_server")
  task_type, task_index = ps_lib.current_task()
  if task_type in ("worker", "ps"):
    ps_lib.serve(config.model_dir)
    return {"role": task_type, "index": task_index}
  if task_type == "evaluator":
    return run_evaluator(config)
  if callbacks:
    logging.warning("Keras callbacks are ignored under parameter_server.")
  return run_coordinator(config)


# --- shared set-up --------------------------------------------------------
def _plan(config: TrainConfig, spec, num_replicas: int):
  from tfdist import experiment  # pylint: disable=g-import-not-at-top
  train_files, eval_files = experiment.resolve_data_files(config, spec)
  num_train = input_pipeline.count_records(train_files)
  plan = batch_plan_lib.make_batch_plan(
      num_replicas_in_sync=num_replicas, batch_size=config.batch_size,
      per_replica_batch_size=config.per_replica_batch_size,
      gradient_accumulation_steps=config.gradient_accumulation_steps,
      num_train_examples=num_train)
  total_steps = batch_plan_lib.resolve_train_steps(
      train_steps=config.train_steps, train_epochs=config.train_epochs,
      steps_per_epoch=plan.steps_per_epoch)
  return train_files, eval_files, num_train, plan, total_steps


def _build_model(config: TrainConfig, spec) -> keras.Model:
  if config.model not in models.model_names():
    raise ConfigError(f"--model={config.model!r} is unknown. Known: "
                      f"{', '.join(models.model_names())}.")
  return models.build_model(config.model, input_shape=spec.input_shape,
                            num_classes=spec.num_classes,
                            embedding_dim=config.embedding_dim,
                            hash_buckets=config.hash_buckets)


def _eval_dataset(config, spec, files, batch_size):
  return input_pipeline.make_dataset(input_pipeline.PipelineOptions(
      files=files, parse_fn=spec.parse_fn, global_batch_size=batch_size,
      is_training=False, cache=config.cache_dataset))


def _format_eval(result: dict) -> str:
  text = (f"loss {result['loss']:.4f}, accuracy {result['accuracy']:.4f}")
  if "auc" in result:
    text += f", AUC {result['auc']:.4f}"
  return text + f" on {result['num_examples']} examples"


# --- the chief ------------------------------------------------------------
def run_coordinator(config: TrainConfig) -> dict:
  """Trains on the cluster in TF_CONFIG as its coordinator.

  Returns:
    The run manifest (also written to `model_dir/run_manifest.json`).

  Raises:
    ParameterServerError: a ps task became unreachable; the message names
      the last checkpoint training will resume from.
    ShardCountMismatchError: the checkpoints' shard counts differ.
    ConfigError: invalid configuration.
  """
  started = time.time()
  if config.seed is not None:
    keras.utils.set_random_seed(config.seed)
  if config.dtype not in ("fp32", "bf16"):
    raise ConfigError(
        f"--dtype={config.dtype} is not supported with parameter_server: use "
        "fp32 or bf16 (no loss scaling across asynchronous workers).")
  spec = datasets.get_dataset_spec(config.dataset)
  # --- issue 16: Vertex AI hyperparameter tuning (checked before training).
  hypertune_reporter = None
  if config.hptune_metric:
    hptune.check_metric(config.hptune_metric, task=spec.task)
    hypertune_reporter = hptune.make_hypertune()
  choice = strategy_lib.make_strategy(config)
  if choice.name != "parameter_server":
    raise ConfigError(f"run_coordinator needs parameter_server; the strategy "
                      f"factory chose {choice.name} ({choice.reason}).")
  strategy = choice.strategy
  ps_lib.clear_done(config.model_dir)
  cluster = ps_lib.cluster_resolver().cluster_spec().as_dict()
  num_workers, num_ps = len(cluster["worker"]), len(cluster["ps"])
  train_files, eval_files, num_train, plan, total_steps = _plan(
      config, spec, strategy.num_replicas_in_sync)
  lr_plan = lr_schedule.plan_learning_rate(
      config, global_batch_size=plan.global_batch_size,
      steps_per_epoch=plan.steps_per_epoch, total_steps=total_steps)
  peak_lr, warmup_steps, schedule = (lr_plan.peak_learning_rate,
                                     lr_plan.warmup_steps, lr_plan.schedule)
  logging.info(
      "tfdist plan (parameter_server, asynchronous): %d worker(s), %d ps; "
      "batch %d per worker step; %d train examples; %d steps per epoch; "
      "%d steps in all, %d per scheduled function; learning rate %g "
      "(%s rule from %g at batch %d), warmup %d steps, %s decay",
      num_workers, num_ps, plan.global_batch_size, num_train,
      plan.steps_per_epoch, total_steps, config.steps_per_execution, peak_lr,
      config.lr_scaling, config.base_learning_rate, config.base_batch_size,
      warmup_steps, config.lr_schedule)

  policy = precision.configure_precision(config.dtype)
  with strategy.scope():
    model = _build_model(config, spec)
    optimizer = optimizers.build_optimizer(
        config.optimizer, schedule, momentum=config.momentum,
        weight_decay=config.weight_decay)
    # Every optimizer variable now, under the scope: created lazily in a
    # scheduled function they would land on the coordinator.
    optimizer.build(model.trainable_variables)
  placement = ps_lib.describe_placement(
      model, optimizer, large_bytes=min(config.ps_min_shard_bytes, 64 << 10))
  print(ps_lib.format_placement(placement), flush=True)
  trainer = Trainer(strategy=strategy, model=model, optimizer=optimizer,
                    global_batch_size=plan.global_batch_size,
                    steps_per_execution=config.steps_per_execution,
                    enable_xla=config.enable_xla,
                    run_eagerly=config.run_eagerly, task=spec.task)

  ckpt_dir = config.resolved_checkpoint_dir
  checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer,
                                   global_step=trainer.global_step)
  manager = tf.train.CheckpointManager(
      checkpoint, ckpt_dir, max_to_keep=config.max_checkpoints,
      step_counter=trainer.global_step)
  ps_lib.check_shard_layout(ckpt_dir, model)
  restored = manager.restore_or_initialize()
  step = int(trainer.global_step.numpy())
  if restored:
    print(f"tfdist: restored {restored}: resuming at step {step}",
          flush=True)
  ps_lib.write_shard_layout(ckpt_dir, model)

  coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
  train_options = input_pipeline.PipelineOptions(
      files=train_files, parse_fn=spec.parse_fn,
      global_batch_size=plan.global_batch_size, is_training=True,
      shuffle_buffer_size=config.shuffle_buffer_size,
      cache=config.cache_dataset,
      # Unseeded: each worker must shuffle its copy differently.
      seed=None)

  def per_worker_dataset_fn():
    return strategy.distribute_datasets_from_function(
        lambda ctx: input_pipeline.make_dataset(train_options, ctx))

  # Each worker must shuffle differently. With a global seed set (--seed),
  # the shuffles' op seeds would be fixed when the dataset function is
  # traced here, once, and every worker would read the same examples in the
  # same order (each batch applied once per worker). Unseeded, each worker's
  # shuffle draws its own seed at run time.
  tf.random.set_seed(None)
  per_worker_iterator = iter(
      coordinator.create_per_worker_dataset(per_worker_dataset_fn))

  tb_dir = config.resolved_tensorboard_dir
  writer = tf.summary.create_file_writer(os.path.join(tb_dir, "train"))
  meter = ThroughputMeter(plan.global_batch_size)
  history = []
  train_started = time.time()
  meter.start(step)
  log_sums, log_steps = {}, 0
  last_saved = manager.latest_checkpoint
  try:
    while step < total_steps:
      boundary = _next_boundary(step, total_steps=total_steps,
                                log_steps=config.log_steps,
                                steps_per_epoch=plan.steps_per_epoch,
                                checkpoint_steps=config.checkpoint_steps)
      pending = []
      scheduled = step
      while scheduled < boundary:
        n = min(config.steps_per_execution, boundary - scheduled)
        pending.append(coordinator.schedule(
            trainer.train_function,
            args=(per_worker_iterator, tf.constant(n, tf.int32))))
        scheduled += n
      coordinator.join()
      for remote in pending:
        out = remote.fetch()
        for k, v in out.items():
          log_sums[k] = log_sums.get(k, 0.0) + np.asarray(v, np.float64)
      log_steps += boundary - step
      step = boundary
      trainer.global_step.assign(step)
      if step % config.log_steps == 0 or step == total_steps:
        history.append(_log(step, total_steps, log_sums, log_steps, meter,
                            optimizer, writer))
        log_sums, log_steps = {}, 0
      epoch_end = step % plan.steps_per_epoch == 0
      if ((config.checkpoint_steps and step % config.checkpoint_steps == 0)
          or (not config.checkpoint_steps and epoch_end)
          or step == total_steps):
        last_saved = manager.save(checkpoint_number=step)
        logging.info("Saved %s", last_saved)
  except _PS_LOST as e:
    raise ps_lib.ParameterServerError(
        f"Parameter-server training lost a ps task (or the whole cluster) "
        f"near step {step}: {type(e).__name__}: {str(e).splitlines()[0]}. "
        "Worker failures are tolerated, ps failures are not: restart the "
        "cluster (python -m tfdist.launch ... --max_restarts=N does) and "
        "training resumes from the last checkpoint, "
        f"{last_saved or 'none yet (from step 0)'}.") from e
  train_seconds = time.time() - train_started
  writer.flush()

  # Held-out evaluation on the chief (reads the ps tasks' variables).
  evaluator = Trainer(strategy=tf.distribute.get_strategy(), model=model,
                      optimizer=optimizer,
                      global_batch_size=max(plan.global_batch_size, 1024),
                      task=spec.task)
  final_eval = evaluator.evaluate(_eval_dataset(
      config, spec, eval_files, max(plan.global_batch_size, 1024)))
  final_eval["step"] = step
  with writer.as_default(step=step):
    for key in ("loss", "accuracy", "auc"):
      if key in final_eval:
        tf.summary.scalar(f"final_eval_{key}", final_eval[key])
  writer.flush()
  print(f"tfdist: held-out evaluation at step {step}: "
        f"{_format_eval(final_eval)}", flush=True)
  if hypertune_reporter is not None:
    # --- issue 16: the chief reports its held-out evaluation.
    hptune.report_evaluation(hypertune_reporter, config.hptune_metric,
                             final_eval, step)

  record = {
      **manifest_lib.run_header(config),
      "strategy": choice.name,
      "strategy_reason": choice.reason,
      "parameter_server": {
          "num_workers": num_workers,
          "num_ps": num_ps,
          "cluster": cluster,
          "partitioner": config.ps_partitioner,
          "min_shard_bytes": config.ps_min_shard_bytes,
          "max_shards": config.ps_max_shards or num_ps,
          "steps_per_execution": config.steps_per_execution,
          "placement": placement,
      },
      "global_batch_size": plan.global_batch_size,
      "steps_per_epoch": plan.steps_per_epoch,
      "train_steps": total_steps,
      "final_step": step,
      "optimizer_iterations": int(optimizer.iterations.numpy()),
      "restored_from": restored,
      "peak_learning_rate": peak_lr,
      "warmup_steps": warmup_steps,
      "lr_schedule": keras.saving.serialize_keras_object(schedule),
      "dtype_policy": policy.name,
      "data": {
          "dataset": config.dataset,
          "num_train_examples": num_train,
          "train_files": manifest_lib.file_fingerprints(train_files),
          "eval_files": manifest_lib.file_fingerprints(eval_files),
      },
      "throughput": meter.summary(),
      "history": history,
      "final_metrics": {
          "eval_loss": final_eval["loss"],
          "eval_accuracy": final_eval["accuracy"],
          "eval_auc": final_eval.get("auc"),
          "eval_examples": final_eval["num_examples"],
          "train_loss": history[-1]["loss"] if history else None,
      },
      "artifacts": {"checkpoint": manager.latest_checkpoint,
                    "checkpoint_dir": ckpt_dir, "tensorboard": tb_dir,
                    "evaluator_results": os.path.join(
                        config.model_dir, "eval", EVAL_RESULTS_FILE)},
      "seconds": {"total": time.time() - started, "training": train_seconds},
  }
  path = manifest_lib.write_manifest(config.model_dir, record)
  logging.info("Run manifest: %s", path)
  ps_lib.mark_done(config.model_dir)
  return record


def _next_boundary(step: int, *, total_steps: int, log_steps: int,
                   steps_per_epoch: int, checkpoint_steps: int) -> int:
  """The next step at which the chief joins: log, epoch, checkpoint or end."""
  candidates = [total_steps, (step // log_steps + 1) * log_steps,
                (step // steps_per_epoch + 1) * steps_per_epoch]
  if checkpoint_steps:
    candidates.append((step // checkpoint_steps + 1) * checkpoint_steps)
  return min(candidates)


def _learning_rate(optimizer) -> float:
  return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


def _log(step, total_steps, sums, steps, meter, optimizer, writer) -> dict:
  interval = meter.record(step)
  count = max(float(sums.get("count", 0.0)), 1.0)
  record = {"step": step,
            "loss": float(sums.get("loss", 0.0)) / max(steps, 1),
            "accuracy": float(sums.get("correct", 0.0)) / count,
            "learning_rate": _learning_rate(optimizer)}
  if "pos_hist" in sums:
    record["auc"] = binary_auc(sums["pos_hist"], sums["neg_hist"])
  text = (f"step {step}/{total_steps}: loss {record['loss']:.4f}, accuracy "
          f"{record['accuracy']:.4f}")
  if "auc" in record:
    text += f", AUC {record['auc']:.4f}"
  text += f", learning rate {record['learning_rate']:.6g}"
  with writer.as_default(step=step):
    for key in ("loss", "accuracy", "auc", "learning_rate"):
      if key in record and np.isfinite(record[key]):
        tf.summary.scalar(key, record[key])
    if interval is not None:
      record["examples_per_second"] = interval.examples_per_second
      tf.summary.scalar("examples_per_second", interval.examples_per_second)
      text += f", {interval.examples_per_second:.1f} examples/sec"
      if interval.excluded:
        text += " (warm-up)"
  print(f"tfdist: {text}", flush=True)
  if not np.isfinite(record["loss"]):
    raise FloatingPointError(
        f"Training diverged at step {step}: loss {record['loss']}. Lower "
        "--base_learning_rate or add warmup.")
  return record


# --- the evaluator --------------------------------------------------------
def _checkpoint_step(path: str) -> int:
  try:
    return int(path.rsplit("-", 1)[1])
  except (IndexError, ValueError):
    return -1


def run_evaluator(config: TrainConfig, *, poll_seconds: float = 2.0,
                  idle_timeout: Optional[float] = None) -> dict:
  """Evaluates each new checkpoint once, until the last step's is done.

  Writes `eval/` TensorBoard summaries (loss, accuracy, AUC) at each
  checkpoint's step and appends one JSON line per checkpoint to
  `model_dir/eval/eval_results.jsonl` (a restarted evaluator skips the
  steps already there).

  Args:
    config: the run's config (the same flags as the chief's).
    poll_seconds: how often to look for new checkpoints.
    idle_timeout: stop after this many seconds without a new checkpoint
      (None: wait until the final step or the chief's done marker).

  Returns:
    `{"role": "evaluator", "results": [...]}`.
  """
  spec = datasets.get_dataset_spec(config.dataset)
  _, eval_files, _, plan, total_steps = _plan(config, spec, 1)
  model = _build_model(config, spec)
  trainer = Trainer(strategy=tf.distribute.get_strategy(), model=model,
                    optimizer=keras.optimizers.SGD(),
                    global_batch_size=max(plan.global_batch_size, 1024),
                    task=spec.task)
  dataset = _eval_dataset(config, spec, eval_files,
                          max(plan.global_batch_size, 1024))
  ckpt_dir = config.resolved_checkpoint_dir
  eval_dir = os.path.join(config.model_dir, "eval")
  tf.io.gfile.makedirs(eval_dir)
  results_path = os.path.join(eval_dir, EVAL_RESULTS_FILE)
  done_steps, results = set(), []
  if tf.io.gfile.exists(results_path):
    with tf.io.gfile.GFile(results_path) as f:
      for line in f:
        if line.strip():
          results.append(json.loads(line))
          done_steps.add(results[-1]["step"])
  writer = tf.summary.create_file_writer(
      os.path.join(config.resolved_tensorboard_dir, "eval"))
  started = time.time()
  last_new = time.time()
  print(f"tfdist: evaluator watching {ckpt_dir} (final step {total_steps})",
        flush=True)
  while True:
    state = tf.train.get_checkpoint_state(ckpt_dir)
    paths = list(state.all_model_checkpoint_paths) if state else []
    new = sorted((p for p in paths if _checkpoint_step(p) not in done_steps),
                 key=_checkpoint_step)
    for path in new:
      step = _checkpoint_step(path)
      try:
        tf.train.Checkpoint(model=model).restore(path).expect_partial()
      except (tf.errors.NotFoundError, tf.errors.DataLossError) as e:
        # Deleted by max_to_keep before we got to it.
        logging.warning("Skipping %s: %s", path, e)
        done_steps.add(step)
        continue
      result = trainer.evaluate(dataset)
      result.update(step=step, checkpoint=path, time=time.time())
      with writer.as_default(step=step):
        for key in ("loss", "accuracy", "auc"):
          if key in result:
            tf.summary.scalar(key, result[key])
      writer.flush()
      with tf.io.gfile.GFile(results_path, "a") as f:
        f.write(json.dumps(result) + "\n")
      results.append(result)
      done_steps.add(step)
      last_new = time.time()
      print(f"tfdist: evaluator: step {step}: {_format_eval(result)}",
            flush=True)
    if total_steps in done_steps:
      break
    if ps_lib.marked_done_since(config.model_dir, started) and not new:
      # The chief finished; one more look picked up its last checkpoint.
      state = tf.train.get_checkpoint_state(ckpt_dir)
      latest = state.model_checkpoint_path if state else None
      if latest is None or _checkpoint_step(latest) in done_steps:
        break
    if idle_timeout is not None and time.time() - last_new > idle_timeout:
      logging.warning("Evaluator: no new checkpoint for %.0f s; stopping.",
                      idle_timeout)
      break
    time.sleep(poll_seconds)
  return {"role": "evaluator", "results": results}
