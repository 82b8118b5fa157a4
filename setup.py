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
        "test": ["pytest>=8,<10"],
        # `python -m tfdist.ray`: tfdist as a Ray Train job.
        "ray": ["ray[train]>=2.60,<3"],
    },
    entry_points={"console_scripts": [
        "tfdist-train=tfdist.train:run",
    ]},
)
