"""tfdist.parallel.experts: mixture-of-experts layers.

Modules:
  layer  `MixtureOfExperts`, a Keras 3 layer: a learned router sends each
         token to its top-1 or top-2 of E feed-forward experts, within a
         capacity, with the Switch load-balancing loss and the ST-MoE router
         z-loss; dispatch and combine are dense tensors (GShard), so that
         the experts' [E, capacity, d_model] inputs are what an all-to-all
         would exchange under expert parallelism (not written yet).

Nothing is imported here: import the module you use
(`from tfdist.parallel.experts import layer`), or use
`tfdist.MixtureOfExperts`.
"""
