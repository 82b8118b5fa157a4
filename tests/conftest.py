"""pytest settings shared by every test file (under Bazel too).

The marker `compat` tags the tests that tools/test.sh also runs in the
TensorFlow 2.17 environment (.venv-tf217, the oldest supported TensorFlow):
every module's unit tests and one short training run per strategy. Tag a
whole file with `pytestmark = pytest.mark.compat`, or a class or test with
`@pytest.mark.compat`. Run them alone with

    TFDIST_VENV=.venv-tf217 TFDIST_PYTEST=compat TFDIST_BAZEL=0 bash tools/test.sh
"""


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "compat: also run on the oldest supported TensorFlow "
      "(tools/test.sh runs them in .venv-tf217)")
