#!/usr/bin/env bash
# Entrypoint of the Airflow base stand-in (airflow-base.Dockerfile), with the behaviour of the
# official image's entrypoint that docker-compose.yaml meets:
# - wait until the metadata database answers (`airflow db check`, CONNECTION_CHECK_MAX_COUNT
#   tries, CONNECTION_CHECK_SLEEP_TIME apart; 0 tries skips the wait);
# - `bash ...` and `python ...` run as given; `airflow X ...` and `X ...` both run `airflow X ...`
#   (so any other program, e.g. `mlflow`, needs its own entrypoint in the compose file);
# - umask 0002 and PIP_USER unset for what runs inside.
set -euo pipefail
unset PIP_USER
umask 0002

max="${CONNECTION_CHECK_MAX_COUNT:-20}"
sleep_s="${CONNECTION_CHECK_SLEEP_TIME:-3}"
if [ "$max" -gt 0 ]; then
    for ((i = 1; ; i++)); do
        if out=$(airflow db check 2>&1); then
            break
        fi
        if [ "$i" -ge "$max" ]; then
            echo "ERROR! the metadata database did not answer after $max tries:" >&2
            echo "$out" | tail -n 20 >&2
            exit 1
        fi
        sleep "$sleep_s"
    done
fi

case "${1:-}" in
    bash) shift; exec /bin/bash "$@" ;;
    python) shift; exec python "$@" ;;
    airflow) shift ;;
    *) ;;
esac
exec airflow "$@"
