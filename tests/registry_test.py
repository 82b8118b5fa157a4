"""Unit tests of tfdist.core.registry: names, import paths, accepted arguments."""

import pytest

from tfdist import errors
from tfdist.core.dataset_spec import DatasetSpec
from tfdist.core import registry


@pytest.fixture(autouse=True)
def _restore_registries():
  models, datasets = dict(registry._MODELS), dict(registry._DATASETS)
  yield
  registry._MODELS.clear()
  registry._MODELS.update(models)
  registry._DATASETS.clear()
  registry._DATASETS.update(datasets)


def _toy_input_fn(training):
  del training


def test_register_a_model_by_its_function_name():
  @registry.register_model
  def toy_builder(spec):
    return spec

  assert "toy_builder" in registry.model_names()
  assert registry.get_model_builder("toy_builder") == ("toy_builder",
                                                       toy_builder)


def _build_one():
  return 1


def _build_two():
  return 2


def test_a_taken_name_is_refused_and_colons_are_import_paths():
  registry.register_model("toy")(_build_one)
  registry.register_model("toy")(_build_one)  # the same builder again: fine
  with pytest.raises(ValueError, match="already registered"):
    registry.register_model("toy")(_build_two)
  with pytest.raises(ValueError, match="':' marks an import path"):
    registry.register_model("a:b")(lambda: None)


def test_register_a_dataset_function_with_spec_fields():
  registry.register_dataset("toy_data", task="binary")(_toy_input_fn)
  spec = registry.get_dataset("toy_data")
  assert spec.input_fn is _toy_input_fn and spec.task == "binary"
  assert not spec.reads_files


def test_unknown_names_list_the_registered_ones():
  registry.register_model("toy")(lambda: None)
  with pytest.raises(errors.ConfigError, match=r"--model='nope' is unknown\. "
                     r"Registered: .*toy"):
    registry.get_model_builder("nope")
  with pytest.raises(errors.ConfigError, match="--dataset='nope' is unknown"):
    registry.get_dataset("nope")


def test_import_paths_load_module_attributes():
  assert registry.is_import_path("os.path:join")
  assert registry.load_object("os.path:join", flag="--model") is (
      __import__("os").path.join)
  name, builder = registry.get_model_builder("os.path:join")
  assert name == "os.path:join" and callable(builder)
  with pytest.raises(errors.ConfigError, match="has no attribute 'nope'"):
    registry.load_object("os.path:nope", flag="--model")
  with pytest.raises(
      errors.ConfigError, match="cannot import no_such_module_x"):
    registry.load_object("no_such_module_x:f", flag="--model")
  with pytest.raises(errors.ConfigError, match="is not an import path"):
    registry.load_object(":f", flag="--model")


def test_as_dataset_spec_renames_a_spec_and_wraps_a_function():
  spec = DatasetSpec(name="a", parse_fn=lambda s: s)
  assert registry.as_dataset_spec(spec) is spec
  assert registry.as_dataset_spec(spec, name="b").name == "b"
  wrapped = registry.as_dataset_spec(_toy_input_fn)
  assert wrapped.name == "_toy_input_fn"
  with pytest.raises(TypeError, match="DatasetSpec or a dataset function"):
    registry.as_dataset_spec(3)


def test_call_with_accepted_passes_only_the_named_arguments():
  available = {"spec": "S", "config": "C", "extra": "E"}
  assert registry.call_with_accepted(lambda spec: spec, available,
                                     what="f") == "S"
  assert registry.call_with_accepted(lambda: "none", available,
                                     what="f") == "none"
  assert registry.call_with_accepted(lambda **kw: sorted(kw), available,
                                     what="f") == ["config", "extra", "spec"]
  assert registry.accepts(lambda config=None: 0, "config")
  assert not registry.accepts(lambda spec: 0, "config")
  with pytest.raises(
      errors.ConfigError, match=r"required parameter\(s\) missing"):
    registry.call_with_accepted(lambda spec, missing: 0, available,
                                what="--model=f")


def test_the_old_paths_are_the_same_modules():
  # User code registers through tfdist.training.registry and builds
  # tfdist.data.dataset_spec.DatasetSpec (the modules moved to tfdist.core).
  from tfdist.data import dataset_spec as old_spec  # pylint: disable=g-import-not-at-top
  from tfdist.training import registry as old_registry  # pylint: disable=g-import-not-at-top
  assert old_registry is registry
  assert old_spec.DatasetSpec is DatasetSpec

  @old_registry.register_model("registered_through_the_old_path")
  def _build():
    return None

  assert registry.get_model_builder("registered_through_the_old_path") == (
      "registered_through_the_old_path", _build)
