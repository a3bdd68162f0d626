# Stand-in for the official `apache/airflow:3.3.2-python3.11` image where no registry is reachable
# (scripts/stack_check.py tags it with that name; docker/airflow.Dockerfile builds on it unchanged).
# Debian 12's Python (3.11.2) is too old for the pins (soupsieve needs 3.11.5), so the build context
# brings a Python 3.11 build for Debian 12 in python/ (stack_check.py copies the host's interpreter
# and standard library, no site-packages). What the project's Dockerfile and docker-compose.yaml
# expect from the official image:
#   user `airflow` (uid 50000, gid 0), AIRFLOW_HOME=/opt/airflow, AIRFLOW_VERSION, pip on PATH
#   installing into the user's ~/.local (PIP_USER), Airflow itself with its Postgres drivers
#   (psycopg2, asyncpg), curl for the healthchecks, and the entrypoint: `bash ...` and
#   `python ...` run as given, anything else as an `airflow` subcommand, after the metadata
#   database answers (airflow-entrypoint.sh).
ARG BASE_IMAGE=localhost/debian-base:bookworm
FROM ${BASE_IMAGE}

# scripts/stack_check.py rebuilds only images with this label: it never shadows a registry image.
LABEL stack-check.stand-in="true"

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The shared libraries the interpreter's extension modules link against, plus the tools the
# official image has (curl, dumb-init, netcat, git: MLflow records the code version with it).
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        libbz2-1.0 libcrypt1 libexpat1 libffi8 liblzma5 libncursesw6 libnsl2 libreadline8 libsqlite3-0 \
        libssl3 libtinfo6 libuuid1 zlib1g libstdc++6 curl dumb-init netcat-openbsd git ca-certificates procps \
    && rm -rf /var/lib/apt/lists/*

COPY python/ /usr/python/
RUN echo /usr/python/lib > /etc/ld.so.conf.d/python.conf && ldconfig \
    && /usr/python/bin/python3.11 -m ensurepip --default-pip \
    && ln -s python3.11 /usr/python/bin/python \
    && useradd --uid 50000 --gid 0 --create-home --home-dir /home/airflow --shell /bin/bash airflow \
    && mkdir -p /opt/airflow \
    && chown -R 50000:0 /opt/airflow \
    && chmod -R g+rwX /opt/airflow

ENV AIRFLOW_VERSION=3.3.2 \
    AIRFLOW_HOME=/opt/airflow \
    AIRFLOW_USER_HOME_DIR=/home/airflow \
    PATH=/home/airflow/.local/bin:/usr/python/bin:$PATH \
    PIP_USER=true \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1
COPY --chown=airflow:root constraints.txt /tmp/constraints.txt
USER 50000:0
# PIP_CONFIG_FILE names the secret's path; pip skips it when no secret was given.
# hadolint ignore=DL3013
RUN --mount=type=secret,id=pip.conf,uid=50000 --mount=type=secret,id=pip-ca,uid=50000 \
    export PIP_CONFIG_FILE=/run/secrets/pip.conf \
    && grep -v '^torch==' /tmp/constraints.txt > /tmp/constraints-no-torch.txt \
    && pip install --no-cache-dir -c /tmp/constraints-no-torch.txt \
        "apache-airflow==${AIRFLOW_VERSION}" psycopg2-binary asyncpg \
    && rm /tmp/constraints.txt /tmp/constraints-no-torch.txt
COPY airflow-entrypoint.sh /entrypoint
WORKDIR /opt/airflow
EXPOSE 8080
ENTRYPOINT ["/usr/bin/dumb-init", "--", "/entrypoint"]
CMD []
