"""Elastic scale-down recovery time of the Kubernetes backend's pods, on podman.

    .venv/bin/python benchmarks/recovery_bench.py [--rounds 3] [--last-call 5] [--steps 300] [--kill-at 60]

The scale-down scenario of tests/e2e/test_pods.py on the same harness (tests/e2e/pods.py: the
Job controller, scheduler, kubelet and Service DNS played, the pods real): two pods train with
``--nnodes 1:2`` and ``max_restarts=1``; after step ``--kill-at`` pod 1's container is SIGKILLed and
its node is gone. Recovery is the time from the SIGKILL to the first step pod 0 completes alone.

The only changes to the rendered Job: ``LOGLEVEL=INFO`` in the training container, so torchrun's
agent logs (with timestamps) when it saw the ranks fail and when the new rendezvous completed, and
``TRAINING_FAULT_COMM_DELAY_MS`` (``--comm-delay-ms``), so the kill lands mid-run.
Each round's recovery is cut into:

- ``detect``: SIGKILL -> pod 0's agent reports its rank failed (gloo sees the peer's sockets close);
- ``rendezvous``: -> the agent's new rendezvous completed (the dead node's keep-alive, then
  ``last_call_timeout``: how long a rendezvous that has its minimum waits for more nodes);
- ``start``: -> the new rank's trainer exists (process start, imports, data, process group);
- ``resume``: -> its first completed step (checkpoint load, the step itself).

``--last-call`` and ``--keep-alive`` set the rendezvous' last-call timeout and keep-alive interval
(the backend's RDZV_LAST_CALL_S and RDZV_KEEP_ALIVE_S; torch's defaults are 30 s and 5 s). Prints
one line per round, the medians, and a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tests.conftest  # noqa: E402,F401 - the test environment: a throw-away AIRFLOW_HOME, plugins on the path
from tests.e2e.pods import PlayedJob, PodsRun, start_mlflow_server  # noqa: E402

AGENT_LINE = re.compile(r"^[IWE](\d{2})(\d{2}) (\d{2}:\d{2}:\d{2}\.\d+) .*?\] (.*)$")


def agent_events(log: str, year: int) -> list[tuple[float, str]]:
    """(epoch seconds, message) of torchrun's own log lines (glog style, UTC)."""
    out = []
    for line in log.splitlines():
        m = AGENT_LINE.match(line)
        if m:
            month, day, clock, msg = m.groups()
            t = datetime.strptime(f"{year}-{month}-{day} {clock}", "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=timezone.utc)
            out.append((t.timestamp(), msg))
    return out


def first_after(events: list[tuple[float, str]], since: float, pattern: str) -> float:
    return next(t for t, msg in events if t >= since and re.search(pattern, msg))


def one_round(args, engine, image: str, dataset: Path, s3: str, mlflow: dict, root: Path) -> dict:
    run = PodsRun(engine=engine, image=image, root=root, dataset=dataset, s3_endpoint=s3, mlflow=mlflow,
                  setenv=os.environ.__setitem__, k8s_min_nodes=1, max_restarts=1, steps=args.steps,
                  checkpoint_every=args.checkpoint_every)
    try:
        run.validate()
        _, job = run.render()
        base = job["spec"]["template"]["spec"]["containers"][0]
        base["env"].append({"name": "LOGLEVEL", "value": "INFO"})
        run.slow_steps(job, args.comm_delay_ms)
        played = PlayedJob(run.cluster, job)
        run.wait_for_step(played, args.kill_at)
        run.cluster.lost_nodes.add(1)
        killed = time.time()
        played.pods[1].signal("KILL")
        played.run(timeout_s=900)
        assert played.condition == ("Complete", "SuccessPolicy"), played.describe()
        records = run.steps()
        after = next(r for r in records if r.get("restart") == 1)
        attempt_start = float(after["attempt"].split("-")[0])
        events = agent_events(played.pods[0].logs(), datetime.now(timezone.utc).year)
        failed = first_after(events, killed - 1, r"failed \(exitcode|Worker group FAILED")
        rendezvous = first_after(events, failed, r"Rendezvous complete|rendezvous.*completed|Starting worker group")
        before = max(r["step"] for r in records if r.get("restart") == 0)
        return {"recovery_s": after["t"] - killed, "detect_s": failed - killed, "rendezvous_s": rendezvous - failed,
                "start_s": attempt_start - rendezvous, "resume_s": after["t"] - attempt_start,
                "steps_lost": before - (after["step"] - 1), "resumed_at_step": after["step"] - 1}
    finally:
        run.cluster.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--last-call", type=int, default=None, help="rendezvous last_call_timeout in s (default: the backend's)")
    p.add_argument("--keep-alive", type=int, default=None,
                   help="rendezvous keep_alive_interval in s (default: the backend's; a node is dead after 3 missed)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--kill-at", type=int, default=60, help="kill pod 1 once rank 0 recorded this step")
    p.add_argument("--comm-delay-ms", type=int, default=50,
                   help="TRAINING_FAULT_COMM_DELAY_MS of the pods: the kill lands mid-run on a fast machine too")
    args = p.parse_args(argv)

    from scripts import images
    from training.data.synthetic import make_teacher_dataset
    from training.util import free_port, stop_process
    from training_airflow.backends.kubernetes import spec

    if args.last_call is not None:
        spec.RDZV_LAST_CALL_S = args.last_call
    if args.keep_alive is not None:
        spec.RDZV_KEEP_ALIVE_S = args.keep_alive
    engine = images.require_engine()
    image = images.training_image(engine, base="debian")
    tmp = Path(tempfile.mkdtemp(prefix="recovery-bench-"))
    dataset = tmp / "data" / "teacher"
    make_teacher_dataset(dataset, n_train=8_000, n_val=2_000, seed=0)
    port = free_port()
    moto = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    mlflow, mlflow_proc = start_mlflow_server(tmp / "mlflow")
    os.environ["AWS_ENDPOINT_URL"] = s3 = f"http://127.0.0.1:{port}"
    results = []
    try:
        for i in range(args.rounds):
            r = one_round(args, engine, image, dataset, s3, mlflow, tmp / f"round{i}")
            results.append(r)
            print(f"round {i + 1}: recovery {r['recovery_s']:.1f}s = detect {r['detect_s']:.1f} + rendezvous "
                  f"{r['rendezvous_s']:.1f} + start {r['start_s']:.1f} + resume {r['resume_s']:.1f}; "
                  f"{r['steps_lost']} steps lost (resumed at {r['resumed_at_step']})", flush=True)
    finally:
        stop_process(moto, 10)
        stop_process(mlflow_proc)
    med = {k: statistics.median(r[k] for r in results) for k in results[0]}
    print(f"median of {len(results)}: recovery {med['recovery_s']:.1f}s = detect {med['detect_s']:.1f} + rendezvous "
          f"{med['rendezvous_s']:.1f} + start {med['start_s']:.1f} + resume {med['resume_s']:.1f} "
          f"(last_call_timeout {spec.RDZV_LAST_CALL_S}s, keep-alive {spec.RDZV_KEEP_ALIVE_S}s x "
          f"{spec.RDZV_KEEP_ALIVE_MISSES}; load average {os.getloadavg()[0]:.1f})")
    print(json.dumps({"last_call_timeout_s": spec.RDZV_LAST_CALL_S, "keep_alive_s": spec.RDZV_KEEP_ALIVE_S,
                      "median": med, "rounds": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
