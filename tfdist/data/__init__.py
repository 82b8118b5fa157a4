"""tfdist.data: input: data sets, their specs, tf.data pipelines, file systems.

Modules:
  clothing_reviews
  conversion
  data_checks
  dataset_spec (old name of tfdist.core.dataset_spec)
  datasets
  fashion_mnist
  feature_spec
  filesystems
  input_pipeline
  input_position
  movielens

Nothing is imported here: import the module you use
(`from tfdist.data import clothing_reviews`).
"""
