"""Sub-group collectives (tfdist/parallel/collectives.py) on 8 logical CPUs.

The cases need 8 logical CPU devices, which must exist before TensorFlow
starts: they run in one child process (this file run as a script, as
loss_semantics_test and batch_norm_test do), which prints one JSON line of
`{case: null | traceback}`; each case is one test here. The timeout case
runs last: after a timeout TensorFlow aborts the process's collectives.

* concurrent groups: {0,1} and {2,3} all-reduced, then {0,2} and {1,3}, in
  one `tf.function` (every device ends with the sum of all four); four
  pairs and two halves of 8 devices likewise;
* each collective's values against NumPy, in a function and eagerly, on
  groups given out of rank order;
* each collective's gradient against `tf.test.compute_gradient`'s numeric
  Jacobian (all-reduce sum and mean, all-gather, reduce-scatter,
  all-to-all), and Megatron's f and g against hand-derived gradients;
* the `replica_` functions: each replica of a MirroredStrategy makes its
  own device's op (a 2 x 2 mesh's groups, values and gradients), and
  their refusals outside a traced replica function;
* keys: groups beside a MirroredStrategy's all-reduce over the same
  devices, in one function, both right; group keys from 2**30, the same
  set the same key;
* the guide's example (docs/guides/device-mesh.md, block guide-example)
  prints what the guide says;
* a stalled device (its input waits 3 s, the limit is 0.5 s) raises
  `CollectiveTimeoutError` (status 200) through `timeouts_as_errors`.

Argument refusals (no devices needed) run in this process.
"""

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
import traceback
import unittest
import zlib

_CHILD_ENV = "TFDIST_COLLECTIVES_CHILD"
_DEVICES = 8
_GUIDE = os.path.join("docs", "guides", "device-mesh.md")

if os.environ.get(_CHILD_ENV):
  import tensorflow as _tf  # pylint: disable=g-import-not-at-top
  _tf.config.set_logical_device_configuration(
      _tf.config.list_physical_devices("CPU")[0],
      [_tf.config.LogicalDeviceConfiguration()] * _DEVICES)

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl.testing import absltest
import numpy as np
import tensorflow as tf

from tests import testutil
from tfdist import errors
from tfdist.parallel import collectives as col
# pylint: enable=g-import-not-at-top,wrong-import-position


def _cpus(*indices):
  return [f"/cpu:{i}" for i in indices]


def _values(seed, n, shape):
  rng = np.random.default_rng(seed)
  return [rng.normal(size=shape).astype(np.float32) for _ in range(n)]


def _on(group, arrays):
  out = []
  for device, a in zip(group.devices, arrays):
    with tf.device(device):
      out.append(tf.constant(a))
  return out


class _Cases:
  """The child's cases (a mixin: pytest does not collect it here)."""

  def test_concurrent_groups_in_one_function(self):
    g01, g23 = col.DeviceGroup(_cpus(0, 1)), col.DeviceGroup(_cpus(2, 3))
    g02, g13 = col.DeviceGroup(_cpus(0, 2)), col.DeviceGroup(_cpus(1, 3))

    @tf.function
    def step(xs):
      a = col.all_reduce(g01, xs[:2]) + col.all_reduce(g23, xs[2:])
      b = col.all_reduce(g02, [a[0], a[2]])
      c = col.all_reduce(g13, [a[1], a[3]])
      out = [b[0], c[0], b[1], c[1]]
      placed.extend(y.device for y in out)
      return out

    placed = []

    xs = [tf.constant([1.0 * 10**i]) for i in range(4)]
    for i, device in enumerate(_cpus(0, 1, 2, 3)):
      with tf.device(device):
        xs[i] = tf.identity(xs[i])
    out = step(xs)
    for y in out:
      np.testing.assert_allclose(y.numpy(), [1111.0])
    # Each result is made on its device. (A function's outputs on CPUs
    # come back as CPU:0 tensors: host memory, as MirroredStrategy's do.)
    self.assertEqual([tf.DeviceSpec.from_string(d).device_index
                      for d in placed], [0, 1, 2, 3])

  def test_pairs_then_halves_of_eight(self):
    pairs = [col.DeviceGroup(_cpus(i, i + 1)) for i in range(0, 8, 2)]
    # Halves across the pairs: {0,2,4,6} and {1,3,5,7}.
    halves = [col.DeviceGroup(_cpus(*range(r, 8, 2))) for r in (0, 1)]
    xs = _values(1, 8, (3,))

    @tf.function
    def step(xs):
      summed = []
      for p, g in enumerate(pairs):
        summed += col.all_reduce(g, xs[2 * p:2 * p + 2])
      gathered = [col.all_gather(h, summed[r::2]) for r, h in
                  enumerate(halves)]
      return gathered

    out = step([tf.constant(x) for x in xs])
    pair_sums = [xs[2 * p] + xs[2 * p + 1] for p in range(4)]
    for r in (0, 1):
      for y in out[r]:
        np.testing.assert_allclose(y.numpy(), np.concatenate(pair_sums),
                                   rtol=1e-6)

  def _check_values(self, run, run_in_function):
    """Every collective against NumPy; `run(fn)` runs `fn` eagerly or in a
    function. Group given out of rank order: {3, 1, 2} ranks as 1, 2, 3."""
    group = col.DeviceGroup(_cpus(3, 1, 2))
    self.assertEqual([tf.DeviceSpec.from_string(d).device_index
                      for d in group.devices], [1, 2, 3])
    xs = _values(2, 3, (6, 4))
    n = 3

    placed = {}

    def fn():
      t = _on(group, xs)
      out = {"sum": col.all_reduce(group, t),
              "mean": col.all_reduce(group, t, op="mean"),
              "gather1": col.all_gather(group, t, axis=1),
              "gather0": col.all_gather(group, t, axis=-2),
              "scatter0": col.reduce_scatter(group, t),
              "scatter_mean": col.reduce_scatter(group, t, op="mean"),
              "a2a": col.all_to_all(group, t),
              "a2a_0_1": col.all_to_all(group, t, split_axis=0,
                                        concat_axis=1)}
      if not tf.executing_eagerly():
        placed.update({k: [y.device for y in v] for k, v in out.items()})
      return out
    out = run(fn)
    total = sum(xs)
    expect = {
        "sum": [total] * n, "mean": [total / n] * n,
        "gather1": [np.concatenate(xs, axis=1)] * n,
        "gather0": [np.concatenate(xs, axis=0)] * n,
        "scatter0": np.split(total, n, axis=0),
        "scatter_mean": np.split(total / n, n, axis=0),
        "a2a": [np.concatenate([np.split(x, n, 0)[i] for x in xs], 0)
                for i in range(n)],
        "a2a_0_1": [np.concatenate([np.split(x, n, 0)[i] for x in xs], 1)
                    for i in range(n)]}
    for name, want in expect.items():
      self.assertLen(out[name], n)
      for rank, (y, w) in enumerate(zip(out[name], want)):
        np.testing.assert_allclose(y.numpy(), w, rtol=1e-5, atol=1e-6,
                                   err_msg=f"{name}, rank {rank}")
        if run_in_function:
          self.assertEqual(tf.DeviceSpec.from_string(
              placed[name][rank]).device_index, rank + 1, name)

  def test_values_in_a_function(self):
    self._check_values(lambda fn: tf.function(fn)(), True)

  def test_values_eagerly(self):
    self._check_values(lambda fn: fn(), False)

  def _check_gradient(self, fn, n=2, shape=(4, 2)):
    """`fn(list of n tensors) -> list` against the numeric Jacobian."""
    xs = _values(3, n, shape)

    def joined(*parts):
      return tf.concat([tf.reshape(y, [-1]) for y in fn(list(parts))], 0)
    theoretical, numeric = tf.test.compute_gradient(
        joined, [tf.constant(x) for x in xs], delta=1e-2)
    for t, m in zip(theoretical, numeric):
      self.assertGreater(np.abs(t).sum(), 0)
      np.testing.assert_allclose(t, m, rtol=2e-2, atol=2e-2)

  def test_gradient_all_reduce(self):
    g = col.DeviceGroup(_cpus(0, 1, 2))
    self._check_gradient(lambda t: col.all_reduce(g, t), n=3)
    self._check_gradient(lambda t: col.all_reduce(g, t, op="mean"), n=3)

  def test_gradient_all_gather(self):
    g = col.DeviceGroup(_cpus(4, 5))
    self._check_gradient(lambda t: col.all_gather(g, t, axis=1))

  def test_gradient_reduce_scatter(self):
    g = col.DeviceGroup(_cpus(6, 7))
    self._check_gradient(lambda t: col.reduce_scatter(g, t, axis=0))
    self._check_gradient(lambda t: col.reduce_scatter(g, t, op="mean",
                                                      axis=1))

  def test_gradient_all_to_all(self):
    g = col.DeviceGroup(_cpus(0, 3))
    self._check_gradient(lambda t: col.all_to_all(g, t))
    self._check_gradient(lambda t: col.all_to_all(g, t, split_axis=0,
                                                  concat_axis=1))

  def test_megatron_f_and_g_gradients(self):
    group = col.DeviceGroup(_cpus(0, 1))
    xs = [tf.Variable(x) for x in _values(4, 2, (3,))]
    ws = _values(5, 2, (3,))

    @tf.function
    def grads(op):
      with tf.GradientTape() as tape:
        ys = op(group, [x.read_value() for x in xs])
        loss = sum(tf.reduce_sum(y * w) for y, w in zip(ys, ws))
      return ys, tape.gradient(loss, xs)
    # f: identity forward; backward, each device gets the sum of weights.
    ys, gs = grads(col.copy_to_group)
    for x, y in zip(xs, ys):
      np.testing.assert_allclose(y.numpy(), x.numpy())
    for g in gs:
      np.testing.assert_allclose(g.numpy(), ws[0] + ws[1], rtol=1e-6)
    # g: the sum forward; backward, each device's own weight.
    ys, gs = grads(col.reduce_from_group)
    for y in ys:
      np.testing.assert_allclose(y.numpy(), (xs[0] + xs[1]).numpy(),
                                 rtol=1e-6)
    for g, w in zip(gs, ws):
      np.testing.assert_allclose(g.numpy(), w)
    # A plain all-reduce's gradient is the sum (N times g's).
    ys, gs = grads(col.all_reduce)
    for g in gs:
      np.testing.assert_allclose(g.numpy(), ws[0] + ws[1], rtol=1e-6)

  def test_keys_beside_a_mirrored_strategy(self):
    devices = _cpus(0, 1, 2, 3)
    strategy = tf.distribute.MirroredStrategy(devices)
    whole = col.DeviceGroup(devices, name="whole")
    again = col.DeviceGroup(list(reversed(devices)), name="again")
    pair = col.DeviceGroup(_cpus(0, 1), name="pair")
    self.assertEqual(whole.group_key, again.group_key)
    self.assertNotEqual(whole.group_key, pair.group_key)
    self.assertGreaterEqual(min(whole.group_key, pair.group_key),
                            col.GROUP_KEY_START)

    def replica_fn():
      ctx = tf.distribute.get_replica_context()
      value = tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)
      return ctx.all_reduce("sum", value * tf.ones([2]))

    @tf.function
    def step():
      first = strategy.run(replica_fn)
      local = list(strategy.experimental_local_results(first))
      ours = col.all_reduce(whole, local)
      pairs = col.all_reduce(pair, ours[:2])
      second = strategy.run(replica_fn)
      return (local, ours, pairs,
              list(strategy.experimental_local_results(second)))

    for _ in range(2):
      local, ours, pairs, second = step()
      for y in local + second:
        np.testing.assert_allclose(y.numpy(), [10.0, 10.0])
      for y in ours:
        np.testing.assert_allclose(y.numpy(), [40.0, 40.0])
      for y in pairs:
        np.testing.assert_allclose(y.numpy(), [80.0, 80.0])

  def test_replica_functions_in_a_mirrored_strategy(self):
    """Each replica of a 4-device MirroredStrategy makes its own op: pairs
    {0,1},{2,3} then halves {0,2},{1,3} (a 2 x 2 mesh), a gather, an
    all-to-all and the gradients through them (d/dx_r of the summed
    losses), twice through one function."""
    devices = _cpus(0, 1, 2, 3)
    strategy = tf.distribute.MirroredStrategy(devices)
    pairs = [col.DeviceGroup(devices[:2], name="t0"),
             col.DeviceGroup(devices[2:], name="t1")]
    halves = [col.DeviceGroup(devices[0::2], name="d0"),
              col.DeviceGroup(devices[1::2], name="d1")]

    def replica_fn():
      rid = tf.get_static_value(
          tf.distribute.get_replica_context().replica_id_in_sync_group)
      x = tf.constant(float(rid + 1))
      with tf.GradientTape() as tape:
        tape.watch(x)
        total = col.replica_all_reduce(
            halves[rid % 2], col.replica_all_reduce(pairs[rid // 2], x))
        exchanged = col.replica_all_to_all(halves[rid % 2],
                                           tf.stack([x, 10.0 * x]))
        loss = total * total + tf.reduce_sum(exchanged)
      gathered = col.replica_all_gather(pairs[rid // 2], tf.reshape(x, [1]))
      return total, gathered, exchanged, tape.gradient(loss, x)

    step = tf.function(lambda: strategy.run(replica_fn))
    for _ in range(2):
      total, gathered, exchanged, grad = [
          [t.numpy().tolist() for t in strategy.experimental_local_results(v)]
          for v in step()]
      self.assertEqual(total, [10.0] * 4)
      self.assertEqual(gathered, [[1.0, 2.0], [1.0, 2.0], [3.0, 4.0],
                                  [3.0, 4.0]])
      # Device 0 gets chunk 0 of devices 0 and 2: [x0, x2]; device 2
      # chunk 1: [10 x0, 10 x2].
      self.assertEqual(exchanged, [[1.0, 3.0], [2.0, 4.0], [10.0, 30.0],
                                   [20.0, 40.0]])
      # sum_r total_r**2 = 4 total**2: d/dx_r = 8 total = 80; the
      # exchanged sum is 11 * sum(x): 11.
      self.assertEqual(grad, [91.0] * 4)

  def test_replica_functions_refuse_outside_a_replica(self):
    group = col.DeviceGroup(_cpus(0, 1), name="pair")
    with self.assertRaisesRegex(errors.ConfigError, "cross-replica"):
      col.replica_all_reduce(group, tf.ones([2]))
    strategy = tf.distribute.MirroredStrategy(_cpus(0, 1))
    with self.assertRaisesRegex(errors.ConfigError, "tf.function"):
      strategy.run(lambda: col.replica_all_reduce(group, tf.ones([2])))
    other = col.DeviceGroup(_cpus(2, 3), name="other")
    with self.assertRaisesRegex(errors.ConfigError, "is not in group"):
      tf.function(lambda: strategy.run(
          lambda: col.replica_all_reduce(other, tf.ones([2]))),
                  autograph=False)()

  def test_guide_example(self):
    """docs/guides/device-mesh.md, block guide-example."""
    with open(os.path.join(testutil.REPO_ROOT, _GUIDE),
              encoding="utf-8") as f:
      page = f.read()
    code = re.search(
        r"<!-- run: tests/collectives_test.py guide-example -->\n"
        r"```python\n(.*?)```", page, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      exec(compile(code, _GUIDE, "exec"), {})  # pylint: disable=exec-used
    self.assertEqual(out.getvalue(), "[10.0, 10.0, 10.0, 10.0]\n")
    self.assertIn("prints `[10.0, 10.0, 10.0, 10.0]`", page)

  def test_z_stalled_device_times_out(self):
    group = col.DeviceGroup(_cpus(0, 1), name="stalled",
                            timeout_seconds=0.5)

    def slow_one():
      time.sleep(3)
      return np.ones([2], np.float32)

    @tf.function
    def step():
      with tf.device(group.devices[0]):
        x0 = tf.ones([2])
      with tf.device(group.devices[1]):
        x1 = tf.numpy_function(slow_one, [], tf.float32, stateful=True)
        x1.set_shape([2])
      return col.all_reduce(group, [x0, x1])

    started = time.monotonic()
    with self.assertRaises(errors.CollectiveTimeoutError) as raised:
      with col.timeouts_as_errors(group):
        step()
    message = str(raised.exception)
    self.assertIn("group 'stalled' (2 devices", message)
    self.assertIn("timed out after 0.5 s", message)
    self.assertIn("raise timeout_seconds", message)
    self.assertEqual(errors.exit_code_for(raised.exception), 200)
    self.assertLess(time.monotonic() - started, 60)


CASES = sorted(n for n in dir(_Cases) if n.startswith("test_"))


def _child_main():
  """Runs every case here (8 logical CPUs), the timeout last; prints
  `{case: None | traceback}` as one JSON line."""
  case_class = type("ChildCases", (_Cases, tf.test.TestCase), {})
  results = {}
  for name in CASES:
    result = unittest.TestResult()
    case_class(name).run(result)
    failures = result.errors + result.failures
    results[name] = failures[0][1] if failures else None
  print(json.dumps(results))


_RESULTS = {}


def _child_results() -> dict:
  if not _RESULTS:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0",
               **{_CHILD_ENV: "1"})
    env["PYTHONPATH"] = (testutil.REPO_ROOT + os.pathsep +
                         env.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)],
                          cwd=testutil.REPO_ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300, check=False)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode or not lines:
      raise AssertionError(f"child failed ({proc.returncode}):\n"
                           f"{proc.stdout[-4000:]}")
    _RESULTS.update(json.loads(lines[-1]))
  return _RESULTS


class CollectivesOnEightDevicesTest(absltest.TestCase):
  """One test per child case."""


def _make_test(name):
  def test(self):
    results = _child_results()
    self.assertIn(name, results)
    if results[name]:
      self.fail(results[name])
  test.__name__ = name
  return test


for _name in CASES:
  setattr(CollectivesOnEightDevicesTest, _name, _make_test(_name))


class ArgumentsTest(absltest.TestCase):
  """Refusals and keys (no collective runs)."""

  def test_group_refusals(self):
    with self.assertRaisesRegex(errors.ConfigError, "devices is empty"):
      col.DeviceGroup([])
    with self.assertRaisesRegex(
        errors.ConfigError, r"names \['/job:localhost/replica:0/task:0/"
        r"device:CPU:1'\] more than once"):
      col.DeviceGroup(["/cpu:1", "/device:CPU:1"], name="t")
    with self.assertRaisesRegex(errors.ConfigError, "mixes device types"):
      col.DeviceGroup(["/cpu:0", "/gpu:0"])
    with self.assertRaisesRegex(errors.ConfigError,
                                r"timeout_seconds=0 must be > 0"):
      col.DeviceGroup(["/cpu:0"], timeout_seconds=0)

  def test_keys_stay_in_their_range(self):
    a = col.DeviceGroup(["/cpu:0"])
    b = col.DeviceGroup(["/device:CPU:0"], name="other")
    self.assertEqual(a.group_key, b.group_key)
    self.assertGreaterEqual(a.group_key, col.GROUP_KEY_START)
    self.assertLess(a.group_key, 2**31)
    # The key is a function of the names alone (every process agrees).
    names = ",".join(["/job:localhost/replica:0/task:0/device:CPU:0"])
    self.assertEqual(a.group_key, col.GROUP_KEY_START + zlib.crc32(
        names.encode()) % 2**30)
    keys = {col.DeviceGroup([f"/cpu:{i}", f"/cpu:{j}"]).group_key
            for i in range(8) for j in range(8) if i < j}
    self.assertLen(keys, 28)
    self.assertFalse(a.native_reduce_scatter)

  def test_call_refusals(self):
    group = col.DeviceGroup(["/cpu:0"], name="solo")
    with self.assertRaisesRegex(
        errors.ConfigError, r"all_reduce: 2 tensors for group 'solo' \(1 "
        r"devices.*one tensor per device"):
      col.all_reduce(group, [1.0, 2.0])
    with self.assertRaisesRegex(errors.ConfigError, r"op='max' is not one"):
      col.all_reduce(group, [1.0], op="max")
    with self.assertRaisesRegex(errors.ConfigError, "axis=2 is outside"):
      col.all_gather(group, [np.ones([2, 2], np.float32)], axis=2)
    with self.assertRaisesRegex(errors.ConfigError, "is not a DeviceGroup"):
      col.all_gather(["/cpu:0"], [1.0])

  def test_local_devices_and_indivisible_dimension(self):
    # Of the pair, only /cpu:0 is in this process (the unit-test process
    # may have split its CPU in two already: the other device is one past
    # its last), and a call takes its one tensor (the other process would
    # pass the other device's).
    other = f"/cpu:{len(tf.config.list_logical_devices('CPU'))}"
    group = col.DeviceGroup([other, "/cpu:0"], name="pair")
    self.assertEqual(group.local_devices,
                     ("/job:localhost/replica:0/task:0/device:CPU:0",))
    self.assertEqual(group.rank(other), 1)
    with self.assertRaisesRegex(
        errors.ConfigError, r"reduce_scatter: dimension 0 of the tensors "
        r"\(3\) does not divide by the group size 2.*multiple of 2"):
      col.reduce_scatter(group, [np.ones([3], np.float32)])
    with self.assertRaisesRegex(errors.ConfigError,
                                r"all_to_all: dimension 1 .*\(5\)"):
      col.all_to_all(group, [np.ones([2, 5], np.float32)], split_axis=1)
    elsewhere = col.DeviceGroup(["/job:worker/replica:0/task:1/cpu:0"])
    with self.assertRaisesRegex(errors.ConfigError,
                                "None of the devices of group 'group'"):
      col.all_reduce(elsewhere, [1.0])


if __name__ == "__main__":
  if os.environ.get(_CHILD_ENV):
    _child_main()
  else:
    absltest.main()
