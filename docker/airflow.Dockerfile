# Airflow image of the project: the official image plus the pinned providers and libraries, the
# DAGs, the plugins and the training package (the local backend runs torchrun on the worker, and
# `evaluate` scores checkpoints there on either backend).
#
#   docker build -f docker/airflow.Dockerfile -t distributed-training-airflow:latest .
#
# The -python3.11 variant of the official 3.3.2 image: constraints.txt is resolved for Python 3.11.
# TORCH_INDEX_URL (optional) takes torch from another wheel index, e.g. a CPU-only build, which
# keeps this image much smaller; the default is the PyPI wheel.
FROM apache/airflow:3.3.2-python3.11

ARG TORCH_INDEX_URL=
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

COPY --chown=airflow:root constraints.txt /tmp/constraints.txt
# The pins are those of requirements.txt (a test keeps them equal).
# constraints.txt pins a local CPU build of torch (torch==X+cpu) that only exists on a CPU wheel
# index: torch is installed on its own first, every other pin applies as is.
# Behind a proxy, pip's configuration comes in only for this step, as build secrets readable by the
# airflow user (never in a layer; `make images` passes them):
#   --secret id=pip.conf,src=pip.conf [--secret id=pip-ca,src=proxy-ca.crt]
# PIP_CONFIG_FILE names the secret's path; pip skips it when no secret was given.
RUN --mount=type=secret,id=pip.conf,uid=50000 --mount=type=secret,id=pip-ca,uid=50000 \
    export PIP_CONFIG_FILE=/run/secrets/pip.conf \
    && grep -v '^torch==' /tmp/constraints.txt > /tmp/constraints-no-torch.txt \
    && if [ -n "${TORCH_INDEX_URL}" ]; then \
        pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==2.13.0"; \
    else \
        pip install --no-cache-dir "torch==2.13.0"; \
    fi \
    && pip install --no-cache-dir -c /tmp/constraints-no-torch.txt \
        "apache-airflow==${AIRFLOW_VERSION}" \
        apache-airflow-providers-cncf-kubernetes==10.25.0 \
        apache-airflow-providers-amazon==9.39.0 \
        apache-airflow-providers-celery==3.26.0 \
        "celery[redis]==5.6.3" \
        statsd==4.0.1 \
        Flask-WTF==1.3.0 \
        mlflow==3.17.2 \
        great-expectations==1.24.1 \
        boto3==1.44.8 \
        safetensors==0.8.0 \
        tokenizers==0.23.3 \
        transformers==5.23.0 \
    && rm /tmp/constraints.txt /tmp/constraints-no-torch.txt

ENV PYTHONPATH=/opt/project \
    TRAINING_HOME=/opt/airflow \
    TRAINING_VAR_DIR=/opt/airflow/var \
    GX_ANALYTICS_ENABLED=False \
    MLFLOW_ENABLE_TELEMETRY=false \
    DO_NOT_TRACK=true
# Owned by the airflow user, so the named volumes docker-compose.yaml mounts here start writable.
RUN mkdir -p /opt/airflow/var/data /opt/airflow/auth
COPY --chown=airflow:root training/ /opt/project/training/
COPY --chown=airflow:root dags/ /opt/airflow/dags/
COPY --chown=airflow:root plugins/ /opt/airflow/plugins/
