#!/bin/bash
# The official postgres image's start-up contract, for the stand-in (postgres.Dockerfile):
# on an empty data folder, initdb with POSTGRES_USER as superuser and POSTGRES_PASSWORD
# (scram-sha-256), create POSTGRES_DB, run /docker-entrypoint-initdb.d/*.sql and *.sh against it
# on a server reachable only through its socket; then run `postgres` listening on every interface
# of the container, as the postgres user. Any other command is run as given.
set -euo pipefail

if [ "${1:-}" != "postgres" ]; then
    exec "$@"
fi

: "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD must be set}"
POSTGRES_USER="${POSTGRES_USER:-postgres}"
POSTGRES_DB="${POSTGRES_DB:-$POSTGRES_USER}"
export PGDATA="${PGDATA:-/var/lib/postgresql/data}"
as_postgres() { setpriv --reuid=postgres --regid=postgres --init-groups "$@"; }

mkdir -p "$PGDATA" /var/run/postgresql
chown postgres:postgres "$PGDATA" /var/run/postgresql
chmod 700 "$PGDATA"
chmod 3777 /var/run/postgresql

if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile=$(mktemp)
    printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
    chown postgres "$pwfile"
    as_postgres initdb --username="$POSTGRES_USER" --pwfile="$pwfile" --auth-local=trust \
        --auth-host=scram-sha-256 --encoding=UTF8 --locale=C.UTF-8 >/dev/null
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    as_postgres pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
    psql=(psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --no-password --dbname postgres)
    if [ "$POSTGRES_DB" != "postgres" ]; then
        as_postgres "${psql[@]}" -q -c "CREATE DATABASE \"$POSTGRES_DB\""
    fi
    for f in /docker-entrypoint-initdb.d/*; do
        case "$f" in
            *.sql) echo "running $f"; as_postgres "${psql[@]}" --dbname "$POSTGRES_DB" -f "$f" ;;
            *.sh) echo "running $f"; as_postgres bash "$f" ;;
            *) ;;
        esac
    done
    as_postgres pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
    echo "database initialised in $PGDATA"
fi

exec setpriv --reuid=postgres --regid=postgres --init-groups postgres -D "$PGDATA" -c listen_addresses='*' "${@:2}"
