"""Unit tests of tfdist.data.conversion: a data set converted once, whole."""

import json
import os

import pytest

from tfdist.data import conversion
from tfdist.core.dataset_spec import INFO_FILE


def _write_one_file(tmp_dir):
  with open(os.path.join(tmp_dir, "train-00000-of-00001"), "w") as f:
    f.write("records")
  return {"name": "toy", "splits": {"train": {"num_examples": 1}}}


def test_nothing_converted_yet(tmp_path):
  assert conversion.converted_info(str(tmp_path / "toy")) is None
  (tmp_path / "toy").mkdir()
  # A folder without dataset_info.json is not a finished conversion.
  assert conversion.converted_info(str(tmp_path / "toy")) is None


def test_publish_renames_the_whole_folder_into_place(tmp_path):
  out_dir = str(tmp_path / "toy")
  info = conversion.publish_conversion(out_dir, _write_one_file)
  assert info["name"] == "toy"
  assert sorted(os.listdir(out_dir)) == [INFO_FILE, "train-00000-of-00001"]
  with open(os.path.join(out_dir, INFO_FILE)) as f:
    assert json.load(f) == info
  assert conversion.converted_info(out_dir) == info
  # No temporary folder is left beside it.
  assert os.listdir(tmp_path) == ["toy"]


def test_a_process_that_loses_the_race_keeps_the_winners_copy(tmp_path):
  out_dir = str(tmp_path / "toy")
  first = conversion.publish_conversion(out_dir, _write_one_file)
  second = conversion.publish_conversion(
      out_dir, lambda tmp_dir: {**_write_one_file(tmp_dir), "late": True})
  assert second["late"]
  assert conversion.converted_info(out_dir) == first
  assert os.listdir(tmp_path) == ["toy"]


def test_a_failing_writer_publishes_nothing(tmp_path):
  out_dir = str(tmp_path / "toy")

  def fail(tmp_dir):
    del tmp_dir
    raise ValueError("bad source")

  with pytest.raises(ValueError, match="bad source"):
    conversion.publish_conversion(out_dir, fail)
  assert conversion.converted_info(out_dir) is None
