"""A run stopped mid-epoch and resumed sees the same examples: the input
pipeline, and real runs on one device and under MirroredStrategy.

Before, a resumed run started its input at the beginning of epoch 0's
order again: a restarted run's first 40 batches shared 38.9% of their
examples with the first run's (8.5% by chance). Now every worker
recomputes its position from the restored step (`tfdist.data.input_pipeline`,
`tfdist.training.state.checkpointing.InputPosition`).

* The pipeline (in this process): resumed at step s, each worker's
  `make_dataset` yields exactly the batches an uninterrupted one yields
  from step s on: one worker, two workers on balanced record ranges, two
  replicas with gradient accumulation; the checkpoint records the layout,
  a changed layout (files, seed) discards the position with a message,
  and a changed worker count replays the checkpoint's workers' order;
  checkpoints without a position still restore. A dataset function that
  takes `input_context` resumed mid-pass equals its uninterrupted stream
  (before: read from the start); 2 workers' global batches are replayed
  exactly on 1 and on 4 workers, for a function that shards itself, one
  tfdist shards and one whose shuffle draws its seed from the global seed.
* Real runs, `--deterministic`: run A trains 8 steps uninterrupted
  (checkpoints at 3 and 6, 5 steps per epoch); run B resumes from A's
  step-3 checkpoint (mid-epoch) in another folder and trains to 8. The
  example ids B's training used (recorded by
  `tests.input_position_testlib`) equal A's from step 4 on, and B ends
  with A's weights (the cnn: its dropout continues from the checkpoint's
  random state): one device and 2 Mirrored replicas with 2-step
  accumulation, both on 2 logical CPUs set before TensorFlow starts: in
  this process, whose first tests they are (`ResumedRunsTest` comes first
  in the file), or in one child process while this one waits when
  TensorFlow already ran here. Two MultiWorkerMirrored
  workers through `tfdist.launch` are `tests/input_position_test.py` (a
  cluster target); this file runs one TensorFlow process at a time.
* The other input forms (`tests.resume_forms_testlib`), through
  `tfdist.fit` in the same process, run A against run B resumed from A's
  step-3 checkpoint, within 1e-6 in every weight and optimizer slot: a
  dataset function with its own unseeded shuffle (before: its epoch
  started over at resume, 5e-2 off), a `PyDataset` and a generator (which
  says at resume what its resumed epoch sees), on one device and under
  Mirrored; a dataset function taking `input_context` (before: no
  position) and NumPy arrays under Mirrored; the dataset function also
  through 2 pipeline stages and under ZeRO stage 3 on 2 Mirrored
  replicas; and ZeRO stage 3 resumed on 4 replicas from the checkpoint of
  that 2-replica run (one more child process: the logical devices are
  fixed per process).

Cost (pytest on 2 cores, load 3-5, 4 December 2026): 23 s in all, the
child's four runs (8 steps each) included. With the other input forms and
the world-size runs (6 December 2026, load 10-11 from other jobs): 5 min
18 s wall, about 70 s of CPU (the forms' 16 small runs and the two
world-size children; 7 December 2026: one world-size child, its run A
being the first child's ZeRO stage 3 run A). 8 December 2026 (load 5-7):
87 s of CPU with the runs in a child, 72 s with them in this process.
"""

import json
import os
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized
import pytest

from tests import input_position_testlib as ids_lib
from tests import resume_forms_testlib as forms_lib
from tests import testutil

_CHILD_ENV = "TFDIST_INPUT_POSITION_CHILD"


_CHILD_RESULTS = {}


def _child_results() -> dict:
  """`_child_main`'s results, once per test process, with the lines it
  logged under "output": in this process when its CPU can still be split
  (no test ran TensorFlow here before: this class runs first in the file,
  so TensorFlow's start-up is paid once), else in a child process (this
  file run as a script)."""
  if not _CHILD_RESULTS:
    data = testutil.fashion_mnist_subset(limit=ids_lib.LIMIT,
                                         train_shards=2, test_shards=1)
    out = testutil.scratch_dir()
    spec = {"data": data, "out": out}
    if testutil.two_logical_cpus():
      results, output = _in_this_process(spec)
    else:
      results, output = _in_a_child(spec)
    _CHILD_RESULTS.update(results, output=output, out=out)
  return _CHILD_RESULTS


def _in_this_process(spec: dict):
  """`_child_main(spec)` here: its results (as JSON gives them back) and
  the lines it logged; absl's logger level and the input pipeline's
  `make_dataset` (wrapped to record ids) restored after it."""
  from absl import logging  # pylint: disable=g-import-not-at-top
  from tfdist.data import input_pipeline  # pylint: disable=g-import-not-at-top
  make_dataset = input_pipeline.make_dataset
  absl_logger = logging.get_absl_logger()
  level = absl_logger.level
  try:
    with _log_lines() as lines:
      results = json.loads(json.dumps(_child_main(spec)))
  finally:
    input_pipeline.make_dataset = make_dataset
    absl_logger.setLevel(level)
  return results, "\n".join(lines)


def _in_a_child(spec: dict):
  """`_child_main(spec)` in a child process: its results and output."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
             **{_CHILD_ENV: json.dumps(spec)})
  env["PYTHONPATH"] = testutil.REPO_ROOT + os.pathsep + env.get(
      "PYTHONPATH", "")
  proc = subprocess.run([sys.executable, os.path.abspath(__file__)],
                        cwd=testutil.REPO_ROOT, env=env,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        # 20 runs (4 on files, 16 of the forms).
                        text=True, timeout=2 * ids_lib.TIMEOUT_S)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
  assert proc.returncode == 0 and lines, proc.stdout[-4000:]
  return json.loads(lines[-1]), proc.stdout


class ResumedRunsTest(absltest.TestCase):
  """Runs A (uninterrupted) and B (resumed from A's step-3 checkpoint)."""

  def test_one_device_and_mirrored(self):
    results = _child_results()
    self.assertIn("input position restored: step 3 continues epoch 1",
                  results["output"])
    # Mirrored: 2 replicas x 2 micro-batches per step.
    for label, batches_per_step, micro_steps in (("one_device", 1, 5),
                                                 ("mirrored", 4, 10)):
      result = results[label]
      self.assertEqual(result["restored_from"].rsplit("/", 1)[-1], "ckpt-3")
      self.assertEqual(result["micro_steps"], micro_steps)
      ids_lib.compare_runs(self, result["ids_a"], result["ids_b"],
                           result["weights"], batches_per_step, label)
      self.assertGreater(result["moved"], 1e-3)

  def test_every_input_form_resumes_exactly(self):
    # A dataset function (before: its epoch started over, 5e-2 off in
    # weights), a PyDataset and a generator (`tfdist.fit`'s forms), one
    # device and Mirrored; a dataset function through a pipeline and
    # ZeRO stage 3 (`_FORM_RUNS`).
    results = _child_results()["forms"]
    self.assertEqual(sorted(results), sorted(
        f"{label}/{form}" for label, _, forms in _FORM_RUNS
        for form in forms))
    for label, result in results.items():
      with self.subTest(label):
        self.assertLessEqual(result["weights"], 1e-6)
        self.assertGreater(result["moved"], 1e-3)
        lines = "\n".join(result["resume_lines"])
        self.assertIn("input position restored: step 3 continues epoch 1",
                      lines)
        if label.endswith("_ctx"):
          # Before: no position ("reading its examples from the start").
          self.assertIn("pass 1 over this worker's 160 examples of the "
                        "dataset function, after 96 of them", lines)
        else:
          self.assertIn("after 96 of this worker's 160 examples", lines)
        self.assertEqual("x is a generator (or iterator), which cannot be restored" in
                         lines, label.endswith("generator"), lines)


@pytest.mark.compat
class ResumedPipelineTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("one_worker", 1, 1, 1),
      # 3 files of 84, 83, 83 records: by file 167 vs 83, so by range.
      ("two_workers_by_range", 2, 1, 1),
      ("two_replicas_accumulating", 1, 2, 2))
  def test_resumed_input_continues_the_epoch(self, workers, local_replicas,
                                             accumulation):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from tfdist.data import fashion_mnist  # pylint: disable=g-import-not-at-top
    from tfdist.data import input_pipeline  # pylint: disable=g-import-not-at-top
    data = testutil.fashion_mnist_subset(limit=250, train_shards=3,
                                         test_shards=1)
    files = input_pipeline.list_files(data["train"])
    counts = input_pipeline.count_records_per_file(files)
    batches_per_step = local_replicas * accumulation
    steps = 17  # 7 steps per epoch: resumes in epochs 0, 1 and 2.

    def ids(worker, start_step, num_steps):
      context = tf.distribute.InputContext(
          num_input_pipelines=workers, input_pipeline_id=worker,
          num_replicas_in_sync=workers * local_replicas)
      ds = input_pipeline.make_dataset(input_pipeline.PipelineOptions(
          files=files, global_batch_size=32, is_training=True, seed=3,
          parse_fn=lambda s: fashion_mnist.parse_image_example(
              s, with_id=True),
          deterministic=True, file_record_counts=counts,
          shuffle_buffer_size=64, gradient_accumulation_steps=accumulation,
          start_step=start_step), context)
      batches = iter(ds)
      return [next(batches)[2].numpy().tolist()
              for _ in range(num_steps * batches_per_step)]

    for worker in range(workers):
      uninterrupted = ids(worker, 0, steps)
      self.assertLen(uninterrupted[0], 32 // (workers * batches_per_step))
      for stop in (3, 7, 12):
        with self.subTest(worker=worker, stop=stop):
          self.assertEqual(ids(worker, stop, steps - stop),
                           uninterrupted[stop * batches_per_step:])
      # What a resume did before: epoch 0's order again, from its start.
      restarted = ids(worker, 0, 4)
      self.assertNotEqual(restarted, uninterrupted[3 * batches_per_step:
                                                   7 * batches_per_step])

  def test_function_sharding_itself_resumes_its_passes(self):
    # A dataset function that takes input_context (before: no position, a
    # resumed run read its examples from the start). 101 examples over 2
    # workers: shares of 51 and 50, 4 examples a step each, so the stops
    # fall in the first, second and fourth pass over a share.
    for worker in range(2):
      uninterrupted = _function_ids(worker, 2, 0, 40)
      for stop in (3, 13, 40 - 9):
        with self.subTest(worker=worker, stop=stop):
          self.assertEqual(_function_ids(worker, 2, stop, 40 - stop),
                           uninterrupted[stop:])
      # What a resume did before: the stream again from its start.
      self.assertNotEqual(_function_ids(worker, 2, 0, 4),
                          uninterrupted[13:17])

  @parameterized.named_parameters(("sharding_itself", True, 5),
                                  ("sharded_by_tfdist", False, 5),
                                  ("unseeded_shuffle", True, None))
  def test_other_worker_count_replays_the_global_batches(self, context,
                                                         shuffle_seed):
    # Trained on 2 workers, resumed on 1 or 4 at step 5 (of 8 a 96-example
    # epoch): each step's global batch (the workers' batches in worker
    # order) is the one the 2 workers would have had. Each worker builds
    # its input right after the global seed is set, as in a process of its
    # own: a function's shuffle without a seed of its own draws one from
    # the global seed (before: the second replayed worker's draw differed).
    steps, stop = 14, 5
    global_batches = [sum(parts, []) for parts in zip(*(
        _function_ids(w, 2, 0, steps, context=context,
                      shuffle_seed=shuffle_seed) for w in range(2)))]
    for workers in (1, 4):
      with self.subTest(workers=workers):
        resumed = [_function_ids(w, workers, stop, steps - stop,
                                 context=context, replay=2,
                                 shuffle_seed=shuffle_seed)
                   for w in range(workers)]
        self.assertEqual([sum(parts, []) for parts in zip(*resumed)],
                         global_batches[stop:])
    # Its own order on 1 worker differs (the comparison can fail).
    self.assertNotEqual(_function_ids(0, 1, stop, 3, context=context),
                        global_batches[stop:stop + 3])
    # 3 old workers cannot have split a batch of 8: refused, named.
    from tfdist import errors  # pylint: disable=g-import-not-at-top
    with self.assertRaisesRegex(
        errors.ConfigError, r"--batch_size: the global micro-batch of 8 "
        r"examples does not split evenly over the checkpoint's 3 workers"):
      _function_ids(0, 1, stop, 1, context=context, replay=3)

  def test_files_replayed_on_one_worker(self):
    # TFRecord files on 2 workers (balanced record ranges), resumed on 1 at
    # step 4 of a 7-step epoch: each step's batch holds the 2 workers'
    # examples of that step, in worker order.
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from tfdist.data import fashion_mnist  # pylint: disable=g-import-not-at-top
    from tfdist.data import input_pipeline  # pylint: disable=g-import-not-at-top
    data = testutil.fashion_mnist_subset(limit=250, train_shards=3,
                                         test_shards=1)
    files = input_pipeline.list_files(data["train"])
    counts = input_pipeline.count_records_per_file(files)

    def ids(worker, workers, start_step, num_steps, replay=None):
      ds = input_pipeline.make_dataset(input_pipeline.PipelineOptions(
          files=files, global_batch_size=32, is_training=True, seed=3,
          parse_fn=lambda s: fashion_mnist.parse_image_example(
              s, with_id=True),
          deterministic=True, file_record_counts=counts,
          shuffle_buffer_size=64, start_step=start_step,
          replay_pipelines=replay), tf.distribute.InputContext(
              num_input_pipelines=workers, input_pipeline_id=worker,
              num_replicas_in_sync=workers))
      batches = iter(ds)
      return [next(batches)[2].numpy().tolist() for _ in range(num_steps)]

    steps, stop = 10, 4
    global_batches = [a + b for a, b in zip(ids(0, 2, 0, steps),
                                             ids(1, 2, 0, steps))]
    self.assertEqual(ids(0, 1, stop, steps - stop, replay=2),
                     global_batches[stop:])

  def test_layout_change_names_what_changed(self):
    from tfdist.data import input_pipeline  # pylint: disable=g-import-not-at-top
    layout = lambda **kw: input_pipeline.input_layout(**{
        "files": ["/a/train-0.gz", "/a/train-1.gz"],
        "file_record_counts": [80, 80], "num_input_pipelines": 2,
        "global_batch_size": 32, "seed": 42, "shuffle_buffer_size": 100,
        "cache": True, **kw})
    saved = layout()
    change = input_pipeline.layout_change
    self.assertIsNone(change(saved, layout()))
    # The same files in another folder or bucket keep the position.
    self.assertIsNone(change(saved, layout(
        files=["gs://b/train-0.gz", "gs://b/train-1.gz"])))
    self.assertEqual(change(saved, layout(num_input_pipelines=3)),
                     "the worker count (input pipelines) changed from 2 to 3")
    self.assertIn("the training files changed (2 -> 3 files",
                  change(saved, layout(files=["x", "y", "z"],
                                       file_record_counts=[1, 2, 3])))
    self.assertIn("record counts of the training files changed",
                  change(saved, layout(file_record_counts=[80, 81])))
    self.assertIn("--seed is unset", change(saved, layout(seed=None)))
    self.assertEqual(change(None, layout()),
                     "the checkpoint recorded no input position")

  def test_checkpoint_records_the_layout(self):
    import keras  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from tfdist.training.state import checkpointing  # pylint: disable=g-import-not-at-top

    def keeper(directory, layout):
      model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
      step = tf.Variable(0, dtype=tf.int64)
      position = (None if layout is None else checkpointing.InputPosition(
          layout, steps_per_epoch=4))
      return checkpointing.CheckpointKeeper(
          checkpoint=tf.train.Checkpoint(model=model, global_step=step),
          directory=directory, step_counter=step,
          input_position=position), step

    two_workers = {"num_input_pipelines": 2, "seed": 1, "files": ["f"]}
    directory = testutil.scratch_dir()
    saver, step = keeper(directory, two_workers)
    step.assign(6)
    path = saver.save(6)
    reader = tf.train.load_checkpoint(path)
    self.assertEqual(json.loads(reader.get_tensor(
        checkpointing.INPUT_POSITION_KEY)), two_workers)
    # Same layout: the epoch continues at step 6.
    same, _ = keeper(directory, two_workers)
    self.assertEqual(same.restore(), path)
    self.assertEqual(same.input_position.resume_step(6), 6)
    # Three workers now: the position holds, and the run replays the
    # checkpoint's 2 workers' order, which its own checkpoints then record
    # (before: discarded, the epoch started over at step 4).
    changed, _ = keeper(directory, dict(two_workers, num_input_pipelines=3))
    changed.restore()
    with self.assertLogs(level="INFO") as logs:
      self.assertEqual(changed.input_position.resume_step(6), 6)
    self.assertEqual(changed.input_position.replay_pipelines, 2)
    self.assertEqual(changed.input_position.layout, two_workers)
    self.assertIn("the worker count changed from 2 to 3: the input replays "
                  "the checkpoint's 2 workers' order", "\n".join(logs.output))
    # Another seed as well: the position is discarded, the second epoch
    # (epoch 2, counted from 1) starts over.
    reseeded, _ = keeper(directory, dict(two_workers, num_input_pipelines=3,
                                         seed=2))
    reseeded.restore()
    with self.assertLogs(level="WARNING") as logs:
      self.assertEqual(reseeded.input_position.resume_step(6), 4)
    self.assertIsNone(reseeded.input_position.replay_pipelines)
    self.assertIn("input position discarded: the worker count (input "
                  "pipelines) changed from 2 to 3. The input starts epoch 2 "
                  "over", "\n".join(logs.output))
    # --nocheckpoint_input_position restores it; a checkpoint without a
    # position (written so, or before positions existed) restores too.
    plain, plain_step = keeper(directory, None)
    self.assertEqual(plain.restore(), path)
    self.assertEqual(int(plain_step.numpy()), 6)
    old_dir = testutil.scratch_dir()
    old, old_step = keeper(old_dir, None)
    old_step.assign(2)
    old.save(2)
    newer, newer_step = keeper(old_dir, two_workers)
    newer.restore()
    self.assertEqual(int(newer_step.numpy()), 2)
    self.assertIsNone(newer.input_position.saved)
    self.assertEqual(newer.input_position.resume_step(2), 0)


def _id_function(input_context, training, shuffle_seed=5):
  """101 example ids (int64), shuffled with `shuffle_seed` (None: drawn
  from the global seed); sharded by `input_context` when given (a function
  that shards itself)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  del training
  ds = tf.data.Dataset.range(101)
  if input_context is not None:
    ds = ds.shard(input_context.num_input_pipelines,
                  input_context.input_pipeline_id)
  return ds.shuffle(64, seed=shuffle_seed)


def _function_ids(worker, workers, start_step, num_steps, *, context=True,
                  replay=None, shuffle_seed=5):
  """The example ids of `num_steps` steps (global batch 8, one replica per
  worker) that `worker` of `workers` feeds from `start_step` on (built
  right after `tf.random.set_seed(1)`)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdist.data import input_pipeline  # pylint: disable=g-import-not-at-top
  fn = lambda input_context, training: _id_function(  # pylint: disable=unnecessary-lambda-assignment
      input_context, training, shuffle_seed)
  if not context:
    fn = lambda training: _id_function(None, training, shuffle_seed)  # pylint: disable=unnecessary-lambda-assignment
  tf.random.set_seed(1)
  ds = input_pipeline.make_dataset(input_pipeline.PipelineOptions(
      files=(), parse_fn=None, input_fn=fn, global_batch_size=8,
      is_training=True, seed=3, deterministic=True, shuffle_buffer_size=32,
      start_step=start_step, replay_pipelines=replay,
      # 12 steps of 8 per epoch when tfdist shards (the function's epoch of
      # 101 examples).
      examples_per_epoch=96 // workers), tf.distribute.InputContext(
          num_input_pipelines=workers, input_pipeline_id=worker,
          num_replicas_in_sync=workers))
  batches = iter(ds)
  return [next(batches).numpy().tolist() for _ in range(num_steps)]


class RandomStateTest(absltest.TestCase):

  def test_checkpoint_holds_the_dropout_state(self):
    import keras  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from tfdist.training.state import checkpointing  # pylint: disable=g-import-not-at-top
    from tfdist.training.step import train_loop  # pylint: disable=g-import-not-at-top

    def keeper(directory, with_state):
      inputs = keras.Input((3,))
      model = keras.Model(inputs, keras.layers.Dense(2)(
          keras.layers.Dropout(0.5)(inputs)))
      state = train_loop.random_state(model)
      step = tf.Variable(0, dtype=tf.int64)
      parts = {"random_state": state} if with_state else {}
      return checkpointing.CheckpointKeeper(
          checkpoint=tf.train.Checkpoint(model=model, global_step=step,
                                         **parts),
          directory=directory, step_counter=step), state, model

    directory = testutil.scratch_dir()
    saver, state, model = keeper(directory, True)
    self.assertLen(state, 1)
    model(tf.ones([4, 3]), training=True)  # Draws a mask: the state moves.
    drawn = state[0].numpy().tolist()
    saver.save(1)
    resumed, resumed_state, _ = keeper(directory, True)
    self.assertNotEqual(resumed_state[0].numpy().tolist(), drawn)
    resumed.restore()
    self.assertEqual(resumed_state[0].numpy().tolist(), drawn)
    # A checkpoint written before tfdist saved the state restores the rest,
    # with a warning.
    old_dir = testutil.scratch_dir()
    keeper(old_dir, False)[0].save(1)
    newer = keeper(old_dir, True)[0]
    with self.assertLogs(level="WARNING") as logs:
      self.assertIsNotNone(newer.restore())
    self.assertIn("holds no random-layer state", "\n".join(logs.output))


class InputPositionTest(absltest.TestCase):
  """`tfdist.data.input_position` itself: the epoch a step falls in, a position
  that round-trips through its serialized form."""

  def test_epoch_start(self):
    from tfdist.data import input_position  # pylint: disable=g-import-not-at-top
    self.assertEqual([input_position.epoch_start(s, 5)
                      for s in (0, 4, 5, 7, 10)], [0, 0, 5, 5, 10])

  def test_position_round_trips(self):
    from tfdist.data import input_position  # pylint: disable=g-import-not-at-top
    layout = {"seed": 1, "files": ["a"], "num_input_pipelines": 2}
    saved = input_position.InputPosition(layout, steps_per_epoch=5)
    restored = input_position.InputPosition(layout, steps_per_epoch=5)
    self.assertEqual(restored.resume_step(0), 0)
    restored.deserialize(saved.serialize().encode("utf-8"))
    self.assertEqual(restored.saved, layout)
    self.assertEqual(restored.resume_step(7), 7)
    moved = input_position.InputPosition(dict(layout, seed=2),
                                         steps_per_epoch=5)
    moved.deserialize(saved.serialize())
    self.assertEqual(moved.resume_step(7), 5)


# --- the child process: one device and Mirrored, in-process runs ---------------
def _child_main(spec: dict) -> dict:
  """The runs of `ResumedRunsTest`, on 2 logical CPUs
  (`testutil.two_logical_cpus` first)."""
  from absl import logging  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.INFO)
  from tfdist.config import TrainConfig  # pylint: disable=g-import-not-at-top
  from tfdist.distribute import environment  # pylint: disable=g-import-not-at-top
  from tfdist.experiment import run_experiment  # pylint: disable=g-import-not-at-top
  data, out = spec["data"], spec["out"]
  results = {}
  for label, extra in (
      ("one_device", {"distribution_strategy": "one_device"}),
      ("mirrored", {"distribution_strategy": "mirrored",
                    "num_cpu_devices": 2,
                    "gradient_accumulation_steps": 2})):
    result, manifests = {}, {}
    for run in ("a", "b"):
      model_dir = os.path.join(out, label, run)
      if run == "b":
        ids_lib.copy_checkpoint(os.path.join(out, label, "a"), model_dir,
                                ids_lib.STOP)
      ids_file = os.path.join(out, f"{label}-ids-{run}")
      ids_lib.record_example_ids(ids_file)
      config = TrainConfig(
          train_files=data["train"], eval_files=data["eval"],
          model_dir=model_dir, train_steps=ids_lib.STEPS,
          batch_size=ids_lib.BATCH, checkpoint_steps=ids_lib.STOP,
          max_checkpoints=10, deterministic=True, log_steps=4,
          warmup_steps=0, shuffle_buffer_size=64, model=ids_lib.MODEL,
          **extra)
      manifests[run] = run_experiment(
          config, environment=environment.RunEnvironment(variables={}))
      result[f"ids_{run}"] = {"single": f"{ids_file}.single"}
    result["restored_from"] = manifests["b"]["restored_from"]
    result["micro_steps"] = manifests["b"]["micro_steps"]
    result["weights"] = ids_lib.max_weight_difference(
        os.path.join(out, label, "a"), os.path.join(out, label, "b"))
    # The comparison can fail: steps 4-8 moved the weights.
    result["moved"] = ids_lib.max_weight_difference(
        os.path.join(out, label, "a"),
        os.path.join(out, label, "a", "checkpoints", f"ckpt-{ids_lib.STOP}"))
    results[label] = result
  results["forms"] = _forms_main(out)
  return results


# (label, TrainConfig settings, input forms): every form on one device and
# Mirrored (a dataset function taking input_context and NumPy arrays on
# Mirrored only); a dataset function through a 2-stage pipeline (one process, 2
# logical CPUs) and ZeRO stage 3 on 2 Mirrored replicas.
_FORM_RUNS = (
    ("one_device", {"distribution_strategy": "one_device"}, forms_lib.FORMS),
    ("mirrored", {"distribution_strategy": "mirrored", "num_cpu_devices": 2},
     forms_lib.FORMS + forms_lib.MORE_FORMS),
    ("pipeline", {"pipeline_stages": 2, "num_cpu_devices": 2},
     ("dataset_function",)),
    ("zero3", {"distribution_strategy": "mirrored", "num_cpu_devices": 2,
               "zero_stage": 3}, ("dataset_function",)),
)


def _forms_main(out: str) -> dict:
  """Each input form of `forms_lib.FORMS` through `tfdist.fit`, one device
  and Mirrored: run A 8 steps (checkpoints at 3 and 6), run B from A's
  step-3 checkpoint; the largest weight difference and B's log lines."""
  import tfdist  # pylint: disable=g-import-not-at-top
  ids_lib.record_example_ids("")  # These forms have no ids to record.
  results = {}
  for label, extra, forms in _FORM_RUNS:
    for form in forms:
      dirs = {run: os.path.join(out, "forms", label, form, run)
              for run in ("a", "b")}
      for run, model_dir in dirs.items():
        if run == "b":
          ids_lib.copy_checkpoint(dirs["a"], model_dir, ids_lib.STOP)
        config = tfdist.TrainConfig(
            model_dir=model_dir, train_steps=ids_lib.STEPS,
            batch_size=ids_lib.BATCH, checkpoint_steps=ids_lib.STOP,
            max_checkpoints=10, deterministic=True, warmup_steps=0,
            shuffle_buffer_size=64, mode="train", **extra)
        with _log_lines() as lines:
          tfdist.fit(forms_lib.build_model, config=config, verbose=2,
                     **forms_lib.form_input(form))
      results[f"{label}/{form}"] = {
          "weights": forms_lib.max_difference(dirs["a"], dirs["b"]),
          # The comparison can fail: steps 4-8 moved the weights.
          "moved": forms_lib.max_difference(
              dirs["a"], os.path.join(dirs["a"], "checkpoints",
                                      f"ckpt-{ids_lib.STOP}")),
          "resume_lines": [l for l in lines if "resum" in l or
                           "input position" in l]}
  return results


class _log_lines:  # pylint: disable=invalid-name
  """Collects absl's log lines (their messages) while open."""

  def __enter__(self):
    import logging  # pylint: disable=g-import-not-at-top
    self.lines = []
    outer = self

    class Handler(logging.Handler):

      def emit(self, record):
        outer.lines.append(record.getMessage())

    self.handler = Handler()
    logging.getLogger("absl").addHandler(self.handler)
    return self.lines

  def __exit__(self, *exc):
    import logging  # pylint: disable=g-import-not-at-top
    logging.getLogger("absl").removeHandler(self.handler)


def _world_size_run(spec: dict) -> dict:
  """One ZeRO stage 3 run of a dataset function on `spec["devices"]`
  Mirrored replicas (logical CPUs: one process each) in
  `spec["model_dir"]`, started from the step-3 checkpoint of the run in
  `spec["source"]` (the child's 2-replica "zero3/dataset_function" run A,
  the same settings on 2 replicas)."""
  import tfdist  # pylint: disable=g-import-not-at-top
  model_dir = spec["model_dir"]
  ids_lib.copy_checkpoint(spec["source"], model_dir, ids_lib.STOP)
  config = tfdist.TrainConfig(
      model_dir=model_dir, train_steps=ids_lib.STEPS,
      batch_size=ids_lib.BATCH, checkpoint_steps=ids_lib.STOP,
      max_checkpoints=10, deterministic=True, warmup_steps=0,
      shuffle_buffer_size=64, mode="train", distribution_strategy="mirrored",
      num_cpu_devices=spec["devices"], zero_stage=3)
  with _log_lines() as lines:
    tfdist.fit(forms_lib.build_model, config=config, verbose=2,
               **forms_lib.form_input("dataset_function"))
  return {"resume_lines": [l for l in lines if "input position" in l]}


class WorldSizeTest(absltest.TestCase):

  def test_zero3_resumed_on_more_replicas(self):
    # ZeRO stage 3, a dataset function: run A on 2 Mirrored replicas (the
    # child's "zero3/dataset_function" run A), run B resumed from A's
    # step-3 checkpoint on 4 (the global batch and the one input pipeline
    # unchanged, so the position holds). Before: the epoch started over
    # (the 0.038 across world sizes).
    run_a = os.path.join(_child_results()["out"], "forms", "zero3",
                         "dataset_function", "a")
    run_b = os.path.join(testutil.scratch_dir(), "b")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **{
        _WORLD_SIZE_ENV: json.dumps({"source": run_a, "model_dir": run_b,
                                     "devices": 4})})
    env["PYTHONPATH"] = testutil.REPO_ROOT + os.pathsep + env.get(
        "PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)],
                          cwd=testutil.REPO_ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=ids_lib.TIMEOUT_S)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    self.assertEqual(proc.returncode, 0, proc.stdout[-4000:])
    self.assertIn("input position restored: step 3 continues epoch 1",
                  "\n".join(json.loads(lines[-1])["resume_lines"]))
    self.assertLessEqual(forms_lib.max_difference(run_a, run_b), 1e-6)
    self.assertGreater(forms_lib.max_difference(
        run_a, os.path.join(run_a, "checkpoints", f"ckpt-{ids_lib.STOP}")),
                       1e-3)


_WORLD_SIZE_ENV = "TFDIST_INPUT_POSITION_WORLD_SIZE"


if __name__ == "__main__":
  if os.environ.get(_WORLD_SIZE_ENV):
    print(json.dumps(_world_size_run(json.loads(
        os.environ[_WORLD_SIZE_ENV]))), flush=True)
  elif os.environ.get(_CHILD_ENV):
    assert testutil.two_logical_cpus()
    print(json.dumps(_child_main(json.loads(os.environ[_CHILD_ENV]))),
          flush=True)
  else:
    absltest.main()
