"""The differences table (`tfdist.training.plan.differences`): the run's lines
and the guide's list generated from it.

* `lines` says each applicable difference once, with its fix, and nothing
  for a run where none applies (one device, no accumulation) or for one
  another start-up line says (`said_by`).
* The guide's list (docs/guides/fit-conformance.md, between the
  `differences-table` markers) is `markdown_table()`: with
  `TFDIST_WRITE_DIFFERENCES_TABLE=1` set, the test writes it instead.
* A real `tfdist.fit` run on one device with 2 accumulated micro-batches
  and a loss returning a batch sum warns once, naming the assumption (a
  batch mean) and the fix (before: an info line saying the value "weighs
  1/N").

Cost (pytest on 2 cores, 6 December 2026): about 10 s (one short fit).
"""

import os
import re

from absl.testing import absltest

from tests import testutil
from tfdist.training.plan import differences

_DOC = os.path.join(testutil.REPO_ROOT, "docs", "guides",
                    "fit-conformance.md")
_WRITE_ENV = "TFDIST_WRITE_DIFFERENCES_TABLE"
_PATTERN = re.compile(r"(<!-- differences-table -->\n)(.*?)(\n<!-- "
                      r"/differences-table -->)", re.S)


class LinesTest(absltest.TestCase):

  def test_one_device_says_nothing(self):
    self.assertEqual(differences.lines(differences.RunFacts()), [])
    self.assertEqual(differences.lines(differences.RunFacts(
        batch_valued_loss=True)), [])

  def test_batch_valued_loss_over_replicas(self):
    lines = differences.lines(differences.RunFacts(
        replicas=2, micro_batches=2, batch_valued_loss=True,
        loss_name="lambda"))
    self.assertLen(lines, 1)
    self.assertIn("the loss lambda returns one value per batch: tfdist "
                  "assumes it is the batch's mean", lines[0])
    self.assertIn("1/4 of one device's update", lines[0])
    self.assertIn('reduction="sum"', lines[0])
    self.assertIn("one value per example", lines[0])

  def test_own_step_terms_and_logs(self):
    lines = differences.lines(differences.RunFacts(
        replicas=2, own_step=("GAN.train_step",)))
    self.assertEqual([l.split(")")[0] for l in lines],
                     ["differs from one device (own_step_added_terms",
                      "differs from one device (own_step_logs"])
    self.assertIn("counts 2 times", lines[0])
    self.assertIn("num_replicas_in_sync", lines[0])
    only_loss = differences.lines(differences.RunFacts(
        replicas=2, own_step=("M.compute_loss",)))
    self.assertLen(only_loss, 1)

  def test_each_condition(self):
    cases = {
        "sparse_optimizer_under_zero": dict(zero_stage=3,
                                            sparse_gradients=True,
                                            optimizer="adam"),
        "micro_batch_batch_norm": dict(pipeline_stages=2, batch_norm=True),
        "micro_batch_dropout": dict(micro_batches=2, dropout=True),
        "micro_batch_precision": dict(pipeline_stages=2, dtype="fp16"),
        "tensor_parallel_rounding": dict(tensor_parallel=2,
                                         optimizer="adam"),
        "self_sharding_epochs": dict(self_sharding_input=True),
        "parameter_server_input": dict(keeps_input_position=False),
    }
    for key, facts in cases.items():
      with self.subTest(key):
        lines = differences.lines(differences.RunFacts(**facts))
        self.assertLen(lines, 1)
        self.assertIn(f"({key})", lines[0])
    # Plain SGD sees only the sum of repeated rows: no difference.
    self.assertEqual(differences.lines(differences.RunFacts(
        zero_stage=1, sparse_gradients=True, plain_sgd=True)), [])

  def test_said_elsewhere_is_listed_not_said(self):
    facts = differences.RunFacts(generator_input=True, dropped_examples=12,
                                 replicas=2, batch_valued_metrics=("m",))
    self.assertEqual(
        [d.key for d in differences.applicable(facts)],
        ["generator_resume", "dropped_remainder", "batch_valued_metrics"])
    self.assertEqual(differences.lines(facts), [])

  def test_keys_are_unique_and_guides_exist(self):
    keys = [d.key for d in differences.DIFFERENCES]
    self.assertLen(set(keys), len(keys))
    for d in differences.DIFFERENCES:
      self.assertTrue(os.path.exists(os.path.join(
          testutil.REPO_ROOT, "docs", "guides", d.guide)), d.guide)


class GuideTest(absltest.TestCase):

  def test_the_guide_lists_the_table(self):
    with open(_DOC) as f:
      text = f.read()
    match = _PATTERN.search(text)
    self.assertIsNotNone(match, f"{_DOC}: no differences-table markers")
    table = differences.markdown_table()
    if os.environ.get(_WRITE_ENV):
      with open(_DOC, "w") as f:
        f.write(_PATTERN.sub(lambda m: m.group(1) + table + m.group(3),
                             text))
      return
    self.assertEqual(match.group(2), table,
                     f"the guide's differences list is not "
                     f"tfdist.training.plan.differences' table: rerun with "
                     f"{_WRITE_ENV}=1 and commit the guide")


class FactsOfRunTest(absltest.TestCase):

  def test_a_pipelines_micro_batches_are_counted(self):
    # A pipeline of 2 stages and 2 micro-batches said "1 micro-batches a
    # step": the count read --gradient_accumulation_steps only (issue 47).
    import dataclasses  # pylint: disable=g-import-not-at-top
    import types  # pylint: disable=g-import-not-at-top
    import keras  # pylint: disable=g-import-not-at-top
    from tfdist.config import TrainConfig  # pylint: disable=g-import-not-at-top
    from tfdist.experiment import prepare  # pylint: disable=g-import-not-at-top
    from tfdist.parallel.pipeline import options as pipeline_options  # pylint: disable=g-import-not-at-top
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4),
                              keras.layers.BatchNormalization(),
                              keras.layers.Dense(1)])
    parts = types.SimpleNamespace(model=model, objectives=None,
                                  metric_sums=None)

    def facts(accumulation, pipeline):
      options = dataclasses.replace(
          prepare.assembly_options(TrainConfig(
              model_dir=testutil.scratch_dir(), train_steps=1,
              distribution_strategy="one_device"), None),
          pipeline=pipeline)
      plan = types.SimpleNamespace(batch=types.SimpleNamespace(
          gradient_accumulation_steps=accumulation, dropped_per_epoch=0))
      return differences.facts_of_run(
          options, parts=parts, plan=plan, replicas=1, input_fn=None,
          keeps_input_position=True)

    piped = facts(1, pipeline_options.PipelineOptions(
        num_stages=2, num_microbatches=2))
    self.assertEqual((piped.micro_batches, piped.pipeline_stages), (2, 2))
    (line,) = [l for l in differences.lines(piped)
               if "micro_batch_batch_norm" in l]
    self.assertIn("(pipeline stages 2, 2 micro-batches a step)", line)
    # D copies x M micro-batches x K accumulation micro-steps.
    self.assertEqual(facts(3, pipeline_options.PipelineOptions(
        num_stages=2, num_microbatches=4, data=2)).micro_batches, 24)
    self.assertEqual(facts(3, None).micro_batches, 3)


class RunSaysItTest(absltest.TestCase):

  def test_batch_sum_loss_with_two_micro_batches(self):
    import numpy as np  # pylint: disable=g-import-not-at-top
    import keras  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    import tfdist  # pylint: disable=g-import-not-at-top

    def build_model():
      model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
      model.compile(loss=lambda y, p: tf.reduce_sum(tf.square(y - p)))
      return model

    x = np.linspace(-1, 1, 64, dtype="float32").reshape(32, 2)
    config = tfdist.TrainConfig(
        model_dir=testutil.scratch_dir(), train_steps=1, batch_size=16,
        gradient_accumulation_steps=2, distribution_strategy="one_device",
        mode="train", log_steps=1000)
    with self.assertLogs(level="INFO") as logs:
      tfdist.fit(build_model, config=config, x=x, y=x[:, :1])
    said = [l for l in logs.output if "(batch_valued_loss)" in l]
    self.assertLen(said, 1, logs.output)
    # Said once: no info line restating it (issue 47: "each notice once").
    self.assertLen([l for l in logs.output
                    if "returns one value per batch" in l], 1, logs.output)
    self.assertIn("returns one value per batch: tfdist assumes it is the "
                  "batch's mean and weighs each of the 2 per-replica "
                  "batches' values 1/2", said[0])


if __name__ == "__main__":
  absltest.main()
