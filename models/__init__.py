"""tfdist's built-in model builders, registered by name (`--model`).

Imported as `tfdist.models` (this folder is installed there; see
`tfdist/__init__.py`), so a project's own `models` package never shadows it.
Each builder is registered with `tfdist.core.registry.register_model` and
takes the run's `DatasetSpec` (`spec`) and, by name, only the values it reads:
the ranking model `embedding_dim` and `hash_buckets`; the text classifier
(`transformer`) `transformer_layers` (its depth), `tensor_parallel`
(built from the tensor-parallel layers, `--tensor_parallel`) and `config`
(its experts, `--transformer_experts`, `transformer_experts`); those with
batch normalization also `sync_batch_norm` (the run plan's decision, see
`resolve_sync_batch_norm`), and those that can recompute their activations
(`cnn`, `resnet`; `recompute.py`) `activation_recomputation`. Every model
returns a `keras.Model` whose output stays float32 under a mixed precision
policy (the last layer is a float32 activation): image models (`cnn`,
`resnet`) return logits [batch, num_classes]; the ranking model (`ranking`)
returns sigmoid probabilities [batch, 1], as does the text classifier
(`transformer`) for a binary task.
"""

import dataclasses
from typing import Optional, Tuple

import keras

from tfdist import errors
from tfdist.core.dataset_spec import DatasetSpec
from tfdist.core import registry
from tfdist.parallel.experts import traffic
from . import cnn
from . import ranking
from . import resnet
from . import transformer


def _image_shape(name: str, spec) -> Tuple[Tuple[int, ...], int]:
  if not spec.input_shape or spec.num_classes < 2:
    raise errors.ConfigError(
        f"--model={name} is an image classifier: it needs a data set with an "
        f"input_shape and num_classes (e.g. --dataset=fashion_mnist); "
        f"--dataset={spec.name} has input_shape={spec.input_shape}, "
        f"num_classes={spec.num_classes}. Bring your own model: "
        "--model=package.module:build_fn.")
  return tuple(spec.input_shape), spec.num_classes


@registry.register_model("cnn")
def _build_cnn(spec, sync_batch_norm: bool = False,
               activation_recomputation: bool = False) -> keras.Model:
  input_shape, num_classes = _image_shape("cnn", spec)
  return cnn.build_cnn(input_shape=input_shape, num_classes=num_classes,
                       sync_batch_norm=bool(sync_batch_norm),
                       activation_recomputation=bool(activation_recomputation))


@registry.register_model("resnet")
def _build_resnet(spec, sync_batch_norm: bool = False,
                  activation_recomputation: bool = False) -> keras.Model:
  input_shape, num_classes = _image_shape("resnet", spec)
  return resnet.build_resnet(
      input_shape=input_shape, num_classes=num_classes,
      sync_batch_norm=bool(sync_batch_norm),
      activation_recomputation=bool(activation_recomputation))


@registry.register_model("ranking")
def _build_ranking(spec, embedding_dim: int = 16,
                   hash_buckets: int = 100_000) -> keras.Model:
  if not spec.id_features:
    raise errors.ConfigError(
        f"--model=ranking embeds id features; --dataset={spec.name} has none "
        "(use --dataset=movielens).")
  return ranking.build_ranking(
      id_features=spec.id_features, num_dense=spec.num_dense,
      num_classes=spec.num_classes,
      embedding_dim=embedding_dim, hash_buckets=hash_buckets)


@registry.register_model("transformer")
def _build_transformer(spec, transformer_layers: int = 2,
                       tensor_parallel: bool = False,
                       config=None) -> keras.Model:
  if not spec.vocabulary_size or len(spec.input_shape) != 1:
    raise errors.ConfigError(
        f"--model=transformer classifies token ids: it needs a text data set "
        f"with a vocabulary (e.g. --dataset=clothing_reviews); --dataset="
        f"{spec.name} has input_shape={spec.input_shape}, vocabulary_size="
        f"{spec.vocabulary_size}.")
  return transformer.build_transformer(
      sequence_length=spec.input_shape[0],
      vocabulary_size=spec.vocabulary_size,
      num_classes=max(1, spec.num_classes), num_layers=transformer_layers,
      tensor_parallel=tensor_parallel,
      experts=transformer_experts(config, tensor_parallel=tensor_parallel))


def transformer_experts(model_options, *, tensor_parallel: bool = False
                        ) -> transformer.ExpertsOptions:
  """The Transformer's mixture-of-experts options from the builder's model
  options (its `config`: a `tfdist.config.ModelBuilderConfig`, the run's
  model section, with `--transformer_experts` and the `--experts_*`
  flags); dense (no experts) when `model_options` is None or has no
  `transformer_experts` (`ModelOptions`).

  Raises:
    tfdist.errors.ConfigError: experts with `--tensor_parallel`.
  """
  experts = (getattr(model_options, "transformer_experts", 0)
             if model_options else 0)
  if not experts:
    return transformer.ExpertsOptions()
  if tensor_parallel:
    raise errors.ConfigError(
        f"--transformer_experts={experts} cannot run "
        "with --tensor_parallel: the experts have no tensor-parallel form. "
        "Drop one of the two.")
  return transformer.ExpertsOptions(
      num_experts=experts, top_k=model_options.experts_top_k,
      capacity_factor=model_options.experts_capacity_factor,
      load_balancing_loss_weight=(
          model_options.experts_load_balancing_loss_weight),
      router_z_loss_weight=model_options.experts_router_z_loss_weight)


def experts_shape(name: str, model_options, spec
                  ) -> Optional[traffic.ExpertsShape]:
  """The built-in Transformer's mixture-of-experts layers as the run plan
  counts their all-to-all traffic (`tfdist.parallel.experts.traffic`):
  `--transformer_layers` layers of `--transformer_experts` experts, one
  routing group per example (its `sequence_length` tokens), `EMBED_DIM`
  wide. None for another model (a model of one's own is known once
  built) or a dense Transformer.

  Args:
    name: `--model`.
    model_options: the run's model options (the config's task section).
    spec: the data set's `DatasetSpec` (`input_shape`: `[sequence_length]`).
  """
  if (name != "transformer" or not model_options or
      not getattr(model_options, "transformer_experts", 0) or
      len(spec.input_shape or ()) != 1):
    return None
  experts = transformer_experts(model_options)
  tokens = int(spec.input_shape[0])
  return traffic.ExpertsShape(
      layers=model_options.transformer_layers,
      num_experts=experts.num_experts, top_k=experts.top_k,
      capacity_factor=experts.capacity_factor, tokens_per_example=tokens,
      tokens_per_group=tokens, d_model=transformer.EMBED_DIM)


# Built-in builders whose models have batch normalization (they take
# `sync_batch_norm`).
_BATCH_NORM = frozenset({"cnn", "resnet"})


# Why built-in builders that take no `activation_recomputation` cannot.
_NO_RECOMPUTATION_REASONS = {
    "ranking": "its activations are a few embedding rows and a small MLP "
               "per example (nothing worth recomputing), and its embedding "
               "lookups produce sparse gradients over tables that parameter "
               "servers shard, which tf.recompute_grad does not handle",
}


def supports_recomputation(name: str) -> bool:
  """True when the builder of `--model=name` (registered or an import
  path) can recompute activations: it takes an `activation_recomputation`
  argument (`--activation_recomputation`; the built-in `cnn` and
  `resnet`).

  Raises:
    ConfigError: unknown name.
  """
  _, builder = registry.get_model_builder(name)
  return registry.accepts(builder, "activation_recomputation")


def check_recomputation(name: str, activation_recomputation: bool, *,
                        builder=None):
  """Raises `ConfigError` when `--activation_recomputation` is asked of a
  model whose builder cannot say so (it takes no `activation_recomputation`
  argument); the message says why. `builder`: the builder of `name` (None:
  looked up)."""
  if not activation_recomputation:
    return
  if builder is None:
    _, builder = registry.get_model_builder(name)
  if registry.accepts(builder, "activation_recomputation"):
    return
  reason = _NO_RECOMPUTATION_REASONS.get(
      name, "its builder takes no activation_recomputation argument (a "
            "builder that can recompute names it and wraps its blocks, e.g. "
            "with tfdist.models.recompute.recomputing_model)")
  raise errors.ConfigError(
      f"--activation_recomputation (--gradient_checkpointing) is not "
      f"available for --model={name}: {reason}. The built-in models that "
      f"recompute: cnn, resnet; or drop the flag.")


def has_batch_norm(name: str) -> bool:
  """True for built-in models with batch normalization (`--sync_batch_norm`
  applies to them)."""
  return name in _BATCH_NORM


def resolve_sync_batch_norm(value: Optional[bool], *, strategy_name: str,
                            num_replicas_in_sync: int, synchronous: bool,
                            xla_per_replica: bool = False
                            ) -> Tuple[bool, str]:
  """Whether built-in models normalize over the global batch, and why.

  Args:
    value: `--sync_batch_norm` (None: the default).
    strategy_name: the concrete strategy (`mirrored`, ...; never `auto`).
    num_replicas_in_sync: replicas over all workers.
    synchronous: the strategy's replicas apply one update together per
      step (all-reduce), so batch statistics can be summed over the global
      batch: its backend's trait, `not tfdist.backends.registry.
      backend_for(kind).asynchronous` (False under parameter_server).
    xla_per_replica: each replica's forward pass is XLA-compiled on its own
      (`--enable_xla` off TPUs), where an all-reduce cannot run.

  Returns:
    `(synchronized, reason)`. The default is synchronized under a
    synchronous strategy (`synchronous`) with more than one
    replica: N replicas then normalize as one device on the global batch
    (three small all-reduces per batch-norm layer in the forward pass, and
    their gradients). With one replica, under parameter_server (each worker
    updates alone), or with `xla_per_replica`, statistics are per replica.

  Raises:
    tfdist.errors.ConfigError: `--sync_batch_norm` with `--enable_xla` off
      TPUs (compiling the all-reduce into one replica's XLA cluster fails
      under MirroredStrategy).
  """
  if value and xla_per_replica and num_replicas_in_sync > 1:
    raise errors.ConfigError(
        "--sync_batch_norm needs an all-reduce inside the forward pass, "
        "which --enable_xla compiles per replica (off TPUs) where it cannot "
        "run. Drop one of --sync_batch_norm and --enable_xla.")
  if value is not None:
    return bool(value), f"--sync_batch_norm={str(bool(value)).lower()}"
  if synchronous and num_replicas_in_sync > 1:
    if xla_per_replica:
      return False, ("default with --enable_xla: each replica's forward "
                     "pass is compiled alone")
    return True, (f"default under {strategy_name} with "
                  f"{num_replicas_in_sync} replicas")
  why = ("one replica" if num_replicas_in_sync <= 1 else
         f"{strategy_name} is not synchronous")
  return False, f"default: {why}"


@dataclasses.dataclass(frozen=True)
class ModelOptions:
  """What the built-in builders read besides the data set.

  `build_model` hands it to builders that ask for `config`, so a builder
  written against a `TrainConfig` (reading `config.embedding_dim`, ...)
  gets the same values.
  """
  embedding_dim: int = 16
  hash_buckets: int = 100_000
  activation_recomputation: bool = False


def model_names() -> Tuple[str, ...]:
  """Names accepted by `--model` (the built-in ones and any registered)."""
  return registry.model_names()


def build_model(name: str, *, spec: Optional[DatasetSpec] = None,
                input_shape=None, num_classes: Optional[int] = None,
                embedding_dim: int = 16, hash_buckets: int = 100_000,
                sync_batch_norm: bool = False,
                activation_recomputation: bool = False) -> keras.Model:
  """Builds the model registered as `name` for the data set `spec`.

  Args:
    name: a registered name (`model_names()`) or an import path.
    spec: the data set's `tfdist.core.dataset_spec.DatasetSpec`.
    input_shape, num_classes: image models only, instead of `spec`.
    embedding_dim, hash_buckets: the ranking model's embedding width and
      rows of each hashed id table.
    sync_batch_norm: batch statistics over the global batch (see
      `resolve_sync_batch_norm`); reaches only models with batch
      normalization (`has_batch_norm`).
    activation_recomputation: blocks recompute their activations in the
      backward pass (`supports_recomputation`; models/recompute.py).

  Raises:
    ConfigError: unknown name (the message lists the registered ones), a
      data set the model cannot take, or `activation_recomputation` for a
      model that cannot.
  """
  if spec is None:
    if input_shape is None or num_classes is None:
      raise ValueError(f"--model={name}: pass spec=DatasetSpec, or both "
                       "input_shape and num_classes.")
    spec = DatasetSpec(name="arrays", input_shape=tuple(input_shape),
                       num_classes=num_classes, task="multiclass",
                       parse_fn=lambda serialized: serialized)
  _, builder = registry.get_model_builder(name)
  check_recomputation(name, activation_recomputation, builder=builder)
  # A builder of your own may still read these from `config` (the
  # documented signature `build(spec, config)`, docs/guides/your-model.md).
  config = ModelOptions(embedding_dim=embedding_dim,
                        hash_buckets=hash_buckets,
                        activation_recomputation=bool(
                            activation_recomputation))
  return registry.call_with_accepted(
      builder, {"spec": spec, "config": config,
                "embedding_dim": embedding_dim, "hash_buckets": hash_buckets,
                "sync_batch_norm": bool(sync_batch_norm),
                "activation_recomputation": bool(activation_recomputation)},
      what=f"--model={name}")
