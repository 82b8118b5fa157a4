"""tfdist.distribute: the cluster and its strategy: cluster resolution,
strategies, devices, TPU, parameter servers and their embedding layer, the
chief's done marker, start-up rendezvous, the model_dir lease, worker exits.
The strategy kinds live on the bottom floor (`tfdist.core.strategy_kind`;
`strategy_kind` here is its old name, the same module object).

Modules:
  auto_select
  cluster
  devices
  done_marker
  environment
  lease
  parameter_server
  rendezvous
  sharded_embedding
  strategy
  strategy_kind
  tpu
  worker_exit

Nothing is imported here: import the module you use
(`from tfdist.distribute import auto_select`).
"""
