"""tfdist.parallel: the parallelism modes the trainer is given.

Modules and packages:
  mode      the `StepMode` protocol every mode implements (one replica's
            forward and backward pass, evaluation sums, the checkpoint and
            export views, its rows of the memory plan) and the registry
            (`register_mode`, `get_mode`, `mode_name_for`).
  cutting   a Keras model read as a list of layer calls and cut into
            consecutive pieces (shared by `pipeline` and `zero3`).
  data      the `data` mode: data parallelism, ZeRO stages 0-2
            (`data.sharded_optimizer`).
  zero3     the `zero3` mode: ZeRO stage 3, the weights sharded too.
  pipeline  the `pipeline` mode: a Keras functional or Sequential model cut
            into stages on consecutive devices, trained with micro-batches
            (GPipe or 1F1B schedules); `pipeline.split_model` and the rest
            of `pipeline.stages` as a library.
  tensor    the `tensor` mode: Megatron-style column- and row-parallel Dense
            layers and a parallel multi-head attention, each replica
            holding 1/N of their weights (`tensor.layers`, also importable
            as the documented `tfdist.parallel.tensor_parallel`).
  collectives  all-reduce, all-gather, reduce-scatter and all-to-all
            over a named sub-group of devices (raw collective ops,
            per-device ordering tokens, own key range, gradients).
  mesh      the data x pipeline x tensor device mesh: each
            device's coordinates and the groups along each axis.
  layout_map  a Keras LayoutMap (or ModelParallel) read as each
            variable's tensor-parallel split and the Megatron pairs.

Nothing is imported here: import the module you use
(`from tfdist.parallel import mode`).
"""

import importlib
import importlib.util


def attribute_of(package: str, module: str, name: str):
  """`package.module.name`, for a package's PEP 562 `__getattr__` that reads
  one module's names on first use (`tfdist.parallel.pipeline.split_model`).

  A name that is a submodule of `package` (or a dunder) raises
  AttributeError without importing `module`: `from package import
  options` first asks the package for the attribute, and answering it by
  importing `module` (TensorFlow, Keras) made every light options module
  cost a TensorFlow start-up (`tfdist.config` imports them).

  The value is then set on the package, so later reads of `name` do not
  come here again.

  Raises:
    AttributeError: `name` is a submodule, a dunder, or not in `module`.
  """
  if name.startswith("__") or importlib.util.find_spec(
      f"{package}.{name}") is not None:
    raise AttributeError(f"module {package!r} has no attribute {name!r}")
  value = getattr(importlib.import_module(f"{package}.{module}"), name)
  setattr(importlib.import_module(package), name, value)
  return value
