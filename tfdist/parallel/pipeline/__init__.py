"""tfdist.parallel.pipeline: pipeline parallelism (GPipe, 1F1B, interleaved).

Modules:
  stages   the library: cuts a Keras functional or Sequential model into
           stages on consecutive devices (`split_model`) and trains it
           with micro-batches (`Pipeline.train_step`), equal to the unsplit
           model's step.
  options  `--pipeline_stages`, `--num_microbatches`, `--pipeline_schedule`,
           `--pipeline_virtual_stages` and `--pipeline_cuts`, checked at
           start (no TensorFlow).
  copies   D copies of the pipeline on a data x pipeline (x tensor) mesh,
           each stage's gradients all-reduced over its data group.
  tensor   tensor parallelism inside the stages: a Keras LayoutMap's
           split Dense layers placed over each stage's T devices.
  mode     the `pipeline` step mode (`PipelineStep`,
           `tfdist.parallel.mode.StepMode`) and its `build`.

`from tfdist.parallel import pipeline` then `pipeline.split_model(...)`:
the names of `stages` are read here on first use (the package imports no
TensorFlow until then, so `options` stays light).
"""


def __getattr__(name):
  from tfdist import parallel  # pylint: disable=g-import-not-at-top
  return parallel.attribute_of(__name__, "stages", name)
