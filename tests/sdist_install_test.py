"""The sdist, installed as Vertex AI installs a Python package into a
prebuilt TensorFlow training container, trains on TFRecord files.

The "container" is a clean Python 3.10 virtual environment holding only what
Vertex AI's tf-cpu.2-17.py310 image brings for tfdist: TensorFlow 2.17, its
Keras 3 and cloudml-hypertune (their pins: tools/requirements-tf217.txt).
Everything installs from the wheelhouse that tools/setup.sh fills, with
`pip install --no-index`: nothing is downloaded. The training data is a
small real Fashion-MNIST subset converted here, in the default environment,
by tfdist's own converter (a container has no Debian data files), and given
with --train_files/--eval_files. The run starts outside the checkout, so only
the installed package can be imported.
"""

import json
import os
import re
import shutil
import subprocess
import tarfile

from absl.testing import absltest

from tests import testutil

# The packages of tools/requirements-tf217.txt a prebuilt container has.
CONTAINER_PACKAGES = ("tensorflow-cpu", "keras", "cloudml-hypertune")
# What the sdist build leaves out of the copy it builds from: anywhere,
# and (outputs of runs, not the tfdist.data package) at the top only.
_NOT_SOURCES_ANYWHERE = shutil.ignore_patterns(
    ".git", ".venv*", ".wheelhouse", "bazel-*", "__pycache__", "*.egg-info",
    ".pytest_cache")
_NOT_SOURCES_AT_TOP = ("build", "dist", "runs", "data")


def _NOT_SOURCES(folder, names):  # pylint: disable=invalid-name
  """`shutil.copytree`'s ignore: what the sdist build leaves out."""
  ignored = set(_NOT_SOURCES_ANYWHERE(folder, names))
  if os.path.realpath(folder) == os.path.realpath(testutil.SOURCE_ROOT):
    ignored.update(n for n in names if n in _NOT_SOURCES_AT_TOP)
  return ignored
TIMEOUT = 600
# Each binary's console script and a flag its --helpshort must list.
KEY_FLAG = {"train": "--train_files", "launch": "--num_workers",
            "diagnose": "--num_workers", "job_spec": "--worker_replicas",
            "ray": "--num_workers"}


# Runs the console script given as its argument as its interpreter would
# (`--helpshort`), then prints where tfdist, tfdist.models and tfdist.flags
# were imported from.
_SCRIPT_THEN_WHERE = """
import runpy, sys
script = sys.argv[1]
sys.argv = [script, "--helpshort"]
try:
  runpy.run_path(script, run_name="__main__")
except SystemExit:
  pass
sys.stdout.flush()
import tfdist, tfdist.models, tfdist.flags
print("WHERE", tfdist.__file__, tfdist.models.__file__, tfdist.flags.__file__)
"""


def _run(args, **kwargs) -> subprocess.CompletedProcess:
  return subprocess.run(args, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True,
                        timeout=kwargs.pop("timeout", TIMEOUT), **kwargs)


def _container_requirements() -> list:
  """The pinned `name==version` lines of CONTAINER_PACKAGES."""
  path = os.path.join(testutil.SOURCE_ROOT, "tools",
                      "requirements-tf217.txt")
  pins = {}
  with open(path) as f:
    for line in f:
      match = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line.strip())
      if match:
        pins[match.group(1).lower()] = line.strip()
  return [pins[name] for name in CONTAINER_PACKAGES]


def _binaries() -> dict:
  """{module: first line of its docstring} for each tfdist module that runs
  as a program (has an `if __name__ == "__main__":` block)."""
  found = {}
  package = os.path.join(testutil.SOURCE_ROOT, "tfdist")
  for name in sorted(os.listdir(package)):
    main = os.path.join(package, name, "__main__.py")
    if os.path.isfile(main):
      # A package run as a program (`python -m tfdist.diagnose`): its usage
      # is the package's own docstring.
      with open(os.path.join(package, name, "__init__.py")) as f:
        found[name] = re.match(r'\s*"""(.*)', f.read()).group(1).strip()
      continue
    if not name.endswith(".py"):
      continue
    with open(os.path.join(package, name)) as f:
      text = f.read()
    if re.search(r'^if __name__ == "__main__":', text, re.M):
      docstring = re.match(r'\s*"""(.*)', text).group(1)
      found[name[:-3]] = docstring.strip()
  return found


def _dockerfile_steps() -> list:
  """`(INSTRUCTION, arguments)` of the repository's Dockerfile, in order
  (continued lines joined, comments dropped)."""
  with open(os.path.join(testutil.SOURCE_ROOT, "Dockerfile")) as f:
    text = re.sub(r"\\\n", " ", "".join(
        line for line in f if not line.lstrip().startswith("#")))
  steps = []
  for line in text.splitlines():
    if line.strip():
      instruction, _, value = line.strip().partition(" ")
      steps.append((instruction.upper(), " ".join(value.split())))
  return steps


def _clean_env() -> dict:
  """This process's environment without what points into the checkout or
  describes a cluster."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("PYTHONPATH", "TF_CONFIG", "CLUSTER_SPEC",
                      "VIRTUAL_ENV") and not k.startswith("AIP_")}
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  return env


class SdistInstallTest(absltest.TestCase):

  def test_sdist_in_a_prebuilt_container_trains_on_tfrecords(self):
    wheelhouse = testutil.setup_output(".wheelhouse")
    tf217_python = os.path.join(testutil.setup_output(".venv-tf217"), "bin",
                                "python")
    data = testutil.fashion_mnist_subset(limit=256, train_shards=2,
                                         test_shards=1)
    work = testutil.scratch_dir()

    # 1. The sdist, built from a copy of the checkout.
    source = os.path.join(work, "source")
    shutil.copytree(testutil.SOURCE_ROOT, source, ignore=_NOT_SOURCES,
                    symlinks=True)
    dist = os.path.join(work, "dist")
    proc = _run([tf217_python, "setup.py", "-q", "sdist", "--dist-dir", dist],
                cwd=source, env=_clean_env())
    self.assertEqual(proc.returncode, 0, proc.stdout[-3000:])
    (sdist,) = [os.path.join(dist, n) for n in os.listdir(dist)]
    with tarfile.open(sdist) as tar:
      top = {n.split("/")[1] for n in tar.getnames() if n.count("/") >= 1}
    for package in ("tfdist", "models", "flags"):
      self.assertIn(package, top)

    # 2. The container: Python 3.10 with TensorFlow 2.17, Keras 3,
    # cloudml-hypertune; then tfdist from the sdist (its own requirements
    # from the wheelhouse too).
    base_python = _run([tf217_python, "-c",
                        "import sys; print(sys._base_executable)"],
                       timeout=60).stdout.strip()
    container = os.path.join(work, "container")
    proc = _run([base_python, "-m", "venv", container])
    self.assertEqual(proc.returncode, 0, proc.stdout)
    python = os.path.join(container, "bin", "python")
    offline = ["-m", "pip", "install", "-q", "--disable-pip-version-check",
               "--no-index", "--find-links", wheelhouse]
    proc = _run([python, *offline, *_container_requirements()],
                env=_clean_env())
    self.assertEqual(proc.returncode, 0, proc.stdout[-3000:])
    proc = _run([python, *offline, sdist], env=_clean_env())
    self.assertEqual(proc.returncode, 0, proc.stdout[-3000:])
    installed = _run([python, "-m", "pip", "list", "--format=json",
                      "--disable-pip-version-check"], env=_clean_env())
    names = {p["name"].lower(): p["version"]
             for p in json.loads(installed.stdout)}
    self.assertEqual(names["tensorflow-cpu"], "2.17.1")
    self.assertIn("cloudml-hypertune", names)
    self.assertIn("tfdist", names)
    for absent in ("tensorflow-io", "google-cloud-storage", "pytest"):
      self.assertNotIn(absent, names)

    # 3. Train from outside the checkout: only the installed tfdist imports.
    run_dir = os.path.join(work, "elsewhere")
    os.makedirs(run_dir)
    model_dir = os.path.join(run_dir, "model")
    proc = _run([python, "-m", "tfdist.train",
                 f"--train_files={data['train']}",
                 f"--eval_files={data['eval']}", f"--model_dir={model_dir}",
                 "--train_steps=8", "--batch_size=32", "--log_steps=4"],
                cwd=run_dir, env=_clean_env())
    self.assertEqual(proc.returncode, 0, proc.stdout[-4000:])
    with open(os.path.join(model_dir, "run_manifest.json")) as f:
      manifest = json.load(f)
    self.assertEqual(manifest["final_step"], 8)
    self.assertEqual(manifest["versions"]["tensorflow"], "2.17.1")
    self.assertTrue(manifest["versions"]["python"].startswith("3.10."))
    self.assertEqual(manifest["final_metrics"]["eval_examples"], 256)
    self.assertTrue(os.path.exists(os.path.join(model_dir, "saved_model",
                                                "saved_model.pb")))
    # A console script per binary: every tfdist module with a `__main__`
    # block is installed as tfdist-<module>, runs from outside the
    # checkout, and prints its own usage and key flags (absl's --helpshort
    # exits 1 after printing).
    binaries = _binaries()
    self.assertEqual(set(binaries), set(KEY_FLAG))
    scripts = _run([python, "-c", "import importlib.metadata as m; print("
                    "'\\n'.join(sorted(e.name + '=' + e.value for e in "
                    "m.entry_points(group='console_scripts') "
                    "if e.dist.name == 'tfdist')))"],
                   cwd=run_dir, env=_clean_env(), timeout=60)
    self.assertEqual(
        scripts.stdout.split(),
        sorted(f"tfdist-{b.replace('_', '-')}=tfdist.{b}:run"
               for b in binaries))
    for binary, usage in binaries.items():
      script = os.path.join(container, "bin",
                            f"tfdist-{binary.replace('_', '-')}")
      if binary != "train":
        helpshort = _run([script, "--helpshort"], cwd=run_dir,
                         env=_clean_env(), timeout=120).stdout
      else:
        # tfdist-train's script, then (in the same process, after it: one
        # TensorFlow start less) where tfdist's models/ and flags/ come
        # from: inside the installed tfdist (tfdist.models, tfdist.flags),
        # never top-level packages a project's own models/ or flags.py
        # would shadow.
        helpshort, _, where = _run([python, "-c", _SCRIPT_THEN_WHERE, script],
                                   cwd=run_dir, env=_clean_env(),
                                   timeout=120).stdout.partition("WHERE ")
        paths = where.split()
        self.assertLen(paths, 3, where[-3000:])
        for path in paths:
          self.assertTrue(path.startswith(os.path.join(container, "lib")),
                          path)
      self.assertTrue(helpshort.lstrip().startswith(usage), helpshort[:3000])
      self.assertIn(KEY_FLAG[binary], helpshort)
    # 4. The Dockerfile's install steps, run in the same environment with
    # pip on the wheelhouse: its COPY lines give the build folder, its pip
    # RUN lines install from there (the image's python:3.11-slim base and
    # PyPI are not here: Python 3.10 and TensorFlow 2.17.1 from the
    # wheelhouse meet the same `.[cpu,vertex]` requirements).
    image = os.path.join(work, "image")
    os.makedirs(image)
    build_args, pip_steps = {}, 0
    for instruction, value in _dockerfile_steps():
      if instruction == "ARG":
        name, _, default = value.partition("=")
        build_args[name] = default
      elif instruction == "COPY" and not value.startswith("--from"):
        *sources, dest = value.split()
        # Into the WORKDIR under their own names (what this copy assumes).
        self.assertIn(dest, ("./", sources[0]))
        for source in sources:
          source_path = os.path.join(testutil.SOURCE_ROOT, source)
          target = os.path.join(image, source)
          if os.path.isdir(source_path):
            shutil.copytree(source_path, target, ignore=_NOT_SOURCES)
          else:
            shutil.copy(source_path, target)
      elif instruction == "RUN":
        command = re.sub(r"\$\{(\w+)\}", lambda m: build_args[m.group(1)],
                         value)
        if not command.startswith("pip "):
          self.assertRegex(command, r"^useradd ")  # the image's own user
          continue
        pip_steps += 1
        proc = _run(["bash", "-c", command], cwd=image, env={
            **_clean_env(),
            "PATH": os.path.join(container, "bin") + os.pathsep +
                    os.environ["PATH"],
            "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": wheelhouse,
            "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
        self.assertEqual(proc.returncode, 0, proc.stdout[-3000:])
    self.assertEqual(pip_steps, 1)
    where = _run([python, "-c", "import tfdist, hypertune; "
                  "print(tfdist.__file__)"], cwd=run_dir, env=_clean_env(),
                 timeout=60)
    self.assertEqual(where.returncode, 0, where.stdout[-3000:])
    self.assertTrue(where.stdout.strip().startswith(
        os.path.join(container, "lib")), where.stdout)
    self.assertIn("--train_files", _run(
        [os.path.join(container, "bin", "tfdist-train"), "--helpshort"],
        cwd=run_dir, env=_clean_env(), timeout=120).stdout)

    # The licence travels with the package.
    metadata = _run([python, "-c", "import importlib.metadata as m; "
                     "d = m.distribution('tfdist'); print(d.metadata['License']); "
                     "print(any(str(f).endswith('LICENSE') for f in d.files))"],
                    cwd=run_dir, env=_clean_env(), timeout=60)
    self.assertEqual(metadata.stdout.split(), ["Apache-2.0", "True"])


if __name__ == "__main__":
  absltest.main()
