"""Unit tests of tfdist.parallel.layout_map: a Keras LayoutMap (and
ModelParallel) read against small built models (no training, no devices:
Keras's DeviceMesh under TensorFlow is data).

Each plan is written out by hand: which variable is column-, row-, head-
or vocabulary-split on which dimension, the Megatron pairs and their
all-reduces; each refusal names the entry or variable, the value and the
fix.
"""

import contextlib
import io
import os
import re

from absl.testing import absltest
import keras

from tests import testutil

from tfdist import errors
from tfdist.parallel import layout_map as lm_lib


def _map(degree=2, **entries):
  mesh = keras.distribution.DeviceMesh(
      shape=(1, degree), axis_names=["batch", "model"],
      devices=[f"cpu:{i}" for i in range(degree)])
  layout_map = keras.distribution.LayoutMap(mesh)
  for key, axes in entries.items():
    layout_map[key] = axes
  return layout_map


def _entries(*pairs):
  layout_map = _map()
  for key, axes in pairs:
    layout_map[key] = axes
  return layout_map


def _mlp(units=16, head=True):
  inputs = keras.Input((8,))
  x = keras.layers.Dense(units, name="up")(inputs)
  x = keras.layers.Activation("relu", name="act")(x)
  x = keras.layers.Dense(8, name="down")(x)
  if head:
    x = keras.layers.Dense(3, name="head")(x)
  return keras.Model(inputs, x, name="mlp")


def _attention(heads=4):
  inputs = keras.Input((5, 8))
  x = keras.layers.MultiHeadAttention(heads, 4, name="mha")(inputs, inputs)
  x = keras.layers.LayerNormalization(name="norm")(x)
  return keras.Model(inputs, x, name="attention")


_HEADS = (("mha/(query|key|value)/kernel", (None, "model", None)),
          ("mha/(query|key|value)/bias", ("model", None)),
          ("mha/attention_output/kernel", ("model", None, None)))


class PlanTest(absltest.TestCase):

  def test_mlp_column_then_row_is_one_pair(self):
    plan = lm_lib.read_layout_map(_mlp(), _entries(
        ("up/kernel", (None, "model")), (".*down.*kernel", ("model", None))))
    got = {p: (s.split, s.axis) for p, s in plan.splits.items()}
    self.assertEqual(got, {
        "up/kernel": ("column", 1), "up/bias": ("column", 0),
        "down/kernel": ("row", 0), "down/bias": ("replicated", None),
        "head/kernel": ("replicated", None),
        "head/bias": ("replicated", None)})
    self.assertEqual(plan.splits["down/kernel"].entry, ".*down.*kernel")
    self.assertEqual(plan.layers, {"up": "column", "down": "row"})
    self.assertEqual(plan.pairs, (("up", "down"),))
    self.assertEqual(plan.all_reduces, {"forward": 1, "backward": 1})
    self.assertEqual(plan.degree, 2)

  def test_sequential_model(self):
    model = keras.Sequential([keras.Input((4,)),
                              keras.layers.Dense(8, name="a"),
                              keras.layers.Dropout(0.1, name="drop"),
                              keras.layers.Dense(4, name="b")], name="seq")
    plan = lm_lib.read_layout_map(model, _entries(
        ("seq/a/kernel", (None, "model")), ("seq/b/kernel", ("model", None))))
    self.assertEqual(plan.pairs, (("a", "b"),))

  def test_attention_by_heads(self):
    plan = lm_lib.read_layout_map(_attention(), _entries(*_HEADS))
    got = {p: (s.split, s.axis) for p, s in plan.splits.items()}
    self.assertEqual(got["mha/query/kernel"], ("heads", 1))
    self.assertEqual(got["mha/value/bias"], ("heads", 0))
    self.assertEqual(got["mha/attention_output/kernel"], ("heads", 0))
    self.assertEqual(got["mha/attention_output/bias"], ("replicated", None))
    self.assertEqual(got["norm/gamma"], ("replicated", None))
    self.assertEqual(plan.pairs, (("mha", "mha"),))
    self.assertEqual(plan.all_reduces, {"forward": 1, "backward": 1})

  def test_embedding_by_vocabulary_and_einsum_pair(self):
    inputs = keras.Input((5,), dtype="int32")
    x = keras.layers.Embedding(16, 8, name="emb")(inputs)
    x = keras.layers.EinsumDense("btd,de->bte", output_shape=(None, 16),
                                 name="ed")(x)
    x = keras.layers.Dense(8, name="proj")(x)
    model = keras.Model(inputs, x)
    plan = lm_lib.read_layout_map(model, _entries(
        ("emb/embeddings", ("model", None)), ("ed/kernel", (None, "model")),
        ("proj/kernel", ("model", None))))
    self.assertEqual(plan.layers, {"emb": "vocabulary", "ed": "column",
                                   "proj": "row"})
    self.assertEqual(plan.pairs, (("ed", "proj"),))
    self.assertEqual(plan.all_reduces, {"forward": 2, "backward": 1})

  def test_model_parallel_is_the_same_spec(self):
    layout_map = _entries(("up/kernel", (None, "model")),
                          ("down/kernel", ("model", None)))
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch")
    model = _mlp()
    self.assertEqual(lm_lib.read_distribution(model, distribution),
                     lm_lib.read_layout_map(model, layout_map))
    with self.assertRaisesRegex(errors.ConfigError,
                                "distribution=DataParallel is not a"):
      lm_lib.read_distribution(model, keras.distribution.DataParallel(
          devices=["cpu:0"]))

  def test_a_batch_axis_that_is_not_the_runs_copies_is_named(self):
    # A user's (2, 2) mesh on 2 replicas trains D = 1: said, with the fix.
    mesh = keras.distribution.DeviceMesh(
        shape=(2, 2), axis_names=["batch", "model"],
        devices=[f"cpu:{i}" for i in range(4)])
    layout_map = keras.distribution.LayoutMap(mesh)
    self.assertEqual(lm_lib.batch_degree(layout_map), 2)
    self.assertIsNone(lm_lib.batch_axis_note(layout_map, data=2))
    note = lm_lib.batch_axis_note(layout_map, data=1)
    self.assertIn("'batch' axis of 2, but this run has 2 replica(s): D = 1 "
                  "data-parallel copy of T = 2", note)
    self.assertIn("pass num_cpu_devices=4 (CPUs) or num_gpus=4", note)
    self.assertIsNone(lm_lib.batch_axis_note(_map(), data=1))

  def test_no_entries_is_all_replicated(self):
    plan = lm_lib.read_layout_map(_mlp(), _map())
    self.assertEqual({s.split for s in plan.splits.values()},
                     {"replicated"})
    self.assertEqual(plan.pairs, ())


class GuideTest(absltest.TestCase):

  def test_guide_example_prints_what_the_guide_shows(self):
    """docs/guides/device-mesh.md, block guide-example, and its output."""
    guide = os.path.join("docs", "guides", "device-mesh.md")
    with open(os.path.join(testutil.REPO_ROOT, guide), encoding="utf-8") as f:
      page = f.read()
    code, shown = re.search(
        r"<!-- run: tests/layout_map_test.py guide-example -->\n```python\n"
        r"(.*?)```\n.*?<!-- not run: .*? -->\n```text\n(.*?)```", page,
        re.S).groups()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      exec(compile(code, guide, "exec"), {})  # pylint: disable=exec-used
    self.assertEqual(out.getvalue(), shown)


class RefusalTest(absltest.TestCase):

  def _refused(self, model, layout_map, pattern):
    with self.assertRaisesRegex(errors.ConfigError, pattern) as raised:
      lm_lib.read_layout_map(model, layout_map)
    self.assertEqual(errors.exit_code_for(raised.exception), 2)

  def test_column_output_needing_a_gather(self):
    self._refused(_mlp(), _entries(("up/kernel", (None, "model"))),
                  r"'up/kernel' is column-parallel, but the output of 'up' "
                  r"reaches down, which is not a row-parallel layer: its "
                  r"split output would need a gather\. Split the next Dense "
                  r"by rows")
    self._refused(_mlp(head=False), _entries(
        ("down/kernel", (None, "model"))),
                  r"'down/kernel' is column-parallel, but the output of "
                  r"'down' reaches the model's output")

  def test_row_without_a_split_input(self):
    self._refused(_mlp(), _entries(("down/kernel", ("model", None))),
                  r"'down/kernel' is row-parallel, but the input of 'down' "
                  r"does not come split from a column-parallel layer")

  def test_entry_naming_no_variable(self):
    self._refused(_mlp(), _entries(("dense_7/kernel", (None, "model"))),
                  r"Layout map entry 'dense_7/kernel' names no variable of "
                  r"model 'mlp' \(its variables: \['up/kernel'.*Fix the "
                  r"path or pattern, or remove the entry")

  def test_split_not_dividing(self):
    self._refused(_mlp(units=15), _entries(
        ("up/kernel", (None, "model")), ("down/kernel", ("model", None))),
                  r"Layout map entry 'up/kernel' splits dimension 1 of "
                  r"'up/kernel' \(size 15\) over 2 'model' devices, which "
                  r"does not divide it")
    self._refused(_attention(heads=3), _entries(*_HEADS),
                  r"MultiHeadAttention 'mha' has num_heads=3, which does "
                  r"not divide by the 2 'model' devices")

  def test_attention_not_by_heads(self):
    self._refused(_attention(), _entries(*_HEADS[:2]),
                  r"'mha/attention_output/kernel' the split none; attention "
                  r"is split by heads only, so this would need a gather\. "
                  r"Split dimension 0")
    self._refused(_attention(), _entries(
        ("mha/query/kernel", (None, None, "model"))),
                  r"'mha/query/kernel' the split on dimension 2")

  def test_bad_layouts(self):
    self._refused(_mlp(), _entries(("up/kernel", ("model", "model"))),
                  r"on 2 dimensions")
    self._refused(_mlp(), _entries(("up/kernel", ("batch", None))),
                  r"splits 'up/kernel' over 'batch'.*not supported")
    self._refused(_mlp(), _entries(("up/kernel", (None,))),
                  r"layout \(None,\), of rank 1, but the variable has shape "
                  r"\(8, 16\)")
    self._refused(_mlp(), _entries(("up/kernel", (None, "model")),
                                   ("down/kernel", ("model", None)),
                                   ("down/bias", ("model",))),
                  r"splits 'down/bias', the bias of the row-parallel layer "
                  r"'down'.*Leave it replicated")
    self._refused(_attention(), _entries(*_HEADS, ("norm/gamma", ("model",))),
                  r"splits 'norm/gamma' of a LayerNormalization layer over "
                  r"'model': tfdist has no tensor-parallel rule")
    self._refused(_mlp(), _entries(("up/.*", (None, "model")),
                                   (".*/kernel", (None, None))),
                  r"Variable 'up/kernel' matches several layout map entries")
    mesh = keras.distribution.DeviceMesh(
        shape=(2,), axis_names=["data"], devices=["cpu:0", "cpu:1"])
    self._refused(_mlp(), keras.distribution.LayoutMap(mesh),
                  r"has axes \['data'\]; tensor parallelism splits over an "
                  r"axis named 'model'")
    # A data-parallel axis named as PyTorch or JAX users often do: read
    # before as no data-parallel axis (D = 1 said in the batch-axis note).
    mesh = keras.distribution.DeviceMesh(
        shape=(1, 2), axis_names=["data", "model"],
        devices=["cpu:0", "cpu:1"])
    self._refused(_mlp(), keras.distribution.LayoutMap(mesh),
                  r"has axes \['data', 'model'\]: tfdist reads the "
                  r"data-parallel axis as 'batch'.*Rename 'data' to 'batch'")


if __name__ == "__main__":
  absltest.main()
