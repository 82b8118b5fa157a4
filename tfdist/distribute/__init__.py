"""tfdist.distribute: the cluster and its strategy: cluster resolution, the strategy kind,
strategies, devices, TPU, parameter servers, start-up rendezvous, the
model_dir lease, worker exits.

Modules:
  auto_select
  cluster
  devices
  environment
  lease
  parameter_server
  rendezvous
  strategy
  strategy_kind
  tpu
  worker_exit

Nothing is imported here: import the module you use
(`from tfdist.distribute import auto_select`).
"""
