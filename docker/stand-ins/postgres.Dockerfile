# Stand-in for `postgres:16.10-bookworm` where no registry is reachable (scripts/stack_check.py
# tags it with that name): Debian 12's PostgreSQL (15) with the parts of the official image's
# contract that docker-compose.yaml relies on, played by postgres-entrypoint.sh:
#   POSTGRES_USER / POSTGRES_PASSWORD / POSTGRES_DB, data in /var/lib/postgresql/data,
#   /docker-entrypoint-initdb.d/*.sql (and *.sh) run once on the first start, pg_isready on PATH.
ARG BASE_IMAGE=localhost/debian-base:bookworm
FROM ${BASE_IMAGE}

# scripts/stack_check.py rebuilds only images with this label: it never shadows a registry image.
LABEL stack-check.stand-in="true"

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The package's own cluster goes: the entrypoint makes one in PGDATA on the first start.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends postgresql \
    && rm -rf /var/lib/apt/lists/* \
    && pg_dropcluster 15 main \
    && mkdir -p /docker-entrypoint-initdb.d /var/lib/postgresql/data \
    && chown postgres:postgres /var/lib/postgresql/data

ENV PATH=/usr/lib/postgresql/15/bin:$PATH \
    PGDATA=/var/lib/postgresql/data
COPY docker/stand-ins/postgres-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
VOLUME /var/lib/postgresql/data
EXPOSE 5432
STOPSIGNAL SIGINT
ENTRYPOINT ["/usr/local/bin/docker-entrypoint.sh"]
CMD ["postgres"]
