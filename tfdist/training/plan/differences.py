"""Where a run differs from one device's `Model.fit`: one table, said in the run.

Each known difference (`DIFFERENCES`) has the condition under which it
applies, evaluated from the run's facts (`RunFacts`: the config's choices,
the model's layers and hooks, the loss, the input form), and the one line
the run says at start when it applies (`say`). The guides' list
(`docs/guides/differences.md`, between its `differences-table` markers) is
generated from this table (`markdown_table`; `tests/differences_test.py`
fails when they disagree), so a guide cannot know a difference the run does
not say. A difference another start-up line already says (`said_by`) is
listed, not said twice.
"""

import dataclasses
from typing import Callable, List, Optional, Sequence, Tuple

from absl import logging
import keras

from tfdist.data import input_pipeline
from tfdist.data import input_position
from tfdist.runtime import private_api
from tfdist.training.step import custom_step
from tfdist.training.step import objectives as objectives_lib



@dataclasses.dataclass(frozen=True)
class RunFacts:
  """What a difference's condition reads (all known once the model is built).

  Attributes:
    replicas: `num_replicas_in_sync` (replicas of every worker).
    micro_batches: the micro-batches one update's batch is cut into on
      each replica: `--gradient_accumulation_steps`, times a pipeline's
      copies D and micro-batches M (`micro_batches_of`).
    batch_valued_loss: the loss returns one value per batch (a scalar;
      `tfdist.training.step.objectives.batch_valued_loss`).
    loss_name: the loss's name, for the line.
    own_step: the model's class overrides `train_step` or `compute_loss`
      (`tfdist.training.step.custom_step.overrides`): the hooks named.
    zero_stage: ZeRO stage (0: none).
    optimizer: the optimizer's name (`--optimizer`).
    plain_sgd: the optimizer is SGD without momentum or clipping.
    sparse_gradients: the model has an `Embedding` layer (its gradient is
      a `tf.IndexedSlices`).
    pipeline_stages: pipeline stages (1: no pipeline).
    batch_norm: the model has a `BatchNormalization` layer.
    dropout: the model has a `Dropout` layer.
    tensor_parallel: `--tensor_parallel` (1: off).
    dtype: the precision (`fp32`, `bf16`, `fp16`).
    generator_input: `tfdist.fit`'s `x` was a Python generator.
    self_sharding_input: a dataset function that takes `input_context`.
    keeps_input_position: the backend checkpoints the input position
      (False: parameter servers).
    dropped_examples: training examples left out of every epoch
      (`N mod global batch`).
    batch_valued_metrics: metrics returning one value per batch.
  """
  replicas: int = 1
  micro_batches: int = 1
  batch_valued_loss: bool = False
  loss_name: str = "loss"
  own_step: Tuple[str, ...] = ()
  zero_stage: int = 0
  optimizer: str = "sgd"
  plain_sgd: bool = False
  sparse_gradients: bool = False
  pipeline_stages: int = 1
  batch_norm: bool = False
  dropout: bool = False
  tensor_parallel: int = 1
  dtype: str = "fp32"
  generator_input: bool = False
  self_sharding_input: bool = False
  keeps_input_position: bool = True
  dropped_examples: int = 0
  batch_valued_metrics: Tuple[str, ...] = ()

  @property
  def splits(self) -> int:
    """Per-replica micro-batches a global batch is cut into."""
    return self.replicas * self.micro_batches


@dataclasses.dataclass(frozen=True)
class Difference:
  """One known difference from one device's `Model.fit`.

  Attributes:
    key: a stable name.
    what: what differs (the docs' column; Markdown).
    condition: when it applies, in words (the docs' column).
    applies: the condition, on `RunFacts`.
    line: the run's line, `str.format`ted with the facts' fields (and
      `splits`).
    fix: what gives one device's result, or "" when nothing does.
    guide: the guide that explains it (`docs/guides/...`).
    said_by: another start-up line already says it ("" for none): listed
      here, not said twice.
  """
  key: str
  what: str
  condition: str
  applies: Callable[[RunFacts], bool]
  line: str
  fix: str
  guide: str
  said_by: str = ""


DIFFERENCES: Tuple[Difference, ...] = (
    Difference(
        "batch_valued_loss",
        "A loss returning one value per batch is taken as the batch's mean: "
        "each per-replica batch's value weighs 1/N, so a batch *sum* trains "
        "at 1/N of one device's update.",
        "the loss returns a scalar, over more than one replica or "
        "micro-batch",
        lambda f: f.batch_valued_loss and f.splits > 1,
        "the loss {loss_name} returns one value per batch: tfdist assumes "
        "it is the batch's mean and weighs each of the {splits} per-replica "
        "batches' values 1/{splits}; a batch sum would train at "
        "1/{splits} of one device's update.",
        "for a sum use reduction=\"sum\" (a keras.losses.Loss), or return "
        "one value per example",
        "fit-conformance.md"),
    Difference(
        "own_step_added_terms",
        "A model's own `train_step`/`compute_loss`: the compiled loss and "
        "`model.losses` (through Keras's `compute_loss`) equal one device's; "
        "a term added by hand is a per-replica value the strategy sums: N "
        "times one device's, as under Keras's `fit` with the strategy.",
        "the model overrides `train_step` or `compute_loss`, over more "
        "than one replica",
        lambda f: bool(f.own_step) and f.replicas > 1,
        "{own_step_names}: a loss term added by hand (loss = ... + "
        "sum(self.losses), an extra penalty) counts {replicas} times, as "
        "under Keras's fit with this strategy; the compiled loss and "
        "Keras's compute_loss (model.losses included) are one device's.",
        "divide such a term by self.distribute_strategy.num_replicas_in_sync, "
        "or add it with self.add_loss(...) and leave it to "
        "super().compute_loss",
        "fit-conformance.md"),
    Difference(
        "own_step_logs",
        "A model's own `train_step` logs (a GAN's losses) are the mean of "
        "the replicas' values, each over its per-replica batch.",
        "the model overrides `train_step`, over more than one replica",
        lambda f: any(h.endswith(".train_step") for h in f.own_step) and
        f.replicas > 1,
        "{own_step_names}: the losses it returns are logged as the mean of "
        "the {replicas} replicas' values over their own batches (as Keras's "
        "fit logs them), not one value over the global batch.",
        "compute logged values with the model's metrics (their state is "
        "summed over replicas)",
        "fit-conformance.md"),
    Difference(
        "sparse_optimizer_under_zero",
        "ZeRO stages 1-3 sum a sparse gradient's repeated ids before the "
        "update (as a dense gradient); one device and stage 0 update row "
        "by row (Adam squares each occurrence).",
        "ZeRO stage >= 1, a model with an `Embedding`, an optimizer other "
        "than plain SGD",
        lambda f: f.zero_stage >= 1 and f.sparse_gradients and
        not f.plain_sgd,
        "ZeRO stage {zero_stage} sums repeated ids of an Embedding's sparse "
        "gradient before {optimizer} updates it, where one device updates "
        "row by row: when ids repeat within a batch the weights differ "
        "(0.027 after 3 Adam steps on the tests' Transformer).",
        "none: ids that do not repeat within a batch give one device's "
        "weights",
        "sharded-training.md"),
    Difference(
        "micro_batch_batch_norm",
        "Batch normalization inside a pipeline or under gradient "
        "accumulation sees micro-batches: its statistics and moving "
        "averages are those of B/M examples.",
        "a `BatchNormalization` layer, with pipeline stages or gradient "
        "accumulation",
        lambda f: f.batch_norm and (f.pipeline_stages > 1 or
                                    f.micro_batches > 1),
        "batch normalization sees micro-batches of the global batch "
        "(pipeline stages {pipeline_stages}, {micro_batches} micro-batches "
        "a step): its statistics are over fewer examples than one "
        "device's step on the whole batch.",
        "none (a model without batch normalization trains as one device)",
        "pipeline-parallelism.md"),
    Difference(
        "micro_batch_dropout",
        "Dropout inside a pipeline or under gradient accumulation draws "
        "its masks per micro-batch: other masks than the unsplit step's.",
        "a `Dropout` layer, with pipeline stages or gradient accumulation",
        lambda f: f.dropout and (f.pipeline_stages > 1 or
                                 f.micro_batches > 1),
        "dropout draws its masks per micro-batch ({micro_batches} a step, "
        "pipeline stages {pipeline_stages}), so they differ from one "
        "device's step on the whole batch (the training is comparable, not "
        "identical).",
        "none",
        "pipeline-parallelism.md"),
    Difference(
        "micro_batch_precision",
        "In 16-bit precision, micro-batches (a pipeline, gradient "
        "accumulation) round other partial sums than one step on the whole "
        "batch (2.8e-4 in bf16, 5e-5 in fp16 after 3 updates).",
        "`--dtype=bf16` or `fp16`, with pipeline stages or gradient "
        "accumulation",
        lambda f: f.dtype in ("bf16", "fp16") and (
            f.pipeline_stages > 1 or f.micro_batches > 1),
        "{dtype} rounds each micro-batch's sums ({micro_batches} a step, "
        "pipeline stages {pipeline_stages}): the weights differ from one "
        "step on the whole batch by that rounding (2.8e-4 in bf16 after 3 "
        "updates on the tests' model).",
        "fp32; or compare with one device under the same "
        "--gradient_accumulation_steps (identical)",
        "pipeline-parallelism.md"),
    Difference(
        "tensor_parallel_rounding",
        "Tensor parallelism sums the split layers' partial products in "
        "another order: Adam amplifies rounding noise (4e-5 after 3 steps "
        "in float32); bf16 rounds the partial products (6e-3).",
        "`--tensor_parallel` > 1 with Adam or a 16-bit precision",
        lambda f: f.tensor_parallel > 1 and (
            f.optimizer.startswith("adam") or f.dtype in ("bf16", "fp16")),
        "tensor parallelism ({tensor_parallel}) sums partial products in "
        "another order than one device: with {optimizer} in {dtype} the "
        "weights may differ by rounding (about 4e-5 for Adam in float32, "
        "6e-3 in bf16, after 3 steps).",
        "none: SGD in float32 is within 1e-5",
        "tensor-parallelism.md"),
    Difference(
        "generator_resume",
        "A Python generator cannot be restored: a resumed run continues "
        "the epoch in what the rerun's generator yields.",
        "`tfdist.fit(x=generator)`",
        lambda f: f.generator_input,
        "x is a Python generator, which cannot be restored: a resumed run "
        "continues its epoch at the checkpoint's position in what the "
        "rerun's generator yields, the same examples only if it yields the "
        "same batches in the same order.",
        "a keras.utils.PyDataset or a dataset function",
        "data.md", said_by="at resume (`InputPosition.resume_step`)"),
    Difference(
        "self_sharding_epochs",
        "A dataset function that takes `input_context` shards itself: each "
        "worker's epochs are passes over its own share, not aligned to "
        "steps (a step's batch may span two passes, and an example may come "
        "twice in one of Keras's epochs). A resumed run continues each "
        "worker's pass where it stopped.",
        "a dataset function with an `input_context` argument",
        lambda f: f.self_sharding_input,
        "the dataset function takes input_context and shards itself, so "
        "each worker reads passes over its own share, not aligned to "
        "steps: a step's batch may span two passes.",
        "leave input_context out and let tfdist shard the examples",
        "data.md"),
    Difference(
        "parameter_server_input",
        "Parameter-server workers read unseeded copies of every example: "
        "no input position, a resumed run starts the epoch over.",
        "`--distribution_strategy=parameter_server`",
        lambda f: not f.keeps_input_position,
        "parameter-server workers read their own unseeded copies of the "
        "data, so no input position is checkpointed: a resumed run starts "
        "the epoch over.",
        "none",
        "data.md"),
    Difference(
        "dropped_remainder",
        "The last partial batch of an epoch is not trained (`N mod B` "
        "examples left out), where `fit` trains a smaller last step.",
        "the training examples are not a multiple of the global batch",
        lambda f: f.dropped_examples > 0,
        "{dropped_examples} examples of every epoch are not trained.",
        "a --batch_size dividing the examples",
        "fit-conformance.md", said_by="the run plan's warning at start"),
    Difference(
        "batch_valued_metrics",
        "A metric returning one value per batch is averaged over "
        "per-replica batches: its value depends on the replica count.",
        "such a metric, over more than one replica or micro-batch",
        lambda f: bool(f.batch_valued_metrics) and f.splits > 1,
        "metric(s) {metric_names} return one value per batch: averaged "
        "over {splits} per-replica batches.",
        "return one value per example",
        "fit-conformance.md",
        said_by="the warning naming them at start (`tfdist.training."
        "assembly`)"),
)


def applicable(facts: RunFacts) -> List[Difference]:
  """The differences whose condition holds for `facts`, in table order."""
  return [d for d in DIFFERENCES if d.applies(facts)]


def lines(facts: RunFacts) -> List[str]:
  """The run's lines for its applicable differences not said elsewhere:
  `"differs from one device: <line> Fix: <fix>."`."""
  fields = dict(dataclasses.asdict(facts), splits=facts.splits,
                own_step_names=", ".join(facts.own_step),
                metric_names=", ".join(facts.batch_valued_metrics))
  out = []
  for d in applicable(facts):
    if d.said_by:
      continue
    out.append(f"differs from one device ({d.key}): "
               f"{d.line.format(**fields)} Fix: {d.fix}.")
  return out


def say(facts: RunFacts) -> List[str]:
  """Warns once for each applicable difference (`lines`); returns them."""
  said = lines(facts)
  for line in said:
    logging.warning("tfdist: %s", line)
  return said


def markdown_table(differences: Sequence[Difference] = DIFFERENCES) -> str:
  """The docs' list: one row per difference (what, when, fix, guide)."""
  rows = ["| difference | applies when | the run says | to get one "
          "device's result | guide |",
          "|---|---|---|---|---|"]
  for d in differences:
    said = d.said_by or "a warning at start"
    rows.append(f"| {d.what} | {d.condition} | {said} | {d.fix} | "
                f"[{d.guide}]({d.guide}) |")
  return "\n".join(rows)


def facts_of(*, model, optimizer: str, plain_sgd: bool, replicas: int,
             micro_batches: int, zero_stage: int, pipeline_stages: int,
             tensor_parallel: int, dtype: str, own_step: Tuple[str, ...],
             batch_valued_loss: bool, loss_name: str,
             input_fn: Optional[Callable], keeps_input_position: bool
             ) -> RunFacts:
  """`RunFacts` from the built model and the run's settings (the layers
  are found by walking `model`'s sub-layers; `input_fn`: the training
  dataset function, None for files)."""
  layers = [model] + private_api.flatten_layers(model, include_self=False)
  self_sharding = bool(
      input_fn is not None and input_pipeline.takes_input_context(input_fn)
      and not getattr(input_fn, input_pipeline.SHARDS_BY_EXAMPLE, False))
  return RunFacts(
      replicas=int(replicas), micro_batches=int(micro_batches),
      batch_valued_loss=bool(batch_valued_loss), loss_name=loss_name,
      own_step=tuple(own_step), zero_stage=int(zero_stage or 0),
      optimizer=optimizer or "sgd", plain_sgd=bool(plain_sgd),
      sparse_gradients=any(isinstance(l, keras.layers.Embedding)
                           for l in layers),
      pipeline_stages=int(pipeline_stages or 1),
      batch_norm=any(isinstance(l, keras.layers.BatchNormalization)
                     for l in layers),
      dropout=any(isinstance(l, keras.layers.Dropout) for l in layers),
      tensor_parallel=int(tensor_parallel or 1), dtype=dtype or "fp32",
      generator_input=bool(getattr(input_fn, input_position.RESUME_NOTE,
                                   None)),
      self_sharding_input=self_sharding,
      keeps_input_position=bool(keeps_input_position))


def micro_batches_of(gradient_accumulation_steps: int, pipeline=None
                     ) -> int:
  """The micro-batches one update's batch is cut into on each replica:
  K accumulation micro-steps, each split over a pipeline's D copies and
  M micro-batches (`pipeline`: the run's `PipelineOptions`, or None)."""
  if pipeline is None or not pipeline.enabled:
    return int(gradient_accumulation_steps)
  return int(gradient_accumulation_steps) * pipeline.data * (
      pipeline.num_microbatches)


def facts_of_run(options, *, parts, plan, replicas: int,
                 input_fn: Optional[Callable],
                 keeps_input_position: bool) -> RunFacts:
  """`facts_of` for a built run.

  Args:
    options: the run's `tfdist.training.assembly.AssemblyOptions`.
    parts: its built `tfdist.training.assembly.Parts`.
    plan: its `tfdist.training.plan.run_plan.RunPlan`.
    replicas: the strategy's `num_replicas_in_sync`.
    input_fn, keeps_input_position: as `facts_of`.
  """
  loss = parts.objectives.loss if parts.objectives is not None else None
  sums = parts.metric_sums
  # Traced only where they would differ (more than one batch per step).
  pipeline = options.pipeline
  micro_batches = micro_batches_of(plan.batch.gradient_accumulation_steps,
                                   pipeline)
  split = replicas * micro_batches > 1 and (
      sums is not None and sums.y_true is not None)
  batch_valued = bool(
      split and loss is not None and
      objectives_lib.batch_valued_loss(loss, y_true=sums.y_true,
                                       y_pred=sums.y_pred))
  facts = facts_of(
      model=parts.model, optimizer=options.optimization.optimizer,
      plain_sgd=(options.optimization.optimizer == "sgd" and
                 not options.optimization.momentum and
                 options.optimization.clipnorm is None and
                 options.optimization.global_clipnorm is None),
      replicas=replicas,
      micro_batches=micro_batches,
      zero_stage=options.memory.zero_stage_resolved,
      pipeline_stages=pipeline.num_stages if pipeline is not None else 1,
      tensor_parallel=options.strategy.parallelism.tensor_parallel,
      dtype=options.dtype,
      own_step=tuple(h for h in custom_step.overrides(parts.model)
                     if h.endswith((".train_step", ".compute_loss"))),
      batch_valued_loss=batch_valued,
      loss_name=getattr(loss, "name", "loss"), input_fn=input_fn,
      keeps_input_position=keeps_input_position)
  return dataclasses.replace(
      facts, dropped_examples=int(plan.batch.dropped_per_epoch or 0),
      batch_valued_metrics=tuple(objectives_lib.batch_valued_metrics(
          sums.metrics, y_true=sums.y_true, y_pred=sums.y_pred))
      if split else ())
