# Training image: what the pods of the Kubernetes backend run (`python -m training ...`, torchrun).
# Only requirements-training.txt and training/: no Airflow, no Great Expectations.
#
#   docker build -f docker/training.Dockerfile -t distributed-training:latest .
#
# BASE_IMAGE picks the CUDA runtime (the default), or any image with a Debian/Ubuntu userland, e.g.
# --build-arg BASE_IMAGE=python:3.11-slim-bookworm for CPU pods. torch's wheel brings its own CUDA
# libraries; the base image supplies the rest of the user-space stack, the node supplies the driver.
# TORCH_INDEX_URL (optional) installs torch from another wheel index, e.g. a CPU-only build.
# `make images` (scripts/images.py) builds it with podman or docker; without a registry it makes a
# Debian base from packages (--base debian). Behind a proxy, pip's configuration comes in only for
# the install step, as build secrets (never in a layer):
#   --secret id=pip.conf,src=pip.conf [--secret id=pip-ca,src=proxy-ca.crt]
ARG BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

ARG TORCH_INDEX_URL=
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/app \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Python with venv from the distribution if the base image has none (the CUDA images).
# hadolint ignore=DL3008
RUN if ! python3 -c "import ensurepip, venv" 2>/dev/null; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/venv

COPY requirements-training.txt /tmp/requirements-training.txt
# PIP_CONFIG_FILE names the secret's path; pip skips it when no secret was given.
RUN --mount=type=secret,id=pip.conf --mount=type=secret,id=pip-ca \
    export PIP_CONFIG_FILE=/run/secrets/pip.conf \
    && if [ -n "${TORCH_INDEX_URL}" ]; then \
        pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "$(grep '^torch==' /tmp/requirements-training.txt)"; \
    fi \
    && pip install --no-cache-dir -r /tmp/requirements-training.txt \
    && rm /tmp/requirements-training.txt

# A fixed non-root user: the Kubernetes backend runs pods as uid/gid 10001 (runAsNonRoot, fsGroup).
RUN groupadd --gid 10001 training \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin training

WORKDIR /app
COPY training/ /app/training/
USER 10001:10001

ENTRYPOINT ["python", "-m", "training"]
CMD ["--help"]
