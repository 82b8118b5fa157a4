"""Tests for tfdist.data.datasets and tfdist.data.input_pipeline on real Fashion-MNIST."""

import collections
import gzip
import os

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np
import pytest
import tensorflow as tf

from tests import testutil
from tfdist import errors
from tfdist.data import datasets
from tfdist.data import input_pipeline

# Also run on the oldest supported TensorFlow (see tests/conftest.py).
pytestmark = pytest.mark.compat


def _ids_parse(serialized):
  return datasets.parse_image_example(serialized, with_id=True)


def _collect_ids(ds):
  ids = []
  for batch in ds:
    ids.extend(batch[2].numpy().tolist())
  return ids


def _ids_per_host(files, hosts, *, is_training, seed=None, batches=None):
  """Example ids each of `hosts` input pipelines reads (8 per replica batch).

  With `batches`, reads only that many batches from each host."""
  per_host = []
  for host in range(hosts):
    ctx = tf.distribute.InputContext(num_input_pipelines=hosts,
                                     input_pipeline_id=host,
                                     num_replicas_in_sync=hosts)
    ds = input_pipeline.make_dataset(input_pipeline.PipelineOptions(
        files=files, parse_fn=_ids_parse, global_batch_size=8 * hosts,
        is_training=is_training, seed=seed), ctx)
    per_host.append(_collect_ids(ds.take(batches) if batches else ds))
  return per_host


class DatasetsTest(absltest.TestCase):

  def test_conversion_of_real_subset(self):
    data = testutil.fashion_mnist_subset(limit=300, train_shards=3,
                                         test_shards=2)
    train = input_pipeline.list_files(data["train"])
    self.assertLen(train, 3)
    self.assertEqual(input_pipeline.count_records(train), 300)
    with open(os.path.join(data["dir"], datasets.INFO_FILE)) as f:
      self.assertIn('"num_examples": 300', f.read())
    # Records match the original IDX bytes.
    images = datasets.read_idx(os.path.join(
        datasets.DEBIAN_FASHION_MNIST_DIR, "train-images-idx3-ubyte.gz"))
    labels = datasets.read_idx(os.path.join(
        datasets.DEBIAN_FASHION_MNIST_DIR, "train-labels-idx1-ubyte.gz"))
    self.assertEqual(images.shape, (60000, 28, 28))
    ds = tf.data.TFRecordDataset(train, compression_type="GZIP").map(
        _ids_parse)
    for image, label, example_id in ds.take(10):
      k = int(example_id)
      np.testing.assert_allclose(image.numpy()[..., 0] * 255.0, images[k],
                                 atol=1e-3)
      self.assertEqual(int(label), labels[k])

  def test_conversion_is_done_once(self):
    out = os.path.join(testutil.scratch_dir(), "fm")
    first = datasets.convert_fashion_mnist(out, limit=20, train_shards=2,
                                           test_shards=1)
    stamp = os.path.getmtime(os.path.join(out, datasets.INFO_FILE))
    second = datasets.convert_fashion_mnist(out, limit=20, train_shards=2,
                                            test_shards=1)
    self.assertEqual(first, second)
    self.assertEqual(stamp, os.path.getmtime(os.path.join(
        out, datasets.INFO_FILE)))
    # No temporary folders are left behind.
    self.assertEqual([n for n in os.listdir(os.path.dirname(out))
                      if n.startswith(".tmp")], [])

  def test_missing_raw_data_names_path_and_fix(self):
    out = os.path.join(testutil.scratch_dir(), "fm")
    with self.assertRaisesRegex(errors.DataNotFoundError,
                                r"/nonexistent/train-images.*apt-get install"):
      datasets.convert_fashion_mnist(out, raw_data_dir="/nonexistent")
    self.assertFalse(os.path.exists(out))

  def test_not_idx(self):
    path = os.path.join(testutil.scratch_dir(), "bad.gz")
    with gzip.open(path, "wb") as f:
      f.write(b"\x00\x00\x0d\x01" + b"\x00" * 8)
    with self.assertRaisesRegex(ValueError, "not an IDX file"):
      datasets.read_idx(path)

  def test_unknown_dataset(self):
    with self.assertRaisesRegex(errors.ConfigError,
                                "--dataset='imagenet'.*fashion_mnist"):
      datasets.get_dataset_spec("imagenet")


class ArraysEpochsTest(absltest.TestCase):
  """`tfdist.fit`'s arrays, 300 rows at a global batch of 32: epochs of
  9 whole steps (12 rows left out of each), every row at most once an
  epoch, and a resumed input continuing where its step left it."""

  def _options(self, **kwargs):
    import dataclasses  # pylint: disable=g-import-not-at-top
    from tfdist import api  # pylint: disable=g-import-not-at-top
    fn, _ = api.in_memory_dataset(x=np.arange(300, dtype="float32")[:, None],
                                  y=np.zeros(300))
    options = input_pipeline.PipelineOptions(
        files=(), parse_fn=None, input_fn=fn, global_batch_size=32,
        is_training=True, shuffle_buffer_size=1000, seed=1,
        examples_per_epoch=288)
    return dataclasses.replace(options, **kwargs)

  def _ids(self, options, batches, context=None):
    return [b[0].numpy()[:, 0].astype(int) for b in input_pipeline.make_dataset(
        options, context).take(batches)]

  def test_no_row_twice_in_an_epoch(self):
    ids = self._ids(self._options(), 27)
    for epoch in range(3):
      rows = np.concatenate(ids[epoch * 9:(epoch + 1) * 9])
      self.assertLen(set(rows), 288, f"epoch {epoch}")
    # Reshuffled: other rows left out in other epochs.
    self.assertNotEqual(set(np.concatenate(ids[:9])),
                        set(np.concatenate(ids[9:18])))
    # Without the epoch size: one endless stream, whose second "epoch" of
    # 9 steps holds rows twice (the 12 rows left from the first pass, then
    # the second pass).
    endless = self._ids(self._options(examples_per_epoch=None), 18)
    self.assertLess(len(set(np.concatenate(endless[9:18]))), 288)

  def test_resumed_input_continues_its_epoch(self):
    ids = self._ids(self._options(), 18)
    resumed = self._ids(self._options(start_step=13), 5)
    for step, (mine, theirs) in enumerate(zip(resumed, ids[13:18]), 14):
      np.testing.assert_array_equal(mine, theirs, err_msg=f"step {step}")

  def test_two_pipelines_read_disjoint_shares(self):
    shares = []
    for pipeline in range(2):
      context = tf.distribute.InputContext(2, pipeline, 2)
      rows = np.concatenate(self._ids(self._options(examples_per_epoch=144),
                                      9, context))
      self.assertLen(set(rows), 144)
      shares.append(set(rows))
    self.assertEqual(shares[0] & shares[1], set())


class InputPipelineTest(parameterized.TestCase):

  def test_glob_matching_nothing_names_flag(self):
    with self.assertRaisesRegex(errors.DataNotFoundError,
                                r"--eval_files='/no/such/\*.gz' matches no"):
      input_pipeline.list_files("/no/such/*.gz", flag="--eval_files")

  def test_mixed_compression(self):
    with self.assertRaisesRegex(ValueError, "Mixed compressed"):
      input_pipeline.compression_of(["a.tfrecord.gz", "b.tfrecord"])

  def test_shard_mode(self):
    self.assertEqual(input_pipeline.shard_mode(8, 1), "none")
    self.assertEqual(input_pipeline.shard_mode(8, 2), "file")
    self.assertEqual(input_pipeline.shard_mode(1, 2), "data")

  def test_eval_sees_every_example_once_with_partial_batch(self):
    data = testutil.fashion_mnist_subset(limit=300, train_shards=3,
                                         test_shards=2)
    files = input_pipeline.list_files(data["eval"])
    ds = input_pipeline.make_dataset(input_pipeline.PipelineOptions(
        files=files, parse_fn=_ids_parse, global_batch_size=64,
        is_training=False))
    sizes = [int(b[0].shape[0]) for b in ds]
    self.assertEqual(sizes, [64, 64, 64, 64, 44])  # remainder kept
    ids = _collect_ids(ds)
    self.assertCountEqual(ids, range(60000, 60300))

  def test_one_cpu_device_reads_a_plain_dataset(self):
    # As plain Keras fit does: no MultiDeviceIterator, so no GeneratorDataset
    # op (which fixes glibc's mmap threshold) and no extra hand-off per batch.
    data = testutil.fashion_mnist_subset(limit=300, train_shards=3,
                                         test_shards=2)
    options = input_pipeline.PipelineOptions(
        files=input_pipeline.list_files(data["eval"]), parse_fn=_ids_parse,
        global_batch_size=64, is_training=False)
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    ds = input_pipeline.distribute(strategy, options)
    self.assertIsInstance(ds, tf.data.Dataset)
    total = strategy.run(lambda images, labels, ids: tf.shape(labels)[0],
                         args=next(iter(ds)))
    self.assertEqual(int(total), 64)
    self.assertCountEqual(_collect_ids(ds), range(60000, 60300))
    mirrored = input_pipeline.distribute(
        tf.distribute.MirroredStrategy(["/cpu:0"]), options)
    self.assertIsInstance(mirrored, tf.distribute.DistributedDataset)

  def test_training_batches_are_full_and_repeat(self):
    data = testutil.fashion_mnist_subset(limit=300, train_shards=3,
                                         test_shards=2)
    ds = input_pipeline.make_dataset(input_pipeline.PipelineOptions(
        files=input_pipeline.list_files(data["train"]), parse_fn=_ids_parse,
        global_batch_size=64, is_training=True, seed=1))
    shapes = [tuple(b[0].shape) for b in ds.take(12)]  # > one epoch
    self.assertEqual(set(shapes), {(64, 28, 28, 1)})

  def test_each_split_names_itself_in_its_line(self):
    # A run builds both pipelines; their lines were the same text twice
    # (a new-user trial took it for a notice said twice; issue 47).
    from tfdist import api  # pylint: disable=g-import-not-at-top
    fn, _ = api.in_memory_dataset(x=np.arange(64, dtype="float32")[:, None],
                                  y=np.zeros(64))
    lines = []
    for training in (True, False):
      with self.assertLogs(level="INFO") as logs:
        input_pipeline.make_dataset(input_pipeline.PipelineOptions(
            files=(), parse_fn=None, input_fn=fn, global_batch_size=32,
            is_training=training, seed=1, name="arrays"))
      lines += [l for l in logs.output if "Input pipeline 0/1" in l]
    self.assertLen(lines, 2, lines)
    self.assertIn("Input pipeline 0/1 (training): dataset function arrays",
                  lines[0])
    self.assertIn("Input pipeline 0/1 (evaluation): dataset function "
                  "arrays", lines[1])

  def test_training_input_says_it_is_endless(self):
    # A multi-worker distributed iterator over a dataset of unknown
    # cardinality takes its partial-batch path: a cross-worker all-reduce
    # and a tf.cond before every step (TensorFlow's
    # input_lib._enable_get_next_as_optional). Epochs through flat_map
    # have unknown cardinality unless the pipeline says otherwise.
    data = testutil.fashion_mnist_subset(limit=300, train_shards=3,
                                         test_shards=2)
    files = input_pipeline.list_files(data["train"])
    from tfdist import api  # pylint: disable=g-import-not-at-top
    fn, _ = api.in_memory_dataset(x=np.arange(300, dtype="float32")[:, None],
                                  y=np.zeros(300))
    cases = {
        "aligned epochs": input_pipeline.PipelineOptions(
            files=files, parse_fn=_ids_parse, global_batch_size=64,
            is_training=True, seed=1,
            file_record_counts=input_pipeline.count_records_per_file(files)),
        "files": input_pipeline.PipelineOptions(
            files=files, parse_fn=_ids_parse, global_batch_size=64,
            is_training=True, seed=1),
        "arrays": input_pipeline.PipelineOptions(
            files=(), parse_fn=None, input_fn=fn, global_batch_size=32,
            is_training=True, seed=1, examples_per_epoch=288),
    }
    for name, options in cases.items():
      ds = input_pipeline.make_dataset(options)
      self.assertEqual(int(ds.cardinality()),
                       int(tf.data.INFINITE_CARDINALITY), name)
      self.assertLen(list(ds.take(6)), 6, name)  # Past one epoch.
    evaluation = input_pipeline.make_dataset(input_pipeline.PipelineOptions(
        files=files, parse_fn=_ids_parse, global_batch_size=64,
        is_training=False))
    self.assertEqual(sum(int(b[0].shape[0]) for b in evaluation), 300)

  def test_aligned_epochs_are_batched_once(self):
    # 300 records, per-replica batch 64: epochs of 256 examples (4 whole
    # batches), cut on batches: no batch is unbatched and batched again.
    data = testutil.fashion_mnist_subset(limit=300, train_shards=3,
                                         test_shards=2)
    files = input_pipeline.list_files(data["train"])
    ds = input_pipeline.make_dataset(input_pipeline.PipelineOptions(
        files=files, parse_fn=_ids_parse, global_batch_size=64,
        is_training=True, seed=1, deterministic=True,
        file_record_counts=input_pipeline.count_records_per_file(files)))
    graph = tf.compat.v1.GraphDef.FromString(
        ds._as_serialized_graph().numpy())  # pylint: disable=protected-access
    ops = {n.op for n in graph.node} | {
        n.op for f in graph.library.function for n in f.node_def}
    self.assertNotIn("UnbatchDataset", ops)
    epochs = [b[2].numpy().tolist() for b in ds.take(8)]
    for epoch in (epochs[:4], epochs[4:]):
      ids = [i for batch in epoch for i in batch]
      self.assertLen(set(ids), 256)  # Every example at most once an epoch.
    # The same batches as cutting examples and batching them afterwards.
    shuffled = tf.data.Dataset.range(300).shuffle(
        300, seed=5, reshuffle_each_iteration=False)
    # pylint: disable=protected-access
    examples = input_pipeline._first_examples(shuffled, 256, 64).batch(64)
    batches = input_pipeline._first_batches(shuffled, 256, 64)
    # pylint: enable=protected-access
    self.assertEqual([b.numpy().tolist() for b in batches],
                     [b.numpy().tolist() for b in examples])

  def test_seed_zero_shuffles(self):
    # --seed=0 makes 0 TensorFlow's global seed (keras.utils.set_random_seed).
    data = testutil.fashion_mnist_subset(limit=300, train_shards=3,
                                         test_shards=2)
    files = input_pipeline.list_files(data["train"])
    tf.random.set_seed(0)
    try:
      ids = _ids_per_host(files, 1, is_training=True, seed=0, batches=6)[0]
    finally:
      tf.random.set_seed(None)
    # Six batches of 8 (the first epoch's 300 records, shuffled).
    self.assertLen(ids, 48)
    self.assertLen(set(ids), 48)
    self.assertNotEqual(ids, sorted(ids))

  @parameterized.named_parameters(
      ("by_file", 4, 2), ("by_data", 1, 2), ("by_data_three_hosts", 2, 3))
  def test_hosts_read_disjoint_data(self, num_files, hosts):
    data = testutil.fashion_mnist_subset(limit=240, train_shards=num_files,
                                         test_shards=num_files)
    files = input_pipeline.list_files(data["eval"])
    per_host = _ids_per_host(files, hosts, is_training=False)
    counts = collections.Counter(i for ids in per_host for i in ids)
    self.assertEqual(set(counts), set(range(60000, 60240)))
    self.assertEqual(set(counts.values()), {1})  # exactly once overall
    self.assertTrue(all(per_host))

  @parameterized.named_parameters(
      ("by_file_seeded", 4, 2, 3), ("by_file_unseeded", 4, 2, None),
      ("by_data_seeded", 2, 3, 3), ("by_data_unseeded", 2, 3, None))
  def test_training_shards_disjoint_over_one_epoch(self, num_files, hosts,
                                                   seed):
    # Unseeded shuffles differ per host: sharding must not depend on order.
    data = testutil.fashion_mnist_subset(limit=240, train_shards=num_files,
                                         test_shards=2)
    files = input_pipeline.list_files(data["train"])
    seen = _ids_per_host(files, hosts, is_training=True, seed=seed,
                         batches=240 // hosts // 8)  # one epoch per host
    self.assertCountEqual([i for ids in seen for i in ids], range(240))


if __name__ == "__main__":
  absltest.main()
