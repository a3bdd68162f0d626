# Stand-ins for `redis`, `prom/statsd-exporter` and `prom/prometheus` where no registry is reachable
# (scripts/stack_check.py builds the targets `redis`, `statsd-exporter` and `prometheus` and tags
# them with the names docker-compose.yaml uses). Differences from the real images are listed in
# docs/operations.md:
#   redis:       Debian 12's redis-server (7.0, not 7.2), run as the image's `redis` user; the
#                command as given (the official entrypoint's --protected-mode no when no config
#                file is named is in the compose file's command itself).
#   statsd:      statsd_standin.py (prometheus_client) plays `statsd_exporter`: mapping file, UDP in,
#                /metrics out; wget for the healthcheck as in the busybox-based image.
#   prometheus:  Debian 12's Prometheus (2.42, not 2.55), /bin/prometheus as in the image (/bin is
#                /usr/bin here), wget for the healthcheck.
ARG BASE_IMAGE=localhost/debian-base:bookworm
FROM ${BASE_IMAGE} AS redis

# scripts/stack_check.py rebuilds only images with this label: it never shadows a registry image.
LABEL stack-check.stand-in="true"
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server redis-tools \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /data && chown redis:redis /data
WORKDIR /data
# The package makes the user (its uid is not fixed); the official image runs redis-server as `redis` too.
# hadolint ignore=DL3066
USER redis
EXPOSE 6379
CMD ["redis-server"]

FROM ${BASE_IMAGE} AS statsd-exporter
LABEL stack-check.stand-in="true"
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1
COPY constraints.txt /tmp/constraints.txt
# hadolint ignore=DL3008
RUN --mount=type=secret,id=pip.conf --mount=type=secret,id=pip-ca \
    export PIP_CONFIG_FILE=/run/secrets/pip.conf \
    && apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends wget \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir -c /tmp/constraints.txt prometheus-client PyYAML \
    && rm /tmp/constraints.txt
COPY docker/stand-ins/statsd_standin.py /bin/statsd_exporter
USER 65534:65534
EXPOSE 9102 9125/udp
ENTRYPOINT ["/opt/venv/bin/python", "/bin/statsd_exporter"]

FROM ${BASE_IMAGE} AS prometheus
LABEL stack-check.stand-in="true"
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus wget \
    && rm -rf /var/lib/apt/lists/* \
    && test -x /bin/prometheus \
    && mkdir -p /prometheus /etc/prometheus && chown nobody:nogroup /prometheus
WORKDIR /prometheus
USER 65534:65534
EXPOSE 9090
ENTRYPOINT ["/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
