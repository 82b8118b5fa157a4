"""The frozen run configuration: `TrainConfig`, a tree of sections, one per
part of the run.

One module per section family, each named for the part that receives its
section, and the root config (`tfdist.config.root`: `TrainConfig`, its
composition, the rules across sections, the flat names of the flags and of
`tfdist.fit`'s keywords). The modules import downwards only: `values` (what
the sections share), the sections, then `root`, then `model_builder`.

  values.py         shared names: `DATASET_RECOMMENDED_FLAGS`, the checks'
                    error form
  task.py           `TaskConfig`, `DataConfig` (model, data, mode)
  outputs.py        `OutputsConfig` (folders, the profiler's window)
  loop.py           `LoopConfig` (steps, batches, checkpoints, the seed)
  parallelism.py    `ParallelismConfig` (pipeline, tensor, experts) and the
                    parallel modes' checks across sections
  strategy.py       `StrategyConfig` and its `ClusterConfig`,
                    `ParameterServerConfig`, `TpuConfig`
  precision.py      `PrecisionConfig` (dtype, loss scale, XLA)
  memory.py         `MemoryConfig` (recomputation, ZeRO, the allocator)
  optimization.py   `OptimizationConfig` and its `LearningRateConfig`
  reliability.py    `ReliabilityConfig` (guards of a long run)
  cloud.py          `CloudConfig` (Vertex AI)
  root.py           `TrainConfig`, `settings_with`, `flat_fields`
  model_builder.py  `ModelBuilderConfig` (what a model builder is given)

Every public name is read here as before (`tfdist.config.TrainConfig`,
`from tfdist.config import TrainConfig`).
"""

# pylint: disable=g-multiple-import,g-importing-member
from tfdist.config.values import (
    DATASET_RECOMMENDED_FLAGS, UNSET_DEFAULTS)
from tfdist.config.task import (
    DEFAULT_DATASET, FEATURE_SPEC_DATASET, MODES, DataConfig, TaskConfig,
    parse_class_weight, require_data_files)
from tfdist.config.outputs import (
    OutputsConfig, parse_profile_steps, require_model_dir, resolve_folder)
from tfdist.config.loop import (
    TPU_DEFAULT_STEPS_PER_EXECUTION, LoopConfig)
from tfdist.config.parallelism import ParallelismConfig
from tfdist.config.strategy import (
    ALL_REDUCE_ALGS, AUTO_STRATEGY, PS_PARTITIONERS, STRATEGIES,
    ClusterConfig, ParameterServerConfig, StrategyConfig, TpuConfig,
    refuse_auto, requested_kind)
from tfdist.config.precision import (
    DTYPE_ALIASES, DTYPE_FLAG_VALUES, DTYPES, PrecisionConfig,
    normalize_dtype, parse_loss_scale)
from tfdist.config.memory import MemoryConfig
from tfdist.config.optimization import (
    LR_SCALING_RULES, LearningRateConfig, OptimizationConfig)
from tfdist.config.reliability import (
    DEFAULT_MAX_CONSECUTIVE_SKIPPED_STEPS, ReliabilityConfig)
from tfdist.config.cloud import (
    HPTUNE_METRIC_PATTERN, HPTUNE_METRICS, CloudConfig)
from tfdist.config.root import (
    BOOKKEEPING_FIELDS, RECOMMENDABLE_FIELDS, SHARDING_SWITCHES, TrainConfig,
    flat_fields, section_of, settings_with)
from tfdist.config.model_builder import ModelBuilderConfig
