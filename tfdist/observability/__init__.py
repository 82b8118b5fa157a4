"""tfdist.observability: what a run records about itself: the run log, the manifest, profiler
windows, throughput, versions.

Modules:
  manifest
  profiling
  run_log
  throughput
  versions

Nothing is imported here: import the module you use
(`from tfdist.observability import manifest`).
"""
