"""The parallelism section (`config.strategy.parallelism`: pipeline stages,
tensor and expert parallelism), and the parallel modes' checks of those
settings against the rest of the run.

Consumers: the parallel modes (the pipeline's `PipelineOptions.of(
config.strategy.parallelism, ...)`, the tensor and experts backends). The
checks across sections are the modes' options modules' own (`check_flags`),
run by `TrainConfig._validate` (`tfdist.config.root`) through
`check_pipeline`, `check_tensor_parallel` and `check_expert_parallel`:
this module alone of the config imports the parallel packages (their floor
is above the config's, `tests/imports_test.py`).
"""

import dataclasses
from typing import Optional, Tuple

from tfdist.config.values import _set
from tfdist.config_tree import setting
from tfdist.parallel.experts import options as expert_options
from tfdist.parallel.pipeline import options as pipeline_options
from tfdist.parallel.tensor import options as tensor_parallel_options


@dataclasses.dataclass(frozen=True)
class ParallelismConfig:
  """Model parallelism: pipeline stages (tfdist/parallel/pipeline/options.py)
  and tensor parallelism (tfdist/parallel/tensor/options.py).
  """
  pipeline_stages: int = setting(
      1, "integer", "pipeline",
      help=("Cut the model (functional or Sequential) into P stages of "
            "consecutive layers, stage i on GPU i (on a CPU, logical CPU "
            "device i); micro-batches flow through them and one update is "
            "applied per step, equal to the unsplit model's. In a cluster of "
            "a chief and workers (tfdist.launch, TF_CONFIG) the chief drives "
            "and each task hosts P/tasks consecutive stages. 1: no pipeline. "
            "With --num_gpus=N or --num_cpu_devices=N (N a multiple of P) "
            "one process trains N/P data-parallel copies of the pipeline (a "
            "data x pipeline mesh); in a cluster N counts each task's "
            "devices, T tasks holding T*N/P copies. With --distribution_strategy auto, "
            "one_device or off, not with --zero_stage or --enable_xla. See "
            "docs/guides/pipeline-parallelism.md."),
      traits=("operational", "multi_replica"))
  num_microbatches: Optional[int] = setting(
      None, "integer", "pipeline",
      help=("Pipeline micro-batches per step (M): each is 1/M of the step's "
            "batch (of each micro-step under --gradient_accumulation_steps), "
            "so M must divide it. The idle fraction of each stage is "
            "(P-1)/(M+P-1). Default: --pipeline_stages."),
      traits=("multi_replica",))
  pipeline_schedule: str = setting(
      "gpipe", "enum", "pipeline", choices=pipeline_options.SCHEDULES,
      help=("gpipe: every micro-batch's forward, then every backward (a stage"
            " holds M micro-batches' activations); 1f1b: one forward, one "
            "backward after a warm-up (at most P). Same bubble, same update. "
            "interleaved: Megatron's interleaved 1F1B over "
            "--pipeline_virtual_stages=V chunks per stage (chunk c on stage "
            "c mod P): bubble (P-1)/(V*M+P-1) for V times more transfers "
            "between stages; M must be a multiple of P."),
      traits=("operational", "multi_replica"))
  pipeline_virtual_stages: int = setting(
      1, "integer", "pipeline",
      help=("V, the model chunks each pipeline stage holds under "
            "--pipeline_schedule=interleaved (V >= 2 there, 1 otherwise): "
            "the model is cut into P*V chunks of consecutive layers "
            "(balanced, or by --pipeline_cuts: P*V-1 names), chunk c on "
            "stage c mod P. One copy of the pipeline only."),
      traits=("operational", "multi_replica"))
  # Stored as a tuple of layer names (`pipeline_options.parse_cuts`).
  pipeline_cuts: Tuple[str, ...] = setting(
      (), "list", "pipeline",
      help=("Layer names, each the first layer of a stage after the first "
            "(P-1 names, in the model's call order; P*V-1 under "
            "--pipeline_schedule=interleaved), e.g. block_3,block_6. "
            "Default: stages balanced by weight and activation bytes."),
      traits=("operational", "multi_replica"))
  tensor_parallel: int = setting(
      1, "integer", "pipeline",
      help=("Split the built-in Transformer's attention heads and feed-"
            "forward units over T replicas of one host (Megatron's tensor-"
            "parallel layers): each replica keeps 1/T of those weights and "
            "their optimizer state. With --num_gpus or --num_cpu_devices N "
            "(a multiple of T; default T) the replicas are a data x tensor "
            "mesh: N/T copies of T, each training on its 1/(N/T) of the "
            "global batch, gradients summed over the copies; the update "
            "equals one device's. 1: off. Only with --model=transformer (or "
            "a model of your own that --layout_map splits: its mesh's model "
            "axis sets T) and --distribution_strategy mirrored (or auto) on "
            "one host; "
            "--zero_stage=1 or 2 shards the optimizer state over each data "
            "group's N/T replicas (hybrid sharding); not with --zero_stage=3, "
            "--enable_xla, --dtype=fp16 or clipping. With --pipeline_stages=P "
            "only with a layout map (--layout_map, or tfdist.fit(..., "
            "layout_map=...); the map's model axis is T): each stage's Dense layers the map splits take T devices, "
            "N = D x P x T in one process (docs/guides/device-mesh.md). Pays "
            "on fast device links (NVLink), not on CPUs. See "
            "docs/guides/tensor-parallelism.md."),
      traits=())
  expert_parallel: int = setting(
      1, "integer", "pipeline",
      help=("Split every MixtureOfExperts layer's experts (--transformer_"
            "experts, or tfdist.MixtureOfExperts in a model of one's own) "
            "over E_p replicas (of one host, or of every worker): the "
            "replicas form groups of E_p, each replica holds 1/E_p of the "
            "experts and their optimizer state, and tokens reach their "
            "experts by all-to-all; the other weights stay data-parallel "
            "(with --zero_stage=1 or 2 their optimizer state sharded over "
            "the replicas). E_p must divide the experts and the replicas. "
            "1: off. Only with --distribution_strategy mirrored, "
            "multi_worker_mirrored (or auto); not with --pipeline_stages, "
            "--tensor_parallel, --zero_stage=3, --enable_xla, --dtype=fp16 "
            "or clipping. See docs/guides/experts.md."),
      traits=("operational", "multi_replica"))

  def __post_init__(self):
    _set(self, "pipeline_cuts", pipeline_options.parse_cuts(self.pipeline_cuts))


# The checks across sections below read `config`'s settings by flat name: a
# `TrainConfig`, or the view `TrainConfig.check_decided` runs them on (the
# values a run decided read in place of the caller's).


def check_pipeline(config) -> None:
  """Pipeline stages, micro-batches, schedule, virtual stages and cuts
  against the strategy, ZeRO, XLA and the devices (P x T of them a copy
  with `--tensor_parallel`; `tfdist.parallel.pipeline.options.check_flags`).

  Raises:
    ConfigError: a rule is broken.
  """
  pipeline_options.check_flags(
      pipeline_stages=config.pipeline_stages,
      num_microbatches=config.num_microbatches,
      pipeline_schedule=config.pipeline_schedule,
      pipeline_cuts=config.pipeline_cuts,
      pipeline_virtual_stages=config.pipeline_virtual_stages,
      distribution_strategy=config.distribution_strategy,
      zero_stage=config.zero_stage_resolved, enable_xla=config.enable_xla,
      num_gpus=config.num_gpus, num_cpu_devices=config.num_cpu_devices,
      tensor_parallel=config.tensor_parallel)


def check_tensor_parallel(config) -> None:
  """`--tensor_parallel` against the model (any, with a layout map:
  `--layout_map`'s, or the one `tfdist.fit(layout_map=...)` gave), the
  strategy and the other levers
  (`tfdist.parallel.tensor.options.check_flags`).

  Raises:
    ConfigError: a rule is broken.
  """
  tensor_parallel_options.check_flags(
      tensor_parallel=config.tensor_parallel, model=config.model,
      distribution_strategy=config.distribution_strategy,
      zero_stage=config.zero_stage_resolved,
      pipeline_stages=config.pipeline_stages, enable_xla=config.enable_xla,
      dtype=config.dtype, clipnorm=config.clipnorm,
      global_clipnorm=config.global_clipnorm,
      init_checkpoint=config.init_checkpoint, num_gpus=config.num_gpus,
      num_cpu_devices=config.num_cpu_devices,
      layout_map=(getattr(config, "layout_map", "") or
                  bool(getattr(config, "layout_map_entries", ()))),
      model_given="model" not in getattr(config, "unset_fields", ()))


def check_expert_parallel(config, model_named: bool = False) -> None:
  """`--expert_parallel` (`tfdist.parallel.experts.options.check_flags`).

  Args:
    config: the `TrainConfig` (or a view of it).
    model_named: the run's model is final (a run being prepared: the data
      set's model for `tfdist.train`, `model_fn`'s name for `tfdist.fit`),
      so an unset `--model` counts as the one the run builds; False (a
      config being made): an unset `--model` is not known yet, since
      `tfdist.fit` names its own model later.

  Raises:
    ConfigError: a rule is broken.
  """
  settings = {name: getattr(config, name if name != "zero_stage" else
                            "zero_stage_resolved")
              for name in expert_options.CHECKED_SETTINGS}
  if not model_named and "model" in getattr(config, "unset_fields", ()):
    settings["model"] = None
  expert_options.check_flags(**settings)
