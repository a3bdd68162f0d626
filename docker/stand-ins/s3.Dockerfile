# Stand-ins for `minio/minio` and `minio/mc` where no registry is reachable (scripts/stack_check.py
# builds the targets `minio` and `mc` and tags them with the names docker-compose.yaml uses).
# MinIO has no Debian or PyPI build: moto's S3 server (the project's pin) answers on port 9000,
# and s3_standin.py plays the two commands the compose file runs: `minio server ...` and
# `mc ready local` / `mc mb --ignore-existing ALIAS/BUCKET ...` (aliases from MC_HOST_<alias>).
# Differences from MinIO (docs/operations.md): objects live in memory (the /data volume stays
# empty, a restart loses them), credentials are not checked, there is no console on 9001.
ARG BASE_IMAGE=localhost/debian-base:bookworm
FROM ${BASE_IMAGE} AS minio

# scripts/stack_check.py rebuilds only images with this label: it never shadows a registry image.
LABEL stack-check.stand-in="true"

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY constraints.txt /tmp/constraints.txt
# PIP_CONFIG_FILE names the secret's path; pip skips it when no secret was given.
RUN --mount=type=secret,id=pip.conf --mount=type=secret,id=pip-ca \
    export PIP_CONFIG_FILE=/run/secrets/pip.conf \
    && python3 -m venv /opt/venv \
    && grep -v '^torch==' /tmp/constraints.txt > /tmp/constraints-no-torch.txt \
    && pip install --no-cache-dir -c /tmp/constraints-no-torch.txt "moto[server]==5.2.5" boto3==1.44.8 \
    && rm /tmp/constraints.txt /tmp/constraints-no-torch.txt
COPY docker/stand-ins/s3_standin.py /usr/local/bin/minio
RUN ln -s /usr/local/bin/minio /usr/local/bin/mc
VOLUME /data
EXPOSE 9000
ENTRYPOINT ["minio"]
CMD ["server", "/data"]

FROM minio AS mc
ENTRYPOINT ["mc"]
CMD ["--help"]
