"""tfdist.cloud: cloud engines' helpers: Vertex AI hyperparameter tuning,
Vertex AI and Kubeflow job specs, Ray Train's backend and workers.

Modules:
  hptune
  job_plan
  ray_backend
  ray_worker
  tfjob_spec
  vertex_spec

Nothing is imported here: import the module you use
(`from tfdist.cloud import hptune`).
"""
