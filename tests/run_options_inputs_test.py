"""Unit tests of tfdist.training.run_options' inputs-and-data converters."""

from tfdist.config import TrainConfig
from tfdist.data import fashion_mnist
from tfdist.data.dataset_spec import DatasetSpec
from tfdist.training import run_options


def _input_fn(training):
  del training


def test_training_options_carry_the_configs_reading_order():
  config = TrainConfig(shuffle_buffer_size=64, cache_dataset=False, seed=7)
  options = run_options.train_input_options(
      config, fashion_mnist.SPEC, files=("a", "b"), global_batch_size=32,
      file_record_counts=(3, 4), gradient_accumulation_steps=2)
  assert (options.files, options.parse_fn) == (
      ("a", "b"), fashion_mnist.parse_image_example)
  assert (options.global_batch_size, options.is_training,
          options.shuffle_buffer_size, options.cache, options.seed,
          options.file_record_counts, options.gradient_accumulation_steps,
          options.deterministic) == (32, True, 64, False, 7, (3, 4), 2, False)
  resumable = run_options.train_input_options(
      config, fashion_mnist.SPEC, files=("a",), global_batch_size=32,
      resumable=True)
  assert resumable.deterministic


def test_parameter_server_workers_read_unseeded():
  options = run_options.parameter_server_input_options(
      TrainConfig(seed=7), fashion_mnist.SPEC, files=("a",),
      global_batch_size=8)
  assert options.seed is None and options.is_training


def test_evaluation_reads_once_and_a_dataset_function_takes_no_files():
  spec = DatasetSpec(name="fn", input_fn=_input_fn)
  options = run_options.eval_input_options(
      TrainConfig(), spec, files=("ignored",), global_batch_size=16,
      pad_to_static_batches=True)
  assert (options.files, options.input_fn, options.is_training,
          options.pad_to_static_batches) == ((), _input_fn, False, True)
