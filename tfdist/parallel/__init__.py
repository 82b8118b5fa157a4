"""tfdist.parallel: model parallelism beside the trainer (layers and
schedules that split one model over the replicas of a strategy)."""
