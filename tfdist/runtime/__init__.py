"""tfdist.runtime: the process around a run: start-up checks,
failure translation, the allocator, preemption and watchdog side processes,
TensorFlow's log level, binaries' usage.

Modules:
  allocator
  cli
  failures
  preemption
  preflight
  quiet_tensorflow
  strict_json
  watchdog

Nothing is imported here: import the module you use
(`from tfdist.runtime import allocator`).
"""
