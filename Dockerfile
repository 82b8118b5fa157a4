# A training image with tfdist installed: every replica of a Vertex AI
# custom job (python -m tfdist.job_spec vertex --container_image_uri=IMAGE)
# or a Kubeflow TFJob (python -m tfdist.job_spec kubernetes --image=IMAGE)
# runs `python -m tfdist.train` in it. docs/platforms/engines.md has the
# build and push commands.
#
#   docker build -t tfdist:0.1.0 .                              # CPUs
#   docker build --build-arg TFDIST_EXTRAS=gpu -t tfdist:0.1.0-gpu .  # GPUs
#
# TFDIST_EXTRAS picks the TensorFlow wheel (setup.py's extras): cpu
# installs tensorflow-cpu, gpu installs tensorflow[and-cuda] (CUDA and cuDNN
# come as pip wheels; the host needs only the NVIDIA driver).
# tests/sdist_install_test.py runs this file's pip steps on the files its
# COPY lines name.
FROM python:3.11-slim

ARG TFDIST_EXTRAS=cpu
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/tfdist
COPY setup.py README.md LICENSE ./
COPY tfdist/ tfdist/
COPY models/ models/
COPY flags/ flags/
# vertex: cloudml-hypertune, for --hptune_metric.
RUN pip install ".[${TFDIST_EXTRAS},vertex]"

# Runs as a user of its own; the model folder is gs:// or a mounted volume.
RUN useradd --create-home --uid 1000 tfdist
USER tfdist
WORKDIR /home/tfdist
CMD ["tfdist-train", "--helpshort"]
