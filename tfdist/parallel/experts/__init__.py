"""tfdist.parallel.experts: mixture-of-experts layers.

Modules:
  layer  `MixtureOfExperts`, a Keras 3 layer: a learned router sends each
         token to its top-1 or top-2 of E feed-forward experts, within a
         capacity, with the Switch load-balancing loss and the ST-MoE router
         z-loss; dispatch and combine are dense tensors (GShard); under
         expert parallelism the experts' [E, groups, capacity, d_model]
         inputs travel to their replicas by all-to-all.
  placement  where the experts live under `--expert_parallel` (expert
         groups, slots) and the scope that makes layers expert-parallel.
  options  `--expert_parallel=E_p`, checked at start (no TensorFlow).
  mode     the `experts` step mode (`ExpertParallelStep`,
           `tfdist.parallel.mode.StepMode`), its gathered view and `build`.

Nothing is imported here: import the module you use
(`from tfdist.parallel.experts import layer`), or use
`tfdist.MixtureOfExperts`.
"""
