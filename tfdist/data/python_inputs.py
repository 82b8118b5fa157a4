"""`keras.utils.PyDataset` (`Sequence`), Python generators and iterators as
`tfdist.fit`'s `x` and `validation_data`, as `keras.Model.fit` takes them.

Each yields batches `(x, y)` or `(x, y, sample_weight)` (NumPy arrays or
tensors, `x` possibly a list or dict of them). tfdist trains on examples and
batches them itself (`--batch_size`, global), so the batches are split into
examples:

* a `PyDataset` is read by index, `data[0]` to `data[num_batches - 1]`, in
  a `tf.data.Dataset.from_generator` pipeline; tfdist reads it once at
  start to count its examples, then as its cache allows: with
  `cache_dataset` (the default) one more pass fills the in-memory cache and
  every epoch reshuffles that; without it every epoch reads it again. Its
  `on_epoch_end()` is called after each whole pass. Every epoch trains on
  each of its examples once (less the `N mod batch` remainder, as with
  arrays), and a resumed run continues its epoch at the same example,
  provided `data[i]` returns the same examples on every read (its order
  within a pass is tfdist's seeded shuffle, not the index order). An
  endless `PyDataset` (`num_batches` None) is refused.
* a generator or iterator cannot be rewound: it is read to its end once, at
  start, into arrays (at most `MAX_GENERATOR_BYTES`; an endless one is
  refused once it passes that), which then train as `fit(x=arrays, ...)`
  does: every example once an epoch, and resumed at the same example.
  A rerun of the script makes a new generator: the resumed run continues
  from the position of the checkpoint's step in what that one yields, and
  says so once (`GENERATOR_RESUME_NOTE`).

Both are read by the Python process itself, so they serve one device and
`MirroredStrategy` (one host); with several workers or parameter servers a
dataset function is needed (each worker calls it for its own share), and
`check_one_host` refuses them at start, showing that form.
"""

import collections.abc
import types
from typing import Any, Callable, Optional, Tuple

import keras
import numpy as np
import tensorflow as tf

from tfdist import errors

# The most a generator may yield (its arrays' bytes) before it is refused
# as endless: it is held in memory whole.
MAX_GENERATOR_BYTES = 2 << 30

# Said once when a run fed by a generator resumes mid-epoch
# (`tfdist.data.input_position.InputPosition.resume_step` fills it in).
GENERATOR_RESUME_NOTE = (
    "x is a generator (or iterator), which cannot be restored: resumed "
    "epoch {epoch} continues after its first {steps} steps' examples of "
    "what this run's generator yielded, the interrupted run's examples only "
    "if it yields the same batches in the same order (a "
    "keras.utils.PyDataset or a dataset function is read by tfdist and "
    "replayed from the checkpoint's position).")

# The strategies that run in this one process (its Python inputs can feed).
_ONE_HOST_STRATEGIES = ("auto", "off", "one_device", "mirrored")

_DATASET_FUNCTION_FORM = (
    "Pass a dataset function instead, which every worker calls for its "
    "share: def make_dataset(training): return tf.data.Dataset."
    "from_tensor_slices((x, y))  (one epoch of unbatched examples; or a "
    "tf.data pipeline over files), then tfdist.fit(build_model, "
    "make_dataset, config=...).")


def is_python_input(value: Any) -> bool:
  """True for a `keras.utils.PyDataset` (or `Sequence`), a generator or
  another iterator (not arrays, tensors or a `tf.data.Dataset`)."""
  if isinstance(value, keras.utils.PyDataset):
    return True
  if isinstance(value, (tf.data.Dataset, tf.Tensor, np.ndarray)):
    return False
  return isinstance(value, (types.GeneratorType, collections.abc.Iterator))


def _kind(value: Any) -> str:
  if isinstance(value, keras.utils.PyDataset):
    return f"keras.utils.PyDataset ({type(value).__name__})"
  return ("a generator" if isinstance(value, types.GeneratorType)
          else f"an iterator ({type(value).__name__})")


def check_one_host(*, name: str, value: Any, distribution_strategy: str,
                   num_workers: int, num_ps: int):
  """Refuses a Python input where it cannot feed every worker.

  Args:
    name: the argument (`x`, `validation_data`), for the message.
    value: the input.
    distribution_strategy: `--distribution_strategy`.
    num_workers, num_ps: the resolved cluster's training workers and ps
      tasks (1 and 0 for a single process).

  Raises:
    ConfigError: several workers, parameter servers, a TPU, or a strategy
      that needs them (status 2).
  """
  if (distribution_strategy in _ONE_HOST_STRATEGIES and num_workers <= 1
      and not num_ps):
    return
  where = (f"--distribution_strategy={distribution_strategy}"
           if distribution_strategy not in _ONE_HOST_STRATEGIES else
           f"a cluster of {num_workers} worker(s) and {num_ps} ps task(s)")
  raise errors.ConfigError(
      f"tfdist.fit({name}=...) got {_kind(value)}, which only this Python "
      f"process can read; the run uses {where}, whose workers each need "
      "their own share of the examples (one device and "
      f"--distribution_strategy=mirrored take it). {_DATASET_FUNCTION_FORM}")


def _as_array(value, what: str) -> np.ndarray:
  array = np.asarray(value)
  if array.ndim == 0:
    raise errors.ConfigError(
        f"{what} holds a scalar ({value!r}): every array of a "
        "batch needs a leading dimension of one row per "
        "example.")
  return array


def _batch(value, what: str) -> tuple:
  """`(x, y)` or `(x, y, sample_weight)` of one yielded batch, as arrays
  with one leading dimension of examples each, the same for all."""
  if isinstance(value, list):
    value = tuple(value)
  if not isinstance(value, tuple) or len(value) not in (2, 3):
    got = (f"a tuple of {len(value)}" if isinstance(value, tuple)
           else type(value).__name__)
    raise errors.ConfigError(
        f"{what} is {got}; training needs batches (x, y) or (x, y, "
        "sample_weight), as keras.Model.fit takes them.")
  if any(part is None for part in value):
    raise errors.ConfigError(
        f"{what} holds None (as x, y or sample_weight): give "
        "arrays, or leave sample_weight out of the tuple.")
  arrays = tuple(tf.nest.map_structure(lambda a: _as_array(a, what), part)
                 for part in value)
  rows = {int(a.shape[0]) for a in tf.nest.flatten(arrays)}
  if len(rows) != 1:
    raise errors.ConfigError(
        f"{what}: its arrays have different numbers of rows "
        f"({sorted(rows)}); give one row per example in each.")
  return arrays


def _spec(array: np.ndarray) -> tf.TensorSpec:
  dtype = tf.string if array.dtype.kind in "USO" else tf.as_dtype(array.dtype)
  return tf.TensorSpec((None,) + array.shape[1:], dtype)


def py_dataset_function(data: keras.utils.PyDataset, *, name: str
                        ) -> Callable[[], tf.data.Dataset]:
  """A dataset function over `data`'s batches, split into examples.

  Args:
    data: a finite `keras.utils.PyDataset` (or `Sequence`).
    name: the argument it came as (`x`, `validation_data`), for messages.

  Returns:
    A function of no arguments returning one pass over `data` (`data[0]`
    .. `data[num_batches - 1]`, then `data.on_epoch_end()`) as a dataset of
    unbatched `(x, y)` or `(x, y, sample_weight)` examples; named after
    `data`'s class.

  Raises:
    ConfigError: `data` is endless or empty, or its first batch is not
      `(x, y)` or `(x, y, sample_weight)` arrays.
  """
  batches = data.num_batches
  kind = _kind(data)
  if batches is None:
    raise errors.ConfigError(
        f"tfdist.fit({name}=...) got an endless {kind} (num_batches is "
        "None): tfdist trains in epochs of a finite set of examples. Give "
        "__len__ the number of batches of one epoch; train longer with "
        "train_epochs or train_steps.")
  if not batches:
    raise errors.ConfigError(f"tfdist.fit({name}=...): {kind} has no batches "
                             "(len() is 0).")
  first = _batch(data[0], f"{kind}[0]")
  signature = tf.nest.map_structure(_spec, first)

  def generate():
    for index in range(batches):
      yield _batch(data[index], f"{kind}[{index}]")
    data.on_epoch_end()

  def examples():
    return tf.data.Dataset.from_generator(
        generate, output_signature=signature).unbatch()

  examples.__module__ = type(data).__module__
  examples.__qualname__ = examples.__name__ = type(data).__qualname__
  return examples


def generator_arrays(iterator, *, name: str,
                     max_bytes: int = MAX_GENERATOR_BYTES) -> tuple:
  """Reads a generator or iterator of batches to its end, into arrays.

  Args:
    iterator: yields `(x, y)` or `(x, y, sample_weight)` batches.
    name: the argument it came as, for messages.
    max_bytes: refuse it as endless past this many bytes of arrays.

  Returns:
    `(x, y)` or `(x, y, sample_weight)`: the batches concatenated.

  Raises:
    ConfigError: a batch of another form, no batch at all, or more than
      `max_bytes` (an endless generator).
  """
  kind = _kind(iterator)
  batches, size = [], 0
  for index, value in enumerate(iterator):
    batch = _batch(value, f"batch {index} of tfdist.fit({name}=...)'s {kind}")
    size += sum(a.nbytes for a in tf.nest.flatten(batch))
    if size > max_bytes:
      raise errors.ConfigError(
          f"tfdist.fit({name}=...)'s {kind} yielded more than "
          f"{max_bytes} bytes in {index + 1} batches: a generator cannot be "
          "rewound, so tfdist reads it to its end at start and keeps it in "
          "memory, and this one may be endless. Yield one epoch and train "
          "longer with train_epochs or train_steps, or give a "
          "keras.utils.PyDataset. " + _DATASET_FUNCTION_FORM)
    batches.append(batch)
  if not batches:
    raise errors.ConfigError(
        f"tfdist.fit({name}=...)'s {kind} yielded no batch "
        "(was it read already? a generator can be read once).")
  try:
    return tuple(tf.nest.map_structure(lambda *a: np.concatenate(a),
                                       *batches))
  except (ValueError, TypeError) as e:
    raise errors.ConfigError(
        f"tfdist.fit({name}=...)'s {kind} yielded batches of different "
        f"structures or shapes: {e}") from None


def resolve(*, x, y, sample_weight, validation_data, dataset_fn,
            validation_split: float) -> Tuple[Any, Any, Any, Any, Any]:
  """`fit`'s arguments with Python inputs replaced: a `PyDataset` by a
  dataset function, a generator by its arrays.

  Returns:
    `(x, y, sample_weight, dataset_fn, validation_data)`.

  Raises:
    ConfigError: `y` or `sample_weight` given beside a Python `x` (its
      batches hold them), `dataset_fn` beside it, `validation_split` with
      a `PyDataset`, or the errors of `py_dataset_function` and
      `generator_arrays`.
  """
  if is_python_input(x):
    if y is not None or sample_weight is not None:
      raise errors.ConfigError(
          f"tfdist.fit(x=...) got {_kind(x)} and also y or sample_weight: "
          "its batches hold them ((x, y) or (x, y, sample_weight)), as in "
          "keras.Model.fit; leave y and sample_weight out.")
    if dataset_fn is not None:
      raise errors.ConfigError(
          "Pass the examples once: x or dataset_fn, not both.")
    if isinstance(x, keras.utils.PyDataset):
      if validation_split:
        raise errors.ConfigError(
            f"validation_split={validation_split} is only for arrays and "
            "generators (as keras.Model.fit takes it); with a "
            "keras.utils.PyDataset pass validation_data.")
      dataset_fn, x = py_dataset_function(x, name="x"), None
    else:
      x, y, *rest = generator_arrays(x, name="x")
      sample_weight = rest[0] if rest else None
  if isinstance(validation_data, keras.utils.PyDataset):
    validation_data = py_dataset_function(validation_data,
                                          name="validation_data")
  elif is_python_input(validation_data):
    validation_data = generator_arrays(validation_data,
                                       name="validation_data")
  return x, y, sample_weight, dataset_fn, validation_data


def python_input_names(**values) -> Optional[Tuple[str, Any]]:
  """The first `(name, value)` of `values` that is a Python input, or None."""
  for name, value in values.items():
    if is_python_input(value):
      return name, value
  return None
