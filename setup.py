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
    install_requires=[
        # The CPU wheel is enough where no GPU exists; on GPU machines
        # (and in Vertex's GPU images) `tensorflow` satisfies the same range
        # when installed with TFDIST_TF_PACKAGE=tensorflow (see README).
        "tensorflow-cpu>=2.21,<2.22",
        "keras>=3.12,<4",
        "absl-py>=2.0,<3",
        "tensorboard>=2.21,<2.22",
        "numpy>=1.26,<3",
        "portpicker>=1.6,<2",
    ],
    extras_require={"test": ["pytest>=8,<10"]},
    entry_points={"console_scripts": [
        "tfdist-train=tfdist.train:run",
    ]},
)
