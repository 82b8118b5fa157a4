"""Unit tests of tfdist.parallel.mesh: layout, groups, refusals, plan text
(no TensorFlow).

Expected values are written out by hand for 8 devices (2 x 2 x 2) and
checked against the formula index = (p * D + d) * T + t for the others.
"""

import contextlib
import io
import itertools
import os
import re

from absl.testing import absltest
from absl.testing import parameterized

from tests import testutil
from tfdist import errors
from tfdist.parallel import mesh as mesh_lib

_GUIDE = os.path.join("docs", "guides", "device-mesh.md")


def _cpus(n):
  return [f"/cpu:{i}" for i in range(n)]


class LayoutTest(parameterized.TestCase):

  def test_two_by_two_by_two(self):
    mesh = mesh_lib.DeviceMesh.build(_cpus(8), pipeline=2, tensor=2)
    self.assertEqual(mesh.shape, {"data": 2, "pipeline": 2, "tensor": 2,
                                  "expert": 1})
    self.assertEqual(mesh.coordinates("/cpu:5"),
                     mesh_lib.MeshCoordinates(data=0, pipeline=1, tensor=1))
    self.assertEqual(mesh.groups("tensor"), [
        ("/cpu:0", "/cpu:1"), ("/cpu:2", "/cpu:3"), ("/cpu:4", "/cpu:5"),
        ("/cpu:6", "/cpu:7")])
    self.assertEqual(mesh.groups("data"), [
        ("/cpu:0", "/cpu:2"), ("/cpu:1", "/cpu:3"), ("/cpu:4", "/cpu:6"),
        ("/cpu:5", "/cpu:7")])
    self.assertEqual(mesh.groups("pipeline"), [
        ("/cpu:0", "/cpu:4"), ("/cpu:1", "/cpu:5"), ("/cpu:2", "/cpu:6"),
        ("/cpu:3", "/cpu:7")])
    self.assertEqual(mesh.groups("expert"), [(d,) for d in _cpus(8)])
    self.assertEqual(mesh.group_of("data", "/cpu:6"), ("/cpu:4", "/cpu:6"))

  @parameterized.parameters((1, 1, 1), (4, 1, 1), (1, 4, 1), (1, 1, 4),
                            (2, 2, 1), (3, 2, 2), (2, 3, 2))
  def test_coordinates_follow_the_formula(self, data, pipeline, tensor):
    n = data * pipeline * tensor
    mesh = mesh_lib.DeviceMesh.build(_cpus(n), pipeline=pipeline,
                                     tensor=tensor)
    self.assertEqual(mesh.data, data)
    seen = set()
    for d, p, t in itertools.product(range(data), range(pipeline),
                                     range(tensor)):
      i = (p * data + d) * tensor + t
      c = mesh_lib.MeshCoordinates(data=d, pipeline=p, tensor=t)
      self.assertEqual(mesh.coordinates(i), c)
      self.assertEqual(mesh.coordinates(f"/cpu:{i}"), c)
      self.assertEqual(mesh.index(c), i)
      seen.add(i)
    self.assertEqual(seen, set(range(n)))
    for axis, degree in (("data", data), ("pipeline", pipeline),
                         ("tensor", tensor)):
      groups = mesh.groups(axis)
      self.assertLen(groups, n // degree)
      self.assertTrue(all(len(g) == degree for g in groups))
      # The groups of an axis partition the devices ...
      self.assertCountEqual(sum(map(list, groups), []), _cpus(n))
      # ... and differ only along that axis, in its order.
      for g in groups:
        coords = [mesh.coordinates(x) for x in g]
        self.assertEqual([getattr(c, axis) for c in coords],
                         list(range(degree)))
        others = {tuple(v for k, v in vars(c).items() if k != axis)
                  for c in coords}
        self.assertLen(others, 1)

  def test_data_given(self):
    mesh = mesh_lib.DeviceMesh.build(_cpus(4), data=2, tensor=2)
    self.assertEqual((mesh.data, mesh.pipeline, mesh.tensor), (2, 1, 2))

  def test_device_order_is_the_given_order(self):
    names = ["/job:worker/replica:0/task:1/device:CPU:0",
             "/job:worker/replica:0/task:1/device:CPU:1",
             "/job:worker/replica:0/task:0/device:CPU:0",
             "/job:worker/replica:0/task:0/device:CPU:1"]
    mesh = mesh_lib.DeviceMesh.build(names, tensor=2)
    self.assertEqual(mesh.groups("tensor"), [tuple(names[:2]),
                                             tuple(names[2:])])

  def test_plan_text(self):
    mesh = mesh_lib.DeviceMesh.build(_cpus(4), pipeline=2)
    self.assertEqual(mesh.plan_lines(), [
        "mesh: data 2 x pipeline 2 x tensor 1 over 4 devices (tensor "
        "groups: consecutive devices; pipeline stages: blocks of data x "
        "tensor)",
        "  /cpu:0  data 0  pipeline 0  tensor 0",
        "  /cpu:1  data 1  pipeline 0  tensor 0",
        "  /cpu:2  data 0  pipeline 1  tensor 0",
        "  /cpu:3  data 1  pipeline 1  tensor 0"])

  def test_factorizations(self):
    self.assertEqual(mesh_lib.factorizations(1), [(1, 1, 1)])
    self.assertEqual(mesh_lib.factorizations(4), [
        (4, 1, 1), (2, 1, 2), (2, 2, 1), (1, 1, 4), (1, 2, 2), (1, 4, 1)])
    for n in (6, 8, 12):
      got = mesh_lib.factorizations(n)
      brute = {(d, p, t) for d in range(1, n + 1) for p in range(1, n + 1)
               for t in range(1, n + 1) if d * p * t == n}
      self.assertEqual(set(got), brute)
      self.assertLen(got, len(brute))
      # Each builds a mesh.
      for d, p, t in got:
        self.assertEqual(mesh_lib.DeviceMesh.build(
            _cpus(n), pipeline=p, tensor=t).data, d)
    self.assertLen(mesh_lib.factorizations(8), 10)


class GuideTest(absltest.TestCase):

  def test_guide_example_prints_what_the_guide_shows(self):
    """docs/guides/device-mesh.md, block guide-example, and the text
    block after it."""
    with open(os.path.join(testutil.REPO_ROOT, _GUIDE), encoding="utf-8") as f:
      page = f.read()
    code, shown = re.search(
        r"<!-- run: tests/mesh_test.py guide-example -->\n```python\n(.*?)"
        r"```\n\nprints\n\n<!-- not run: .*? -->\n```text\n(.*?)```",
        page, re.S).groups()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      exec(compile(code, _GUIDE, "exec"), {})  # pylint: disable=exec-used
    self.assertEqual(out.getvalue(), shown)


class RefusalTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("pipeline_not_dividing", dict(pipeline=3),
       r"--pipeline_stages=3 does not divide the 8 devices\. Use one of "
       r"\[1, 2, 4, 8\], or run on a multiple of 3 devices"),
      ("tensor_not_dividing", dict(tensor=3),
       r"--tensor_parallel=3 does not divide the 8 devices\. Use one of "
       r"\[1, 2, 4, 8\]"),
      ("product_not_dividing", dict(pipeline=4, tensor=4),
       r"--pipeline_stages=4 x --tensor_parallel=4 = 16 does not divide "
       r"the 8 devices\. With --tensor_parallel=4 use --pipeline_stages in "
       r"\[1, 2\]; with --pipeline_stages=4 use --tensor_parallel in "
       r"\[1, 2\]"),
      ("zero_stages", dict(pipeline=0),
       r"--pipeline_stages=0 must be an integer >= 1"),
      ("float_tensor", dict(tensor=2.0),
       r"--tensor_parallel=2\.0 must be an integer >= 1"),
      ("data_not_matching", dict(data=2, tensor=2),
       r"data=2 x --pipeline_stages=1 x --tensor_parallel=2 = 4 devices, "
       r"but there are 8\. Leave the data degree out"),
      ("expert_reserved", dict(expert=2),
       r"expert=2: the expert axis is reserved"),
  )
  def test_refused_with_flag_value_and_fix(self, kwargs, pattern):
    with self.assertRaisesRegex(errors.ConfigError, pattern) as raised:
      mesh_lib.DeviceMesh.build(_cpus(8), **kwargs)
    self.assertEqual(errors.exit_code_for(raised.exception), 2)

  def test_device_list_refusals(self):
    with self.assertRaisesRegex(errors.ConfigError, "device list is empty"):
      mesh_lib.DeviceMesh.build([])
    with self.assertRaisesRegex(errors.ConfigError,
                                r"names \['/cpu:1'\] more than once"):
      mesh_lib.DeviceMesh.build(["/cpu:0", "/cpu:1", "/cpu:1", "/cpu:2"])
    mesh = mesh_lib.DeviceMesh.build(_cpus(2))
    with self.assertRaisesRegex(errors.ConfigError,
                                "'/cpu:9' is not a device of this mesh"):
      mesh.coordinates("/cpu:9")
    with self.assertRaisesRegex(errors.ConfigError, "axis='model' is not"):
      mesh.groups("model")
    with self.assertRaisesRegex(errors.ConfigError, "at least one device"):
      mesh_lib.factorizations(0)

  def test_frozen(self):
    mesh = mesh_lib.DeviceMesh.build(_cpus(2))
    with self.assertRaises(AttributeError):
      mesh.data = 1  # pytype: disable=not-writable


if __name__ == "__main__":
  absltest.main()
