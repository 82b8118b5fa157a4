"""tfdist: TensorFlow distributed training with Keras 3 models.

The binary is `python -m tfdist.train`; the library entry point is
`tfdist.run_experiment(TrainConfig(...))`.
"""

__version__ = "0.1.0"

__all__ = ["__version__", "TrainConfig", "ConfigError", "run_experiment"]


def __getattr__(name):
  # Imported lazily so `import tfdist` stays cheap (no TensorFlow import).
  if name in ("TrainConfig", "ConfigError"):
    from tfdist import config  # pylint: disable=g-import-not-at-top
    return getattr(config, name)
  if name == "run_experiment":
    from tfdist import experiment  # pylint: disable=g-import-not-at-top
    return experiment.run_experiment
  raise AttributeError(f"module 'tfdist' has no attribute {name!r}")
