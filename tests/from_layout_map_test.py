"""Unit tests of tfdist.parallel.tensor.from_layout_map's refusals and of
the config checks that let `tfdist.fit(layout_map=...)` through (no
training, no devices: Keras's DeviceMesh under TensorFlow is data).

The split models themselves train in tests/tensor_parallel_test.py (its
`LayoutMapTest`: a user's MLP at T = 2 and D x T = 2 x 2 against one
device, and an attention model at T = 2).
"""

import os

from absl.testing import absltest
import keras
import numpy as np

from tfdist import config as config_lib
from tfdist import errors
import tfdist
from tfdist.parallel.tensor import from_layout_map
from tfdist.parallel.tensor import options as tensor_options


def _map(degree=2, axis_names=("batch", "model"), **entries):
  mesh = keras.distribution.DeviceMesh(
      shape=(1, degree), axis_names=list(axis_names),
      devices=[f"cpu:{i}" for i in range(degree)])
  layout_map = keras.distribution.LayoutMap(mesh)
  for key, axes in entries.items():
    layout_map[key] = axes
  return layout_map


def _mlp_map(degree=2):
  layout_map = _map(degree)
  layout_map["up/kernel"] = (None, "model")
  layout_map["down/kernel"] = ("model", None)
  return layout_map


def _mlp(**up):
  inputs = keras.Input((8,))
  up = {"activation": "relu", **up}
  x = keras.layers.Dense(32, name="up", **up)(inputs)
  outputs = keras.layers.Dense(4, name="down")(x)
  return keras.Model(inputs, outputs)


_HEADS = (("mha/(query|key|value)/kernel", (None, "model", None)),
          ("mha/(query|key|value)/bias", ("model", None)),
          ("mha/attention_output/kernel", ("model", None, None)))


def _attention_map():
  layout_map = _map()
  for key, axes in _HEADS:
    layout_map[key] = axes
  return layout_map


def _attention(call=None, **options):
  inputs = keras.Input((5, 8))
  layer = keras.layers.MultiHeadAttention(4, 2, name="mha", **options)
  x = (call or (lambda l, x: l(x, x)))(layer, inputs)
  return keras.Model(inputs, x)


class _Subclassed(keras.Model):

  def __init__(self):
    super().__init__()
    self.up = keras.layers.Dense(32, name="up")
    self.down = keras.layers.Dense(4, name="down")

  def call(self, x):
    return self.down(self.up(x))


class _MyDense(keras.layers.Dense):
  pass


class RefusalTest(absltest.TestCase):
  """Each refusal names the layer, the map entry and what is supported."""

  def assert_refused(self, model, layout_map, *patterns):
    with self.assertRaises(errors.ConfigError) as caught:
      from_layout_map.check(model, layout_map)
    for pattern in patterns:
      self.assertRegex(str(caught.exception), pattern)
    return str(caught.exception)

  def test_the_mlp_plan_passes(self):
    plan = from_layout_map.check(_mlp(), _mlp_map())
    self.assertEqual(plan.layers, {"up": "column", "down": "row"})

  def test_a_subclassed_model_is_refused(self):
    model = _Subclassed()
    model(np.zeros((1, 8), np.float32))
    self.assert_refused(model, _mlp_map(), r"subclassed keras\.Model "
                        r"\(class _Subclassed\)", "clone_model",
                        r"keras\.Model\(inputs, outputs\) or "
                        r"keras\.Sequential")

  def test_an_embedding_split_is_refused(self):
    for axes, how in (((("model", None)), "by vocabulary"),
                      (((None, "model")), "by columns")):
      with self.subTest(how=how):
        inputs = keras.Input((5,), dtype="int32")
        x = keras.layers.Embedding(10, 8, name="emb")(inputs)
        x = keras.layers.Dense(4, name="down")(x)
        layout_map = _map(**{"emb/embeddings": axes})
        if how == "by columns":
          layout_map["down/kernel"] = ("model", None)
        self.assert_refused(keras.Model(inputs, x), layout_map,
                            r"entry 'emb/embeddings' splits Embedding 'emb' "
                            + how, "no tensor-parallel Embedding",
                            "Dense split by columns",
                            "Leave 'emb' replicated")

  def test_an_einsum_dense_split_is_refused(self):
    inputs = keras.Input((8,))
    x = keras.layers.EinsumDense("ab,bc->ac", output_shape=16,
                                 name="up")(inputs)
    x = keras.layers.Dense(4, name="down")(x)
    layout_map = _mlp_map()
    self.assert_refused(keras.Model(inputs, x), layout_map,
                        r"'up/kernel' splits EinsumDense 'up' by columns",
                        "no tensor-parallel EinsumDense")

  def test_a_dense_with_a_regularizer_or_a_subclass_is_refused(self):
    self.assert_refused(_mlp(kernel_regularizer="l2"), _mlp_map(),
                        r"entry 'up/kernel' splits Dense 'up' by columns",
                        "kernel_regularizer", "leave it replicated")
    # A softmax over a column layer's units would see 1/T of them.
    self.assert_refused(_mlp(activation="softmax"), _mlp_map(),
                        r"activation='softmax' \(not elementwise")
    inputs = keras.Input((8,))
    x = _MyDense(32, name="up")(inputs)
    x = keras.layers.Dense(4, name="down")(x)
    # (read_layout_map's refusal: the rules go by the layer's class.)
    self.assert_refused(keras.Model(inputs, x), _mlp_map(),
                        "'up/kernel' of a _MyDense layer",
                        "no tensor-parallel rule for _MyDense")

  def test_attention_with_arguments_the_split_layer_lacks_is_refused(self):
    plan = from_layout_map.check(_attention(), _attention_map())
    self.assertEqual(plan.layers, {"mha": "heads"})
    self.assert_refused(_attention(kernel_regularizer="l2"),
                        _attention_map(),
                        "splits MultiHeadAttention 'mha' by heads",
                        "kernel_regularizer",
                        "ParallelMultiHeadAttention does not take")

  def test_attention_called_with_masks_is_refused_at_the_split(self):
    model = _attention(lambda l, x: l(x, x, return_attention_scores=True)[0])
    with self.assertRaisesRegex(
        errors.ConfigError,
        r"MultiHeadAttention 'mha' is split by heads, and the model calls "
        r"it with return_attention_scores.*attention_mask"):
      from_layout_map.split_model(model, _attention_map(), 2)

  def test_a_nested_model_with_a_split_weight_is_refused(self):
    inner = keras.Sequential([keras.Input((8,)),
                              keras.layers.Dense(32, name="up")],
                             name="inner")
    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(4, name="down")(inner(inputs))
    model = keras.Model(inputs, outputs)
    layout_map = _map()
    layout_map[inner.weights[0].path] = (None, "model")
    self.assert_refused(model, layout_map, "nested model 'inner'")

  def test_the_degree_must_match_the_run(self):
    with self.assertRaisesRegex(errors.ConfigError,
                                r"'model' axis has size 2; the run splits "
                                r"its model 4 ways"):
      from_layout_map.split_model(_mlp(), _mlp_map(), 4)


class DropoutTest(absltest.TestCase):

  def test_a_dropout_inside_a_pair_is_named(self):
    inputs = keras.Input((8,))
    x = keras.layers.Dense(32, activation="relu", name="up")(inputs)
    x = keras.layers.Dropout(0.1, name="inside")(x)
    x = keras.layers.Dense(4, name="down")(x)
    x = keras.layers.Dropout(0.1, name="after")(x)
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(x))
    plan = from_layout_map.check(model, _mlp_map())
    self.assertEqual(from_layout_map.dropouts_inside_pairs(model, plan),
                     ["inside"])
    self.assertEqual(from_layout_map.dropouts_inside_pairs(
        _mlp(), from_layout_map.check(_mlp(), _mlp_map())), [])


class ConfigTest(absltest.TestCase):

  def test_config_changes_set_t_and_record_the_entries(self):
    config = config_lib.TrainConfig(model_dir="/tmp/x")
    changes = from_layout_map.config_changes(config, _mlp_map())
    self.assertEqual(changes, {
        "tensor_parallel": 2,
        "layout_map_entries": (("up/kernel", "(None, 'model')"),
                       ("down/kernel", "('model', None)"))})
    # The model unset ("cnn") or a model of the user's: let through.
    for model in (None, "mymodule:build_mlp"):
      with self.subTest(model=model):
        split = config.replace(**changes, **({"model": model} if model
                                             else {}))
        self.assertEqual(split.tensor_parallel, 2)
        self.assertEqual(split.layout_map_entries,
                         changes["layout_map_entries"])
        # Recorded in the manifest's config (JSON).
        self.assertEqual(split.to_dict()["layout_map_entries"],
                         [list(kv) for kv in changes["layout_map_entries"]])
    # A map of one 'model' device splits nothing.
    self.assertEqual(from_layout_map.config_changes(config, _mlp_map(1)),
                     {})

  def test_a_t_that_disagrees_with_the_map_is_refused(self):
    config = config_lib.TrainConfig(model_dir="/tmp/x", model="transformer",
                                    tensor_parallel=4)
    with self.assertRaisesRegex(
        errors.ConfigError,
        r"tensor_parallel=4 and the layout map's 'model' axis of size 2 "
        r"disagree"):
      from_layout_map.config_changes(config, _mlp_map())

  def test_not_a_layout_map_or_no_model_axis_is_refused(self):
    config = config_lib.TrainConfig(model_dir="/tmp/x")
    with self.assertRaisesRegex(errors.ConfigError,
                                "must be a keras.distribution.LayoutMap; "
                                "received dict"):
      from_layout_map.config_changes(config, {"up/kernel": (None, "model")})
    with self.assertRaisesRegex(errors.ConfigError, "an axis named 'model'"):
      from_layout_map.config_changes(config, _map(axis_names=("batch", "x")))

  def test_without_a_map_other_models_keep_their_refusal(self):
    for model in ("cnn", "mymodule:build_mlp"):
      with self.subTest(model=model):
        with self.assertRaisesRegex(errors.ConfigError,
                                    f"--model={model} has no tensor-parallel "
                                    "layers.*layout_map="):
          config_lib.TrainConfig(model_dir="/tmp/x", model=model,
                                 tensor_parallel=2)

  def test_with_a_map_the_transformer_sizes_are_not_checked(self):
    settings = dict(model="mymodule:build_mlp", distribution_strategy="auto",
                    zero_stage=0, pipeline_stages=1, enable_xla=False,
                    dtype="fp32", clipnorm=None, global_clipnorm=None,
                    init_checkpoint=None, num_gpus=0, num_cpu_devices=3)
    tensor_options.check_flags(tensor_parallel=3, layout_map=True,
                               **settings)
    with self.assertRaisesRegex(errors.ConfigError,
                                "cannot split the built-in Transformer"):
      tensor_options.check_flags(tensor_parallel=3, **{**settings,
                                                       "model": "transformer"})

  def test_fit_refuses_a_disagreeing_map_before_building(self):
    config = config_lib.TrainConfig(
        model_dir=os.path.join(absltest.get_default_test_tmpdir(), "fit"),
        model="transformer", tensor_parallel=4, train_steps=1)
    with self.assertRaisesRegex(errors.ConfigError,
                                "tensor_parallel=4 and the layout map"):
      tfdist.fit(_mlp, x=np.zeros((8, 8), np.float32),
                 y=np.zeros((8, 4), np.float32), config=config,
                 layout_map=_mlp_map(), verbose=0)
    # A ModelParallel is read as its layout map (the same refusal, not
    # "must be a keras.distribution.LayoutMap").
    with self.assertRaisesRegex(errors.ConfigError,
                                "tensor_parallel=4 and the layout map"):
      tfdist.fit(_mlp, x=np.zeros((8, 8), np.float32),
                 y=np.zeros((8, 4), np.float32), config=config,
                 layout_map=_model_parallel(), verbose=0)


# What `--layout_map` may name (tests.from_layout_map_test:NAME): functions
# of this module, and refusals' cases.
_FLAG = "tests.from_layout_map_test:"
_NOT_A_FUNCTION = 3


def _needs_degree(degree):
  return _mlp_map(degree)


def _returns_a_model():
  return _mlp()


def _no_model_axis():
  return _map(axis_names=("batch", "x"))


def _model_parallel():
  return keras.distribution.ModelParallel(layout_map=_mlp_map(),
                                          batch_dim_name="batch")


def _one_model_device():
  return _mlp_map(1)


def _flag_config(function="_mlp_map", **changes):
  return config_lib.TrainConfig(
      model_dir=os.path.join(absltest.get_default_test_tmpdir(), "flag"),
      model=_FLAG + "_mlp", layout_map=_FLAG + function, train_steps=1,
      **changes)


class LayoutMapFlagTest(absltest.TestCase):
  """`--layout_map=package.module:function` (`tfdist.training.task`):
  resolved where the task is built from names, it gives the task the map
  and the config T and the entries as `tfdist.fit(layout_map=...)` does;
  each refusal names the flag, the value and the fix, before anything is
  built. (A trainer run with the flag trains: tests/pipeline_test.py,
  `TrainerTest`.)"""

  def test_the_flag_gives_what_fits_keyword_gives(self):
    from tfdist.cloud import job_plan  # pylint: disable=g-import-not-at-top
    from tfdist.training import task as task_lib  # pylint: disable=g-import-not-at-top
    config = job_plan.parse_train_flags(
        ["--model_dir=/tmp/x", f"--model={_FLAG}_mlp",
         f"--layout_map={_FLAG}_mlp_map"], where="the test")
    self.assertEqual(config.layout_map, _FLAG + "_mlp_map")
    fit_changes = from_layout_map.config_changes(config, _mlp_map())
    for function in ("_mlp_map", "_model_parallel"):
      with self.subTest(function=function):
        given = config.replace(layout_map=_FLAG + function)
        split, task = task_lib.split_by_layout_map(
            given, task_lib.from_names(given.task))
        self.assertIsInstance(task.layout_map, keras.distribution.LayoutMap)
        self.assertEqual(split.tensor_parallel, 2)
        self.assertEqual(split.layout_map_entries,
                         fit_changes["layout_map_entries"])
        self.assertEqual(split.to_dict()["layout_map"], _FLAG + function)
    # A map of one 'model' device splits nothing: the task keeps no map.
    given = _flag_config("_one_model_device")
    split, task = task_lib.split_by_layout_map(
        given, task_lib.from_names(given.task))
    self.assertIsNone(task.layout_map)
    self.assertEqual((split.tensor_parallel, split.layout_map_entries),
                     (1, ()))

  def test_bad_values_are_refused_naming_the_flag(self):
    from tfdist.training import task as task_lib  # pylint: disable=g-import-not-at-top
    cases = (
        ("no_such_module_xyz:layout_map",
         r"--layout_map=no_such_module_xyz:layout_map: cannot import "
         r"no_such_module_xyz .*PYTHONPATH"),
        (_FLAG + "_no_such_function",
         r"--layout_map='tests.from_layout_map_test:_no_such_function': "
         r"module tests.from_layout_map_test has no attribute"),
        (_FLAG + "_NOT_A_FUNCTION",
         r"--layout_map=tests.from_layout_map_test:_NOT_A_FUNCTION: int 3 "
         r"is not a function\. Name a function of no arguments"),
        (_FLAG + "_needs_degree",
         r"--layout_map=tests.from_layout_map_test:_needs_degree: "
         r"_needs_degree\(degree\) has required parameter\(s\) degree; "
         r"tfdist calls it with none\. Give them defaults"),
        (_FLAG + "_returns_a_model",
         r"--layout_map=tests.from_layout_map_test:_returns_a_model: the "
         r"function returned Functional, not a keras.distribution.LayoutMap "
         r"\(or ModelParallel\)\. Return keras.distribution.LayoutMap"),
        (_FLAG + "_no_model_axis",
         r"--layout_map=tests.from_layout_map_test:_no_model_axis: The "
         r"layout map's DeviceMesh has axes \['batch', 'x'\].*axis_names="
         r"\['batch', 'model'\]"),
    )
    for path, message in cases:
      with self.subTest(path=path):
        with self.assertRaisesRegex(errors.ConfigError, message):
          task_lib.load_layout_map(path)

  def test_a_tensor_parallel_the_map_contradicts_is_refused(self):
    from tfdist.training import task as task_lib  # pylint: disable=g-import-not-at-top
    config = _flag_config(tensor_parallel=4)
    with self.assertRaisesRegex(
        errors.ConfigError,
        r"^--layout_map=tests.from_layout_map_test:_mlp_map: "
        r"--tensor_parallel=4 and the layout map's 'model' axis of size 2 "
        r"disagree: .*Drop --tensor_parallel \(or set it to 2\)"):
      task_lib.split_by_layout_map(config, task_lib.from_names(config.task))

  def test_fit_refuses_the_flag_beside_its_keyword(self):
    with self.assertRaisesRegex(
        errors.ConfigError,
        r"^layout_map=tests.from_layout_map_test:_mlp_map and tfdist.fit"
        r"\(\.\.\., layout_map=\.\.\.\) both give a layout map\. Pass "
        "one"):
      tfdist.fit(_mlp, x=np.zeros((8, 8), np.float32),
                 y=np.zeros((8, 4), np.float32), config=_flag_config(),
                 layout_map=_mlp_map(), verbose=0)
    # fit reads the config's own flag as its keyword: a disagreeing T is
    # refused naming it (a T it agrees with trains: tests/pipeline_test.py).
    with self.assertRaisesRegex(
        errors.ConfigError,
        r"^layout_map=tests.from_layout_map_test:_mlp_map: "
        r"tensor_parallel=4 and the layout map's 'model' axis"):
      tfdist.fit(_mlp, x=np.zeros((8, 8), np.float32),
                 y=np.zeros((8, 4), np.float32), verbose=0,
                 config=_flag_config(tensor_parallel=4))


if __name__ == "__main__":
  absltest.main()
