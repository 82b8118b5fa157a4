"""Device set-up that must happen before TensorFlow's runtime starts."""

from typing import List

import tensorflow as tf


def configure_cpu_devices(num_cpu_devices: int) -> List[str]:
  """Splits the host CPU into `num_cpu_devices` logical devices.

  This lets `MirroredStrategy` run several replicas on a CPU-only machine
  (`--num_cpu_devices=2`). It must run before any op executes; afterwards
  TensorFlow refuses to change the device configuration.

  Args:
    num_cpu_devices: 0 or 1 leaves the CPU whole; N > 1 makes N devices.

  Returns:
    The logical CPU device names.

  Raises:
    RuntimeError: TensorFlow's runtime already started with another split.
  """
  cpus = tf.config.list_physical_devices("CPU")
  if num_cpu_devices > 1:
    try:
      tf.config.set_logical_device_configuration(
          cpus[0], [tf.config.LogicalDeviceConfiguration()] * num_cpu_devices)
    except RuntimeError as e:
      current = len(tf.config.list_logical_devices("CPU"))
      if current != num_cpu_devices:
        raise RuntimeError(
            f"--num_cpu_devices={num_cpu_devices} could not be applied: "
            f"TensorFlow already started with {current} CPU device(s). "
            "Configure devices before running any TensorFlow op.") from e
  return [d.name for d in tf.config.list_logical_devices("CPU")]


def describe_devices() -> List[dict]:
  """Logical devices of this process as dicts: name, device_type, details."""
  out = []
  for device in tf.config.list_logical_devices():
    entry = {"name": device.name, "device_type": device.device_type}
    out.append(entry)
  for gpu in tf.config.list_physical_devices("GPU"):
    try:
      details = tf.config.experimental.get_device_details(gpu)
    except (ValueError, RuntimeError):
      details = {}
    out.append({"name": gpu.name, "device_type": "GPU (physical)",
                "details": {k: str(v) for k, v in details.items()}})
  return out
