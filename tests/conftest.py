"""pytest settings shared by every test file (under Bazel too).

The marker `compat` tags the tests that tools/test.sh also runs in the
TensorFlow 2.17 environment (.venv-tf217, the oldest supported TensorFlow):
every module's unit tests and one short training run per strategy. Tag a
whole file with `pytestmark = pytest.mark.compat`, or a class or test with
`@pytest.mark.compat`. A compat test that runs several processes at once is
also marked `cluster` (`@pytest.mark.cluster` on its class): Bazel runs
those in //tests:compat_tf217_cluster (tagged cpu:2, one multi-process
target at a time) and the rest in //tests:compat_tf217 (one CPU, beside
other targets). Run them all alone with

    TFDIST_VENV=.venv-tf217 TFDIST_PYTEST=compat TFDIST_BAZEL=0 bash tools/test.sh
"""


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "compat: also run on the oldest supported TensorFlow "
      "(tools/test.sh runs them in .venv-tf217)")
  config.addinivalue_line(
      "markers", "cluster: runs several processes at once (a cluster of "
      "TensorFlow tasks, an emulator beside a training run); in the oldest "
      "TensorFlow's pass, //tests:compat_tf217_cluster runs these apart "
      "from the rest, which //tests:compat_tf217 runs beside other targets")
