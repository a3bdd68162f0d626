"""CPU seconds an idle Airflow takes, per part: the tests' live stack (tests/e2e/live_airflow.py:
api-server, scheduler, dag-processor, triggerer on 127.0.0.1) started once with Airflow's default
``[dag_processor] min_file_process_interval`` (30 s) and once with the tests' (3600 s: the DAG files
never change during a test session), each left idle for the same time after its DAGs are parsed.

    .venv/bin/python benchmarks/airflow_idle_cpu.py [--seconds 120]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "plugins")]


def _cpu(airflow) -> dict[str, float]:
    """CPU seconds of each part's process group so far (its reaped children, the parse processes, included)."""
    import psutil

    out = {}
    for name, proc in airflow.procs.items():
        total = 0.0
        top = psutil.Process(proc.pid)
        for p in [top, *top.children(recursive=True)]:
            try:
                c = p.cpu_times()
            except psutil.Error:
                continue
            total += c.user + c.system + c.children_user + c.children_system
        out[name] = total
    return out


def idle(interval: str | None, seconds: float) -> dict[str, float]:
    import tests.conftest  # noqa: F401  the tests' environment (loopback, a throw-away AIRFLOW_HOME)
    from tests.e2e.live_airflow import LiveAirflow

    with tempfile.TemporaryDirectory() as home:
        extra = {"AIRFLOW_HOME": home}
        airflow = LiveAirflow(Path(home), extra_env=extra)
        if interval is None:  # Airflow's own default, not the tests'
            airflow.env.pop("AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL", None)
        else:
            airflow.env["AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL"] = interval
        airflow.start()
        try:
            time.sleep(10)  # the first parse done
            before = _cpu(airflow)
            time.sleep(seconds)
            after = _cpu(airflow)
        finally:
            airflow.stop()
    return {k: after[k] - before[k] for k in before}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=120)
    args = ap.parse_args()
    rows = {"default (30 s)": idle(None, args.seconds), "tests (3600 s)": idle("3600", args.seconds)}
    print(f"CPU seconds over {args.seconds:.0f} s idle, per part:")
    for label, parts in rows.items():
        print(f"  {label:15} " + "  ".join(f"{k} {v:5.1f}" for k, v in parts.items()) + f"  | all {sum(parts.values()):5.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
