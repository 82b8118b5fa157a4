"""`--expert_parallel=E_p`, checked at start (pure Python, no TensorFlow).

E_p > 1 splits every `MixtureOfExperts` layer's E experts over E_p
replicas of a `MirroredStrategy` on one host or of a
`MultiWorkerMirroredStrategy` across its workers (each replica holds
E / E_p experts and their optimizer state; tokens travel to their experts
by all-to-all, across processes where a group spans workers); the
replicas are cut into R / E_p expert groups, each a data-parallel copy of
the experts. `check_flags` refuses what cannot run,
naming the flag, the value and the fix, before anything is built;
`tfdist.config` calls it while it validates a `TrainConfig`. The step
mode is `tfdist.parallel.experts.mode`. What only the built model tells
(E_p dividing each layer's experts for a model of one's own, the replicas
of `--num_gpus=-1`) is refused when the model is built, before training.
"""

from typing import Optional

from tfdist import errors
from tfdist.runtime import wording

# Strategies it runs under: those whose replicas hold per-replica expert
# weights and run every step together (one host's, or every worker's).
STRATEGIES = ("auto", "mirrored", "multi_worker_mirrored")
# Its replicas span the workers; their count is known only when the
# cluster is (on CPUs one per worker, whatever --num_cpu_devices).
MULTI_WORKER = "multi_worker_mirrored"
# The built-in models with no MixtureOfExperts layer.
WITHOUT_EXPERTS = ("cnn", "resnet", "ranking")

# Why --zero_stage=3 cannot run beside it, and the fix (stages 1-2 run:
# `tfdist.parallel.experts.zero`).
_ZERO_3_REFUSED = (
    "ZeRO stage 3 gathers every replica's weights from one flat list of "
    "shards, and here the experts' weights differ per replica (use "
    "--zero_stage=2 or 1 instead: the non-expert optimizer state sharded "
    "over the replicas, the experts' on their replicas)")

# The settings (flag names) `check_flags` reads, for the step mode's
# `validate` (`tfdist.parallel.mode.StepMode.validate`).
CHECKED_SETTINGS = (
    "expert_parallel",
    "model",
    "transformer_experts",
    "distribution_strategy",
    "zero_stage",
    "pipeline_stages",
    "tensor_parallel",
    "enable_xla",
    "dtype",
    "clipnorm",
    "global_clipnorm",
    "init_checkpoint",
    "num_gpus",
    "num_cpu_devices",
)


def check_flags(*, expert_parallel: int, model: Optional[str] = None,
                transformer_experts: int = 0,
                distribution_strategy: str = "auto", zero_stage: int = 0,
                pipeline_stages: int = 1, tensor_parallel: int = 1,
                enable_xla: bool = False, dtype: str = "fp32",
                clipnorm: Optional[float] = None,
                global_clipnorm: Optional[float] = None,
                init_checkpoint: Optional[str] = None, num_gpus: int = -1,
                num_cpu_devices: int = 0) -> None:
  """Refuses `--expert_parallel` settings that cannot run.

  Args:
    expert_parallel: E_p (1: off).
    model, transformer_experts: the run's model (None: not known yet),
      and the built-in Transformer's experts (0: none); with the
      Transformer, E_p must divide the experts.
    distribution_strategy, zero_stage, pipeline_stages, tensor_parallel,
      enable_xla, dtype, clipnorm, global_clipnorm, init_checkpoint,
      num_gpus, num_cpu_devices: the run's flags of those names.

  Raises:
    errors.ConfigError: E_p < 1; E_p > 1 with the built-in Transformer
      and no experts or experts not a multiple of E_p, or another
      built-in model (none has experts); a strategy that
      cannot host it (parameter servers, TPU, one device, none); pipeline
      stages or tensor parallelism beside it; a replica count known from
      the flags of one host (`--num_gpus` > 0 or `--num_cpu_devices` > 0,
      not under multi_worker_mirrored) that E_p does not divide; ZeRO
      stage 3 (stages 1-2 run: `tfdist.parallel.experts.zero`), XLA,
      fp16, gradient clipping or `--init_checkpoint`.
  """
  if not isinstance(expert_parallel, int) or expert_parallel < 1:
    raise errors.ConfigError(f"--expert_parallel={expert_parallel} must be "
                             "a positive integer (1: off).")
  n = expert_parallel
  if n == 1:
    return
  flag = f"--expert_parallel={n}"
  if model == "transformer":
    _check_transformer_experts(flag, n, model, transformer_experts,
                               replicas=_known_replicas(
                                   num_gpus, num_cpu_devices,
                                   distribution_strategy == MULTI_WORKER))
  elif model in WITHOUT_EXPERTS:
    raise errors.ConfigError(
        f"{flag} splits mixture-of-experts layers, and the built-in --model="
        f"{model} has none. Use --model=transformer with "
        f"--transformer_experts={2 * n}, a model of your own with "
        f"tfdist.MixtureOfExperts, or drop {flag}.")
  if distribution_strategy not in STRATEGIES:
    raise errors.ConfigError(
        f"{flag} splits the experts over the replicas of a MirroredStrategy "
        "or MultiWorkerMirroredStrategy (per-replica expert weights, "
        "all-to-all between replicas); --distribution_strategy="
        f"{distribution_strategy} cannot host it. Use --distribution_"
        "strategy=mirrored, multi_worker_mirrored or auto, or drop "
        f"{flag}.")
  for given, name, why in (
      (pipeline_stages > 1, f"--pipeline_stages={pipeline_stages}",
       "a pipeline's stages are not data-parallel replicas"),
      (tensor_parallel > 1, f"--tensor_parallel={tensor_parallel}",
       "tensor parallelism already gives every replica the whole batch"),
      (zero_stage == 3, f"--zero_stage={zero_stage}", _ZERO_3_REFUSED),
      (enable_xla, "--enable_xla",
       "the all-to-all runs inside the forward pass, which one replica's "
       "XLA cluster cannot compile"),
      (dtype == "fp16", "--dtype=fp16",
       "the loss scale's finite check would see only this replica's "
       "experts"),
      (clipnorm is not None, f"--clipnorm={clipnorm}",
       "each replica would clip its experts' gradients alone"),
      (global_clipnorm is not None, f"--global_clipnorm={global_clipnorm}",
       "each replica would clip by the norm of its own experts only"),
      (init_checkpoint, f"--init_checkpoint={init_checkpoint}",
       "warm starts load into a model holding every expert (resuming "
       "from --model_dir's own checkpoints works)")):
    if given:
      raise errors.ConfigError(
          f"{flag} cannot run with {name}: {why}. Drop one of the two.")
  if distribution_strategy != MULTI_WORKER:
    _check_devices(flag, n, num_gpus=num_gpus,
                   num_cpu_devices=num_cpu_devices)


def _check_transformer_experts(flag: str, n: int, model: Optional[str],
                               experts: int, replicas: int = 0) -> None:
  """The built-in Transformer needs experts, a multiple of E_p of them;
  the E_p offered instead divide the `replicas` too (0: not known)."""
  if not experts:
    raise errors.ConfigError(
        f"{flag} splits mixture-of-experts layers, and --model="
        f"{model} has none (--transformer_experts=0). Pass "
        f"--transformer_experts={2 * n} (a multiple of {n}), or drop {flag}.")
  if experts % n:
    fits = [d for d in range(2, experts + 1)
            if experts % d == 0 and (not replicas or replicas % d == 0)]
    other = (f"--expert_parallel={wording.either(fits)}, or " if fits
             else "")
    raise errors.ConfigError(
        f"{flag} splits the --transformer_experts={experts} experts evenly "
        f"over {n} replicas; {experts} is not a multiple of {n}. Use "
        f"{other}--transformer_experts="
        f"{n * max(1, experts // n)} or {n * (experts // n + 1)}.")


def _known_replicas(num_gpus: int, num_cpu_devices: int,
                    across_workers: bool = False) -> int:
  """The replicas the flags of one host give (`--num_gpus` > 0, else
  `--num_cpu_devices`; 1 with `--num_gpus=0` and no split); 0 where the
  flags do not say (all visible GPUs, or across workers)."""
  if across_workers:
    return 0
  devices = num_gpus if num_gpus > 0 else num_cpu_devices
  return 1 if devices == 0 and num_gpus == 0 else devices


def _check_devices(flag: str, n: int, *, num_gpus: int,
                   num_cpu_devices: int) -> None:
  """Refuses a known replica count that E_p does not divide."""
  devices = _known_replicas(num_gpus, num_cpu_devices)
  name = "--num_gpus" if num_gpus > 0 else "--num_cpu_devices"
  if devices and devices % n:
    raise errors.ConfigError(
        f"{flag} cuts the replicas into groups of {n}, and {name}={devices}"
        f" gives {devices} replica(s), not a multiple of {n}. Pass {name}="
        f"{n * max(1, devices // n)}, or an --expert_parallel dividing "
        f"{devices}.")
