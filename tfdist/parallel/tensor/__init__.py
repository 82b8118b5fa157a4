"""tfdist.parallel.tensor: tensor parallelism over one host's replicas.

Modules:
  layers   Megatron-style column- and row-parallel Dense layers and a
           parallel multi-head attention, each replica holding 1/N of
           their weights (also importable as the documented
           `tfdist.parallel.tensor_parallel`).
  groups   the replicas' data x tensor groups (`--tensor_parallel=T` on
           D x T replicas) and `split_over(T)`, the scope the layers are
           built in to split T ways.
  options  `--tensor_parallel=T`, checked at start (no TensorFlow).
  mode     the `tensor` step mode (`TensorParallelStep`,
           `tfdist.parallel.mode.StepMode`), its gathered view and `build`.
  from_layout_map
           a user's model split as a Keras `LayoutMap` says
           (`tfdist.fit(layout_map=...)`): the unsharded model cloned with
           the split layers made tensor-parallel, and the refusals.

The names of `layers` are read here on first use
(`from tfdist.parallel import tensor as tp; tp.ColumnParallelDense`).
"""


def __getattr__(name):
  from tfdist import parallel  # pylint: disable=g-import-not-at-top
  return parallel.attribute_of(__name__, "layers", name)
