"""Gradient communication that overlaps backward: DDP bucket sizes and fp16 compression, side by side.

    .venv/bin/python benchmarks/comm_bench.py [--hidden 256] [--depth 4] [--caps 25 1 0.5] [--repeats 3]

The transformer (d_model ``--hidden``, ``--depth`` blocks: 3.2M parameters, 12.6 MB of fp32
gradients at the defaults) on Markov token data, 2 gloo ranks, each point a real torchrun run of
the trainer logging to its own MLflow run (``training.results.bench``: the same sweep as
``python -m training bench --bucket-caps ... --comm-hooks none fp16 --repeats N``; ``--hooks none
powersgd`` compares PowerSGD instead: bytes per step and time to a loss both reach). Rounds
alternate every setting; figures are medians over the rounds of each run's log windows after the
first. Printed per setting: collectives per step (buckets), time a collective was in flight,
exposed time (what the step waited for after backward had no compute left), exposed / in flight
(goal <= 0.60 with >= 4 buckets; 1.0 means nothing was hidden) and samples/s; then fp16
compression's exposed time over the uncompressed one's at each bucket size, per round and the
median (goal <= 0.7).

``--link-mbit N`` runs the whole sweep inside a network namespace of its own (``unshare --net``,
root or CAP_SYS_ADMIN + CAP_NET_ADMIN) whose loopback is shaped by a token-bucket filter to N
Mbit/s: both ranks then talk over a link whose bytes cost time, as between two nodes, shared by
both directions (every packet leaves through the namespace's ``lo`` once). Plain loopback moves
bytes at memory speed, so there only the hook's casts show; nothing outside the namespace is
shaped.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _reexec_on_shaped_link(mbit: float) -> None:
    """Run this script again inside a new network namespace whose loopback is limited to ``mbit``.

    tc's token-bucket filter is the kernel's own shaper; a bucket of 1 ms at the rate (at least
    one 64 KiB loopback packet) and a queue of 200 ms keep TCP from losing packets to the shaper.
    """
    missing = [tool for tool in ("unshare", "ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"--link-mbit needs {', '.join(missing)} (util-linux, iproute2); or run without --link-mbit")
    burst = max(int(mbit * 1e6 / 8 / 1000), 65536 + 1500)
    shaped = (f"ip link set lo up && tc qdisc add dev lo root tbf rate {mbit:g}mbit burst {burst} latency 200ms "
              f'&& exec "$@"')
    env = {**os.environ, "COMM_BENCH_LINK": str(mbit)}
    try:
        os.execvpe("unshare", ["unshare", "--net", "--", "sh", "-c", shaped, "sh", sys.executable, *sys.argv], env)
    except OSError as exc:
        raise SystemExit(f"--link-mbit: could not start a network namespace ({exc}); run as root, or without "
                         "--link-mbit") from exc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--caps", type=float, nargs="+", default=[25.0, 1.0, 0.5], help="bucket_cap_mb values")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hooks", nargs="+", default=["none", "fp16"], choices=["none", "fp16", "powersgd"],
                    help="comm_hook values (powersgd: rank --powersgd-rank after 10 steps of plain all-reduce)")
    ap.add_argument("--powersgd-rank", type=int, default=4)
    ap.add_argument("--link-mbit", type=float, default=0,
                    help="emulate a link of this many Mbit/s between the ranks (0: plain loopback)")
    a = ap.parse_args()
    if a.link_mbit and os.environ.get("COMM_BENCH_LINK") != str(a.link_mbit):
        _reexec_on_shaped_link(a.link_mbit)
    work = Path(tempfile.mkdtemp(prefix="comm-bench-"))
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{work / 'mlflow.db'}"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.pop("MLFLOW_RUN_ID", None)
    from mlflow.tracking import MlflowClient

    from training.results.bench import _after_warmup, grid, run_sweep, summarize, summary_table
    from training.tracking.run import get_or_create_experiment

    data = work / "markov"
    subprocess.run([sys.executable, "-m", "training", "make-data", "--kind", "markov", "--out", str(data),
                    "--train-rows", "4000", "--val-rows", "200"], check=True, capture_output=True, cwd=ROOT)
    base = {"dataset_uri": str(data), "model": "transformer", "hidden": a.hidden, "depth": a.depth, "n_heads": 4,
            "steps": a.steps, "batch_size": a.batch_size, "log_every": 10, "checkpoint_every": 0, "eval_every": 0,
            "powersgd_rank": a.powersgd_rank}
    points, skipped = grid([2], ["ddp"], ["fp32"], a.hooks, base=base, cuda=False, bucket_caps=a.caps,
                           repeats=a.repeats)
    assert not skipped, skipped
    client = MlflowClient()
    parent = client.create_run(get_or_create_experiment("comm_bench"), run_name="comm bench").info.run_id
    load0 = os.getloadavg()[0]
    link = f"a {a.link_mbit:g} Mbit/s link (tbf on a namespace's loopback)" if a.link_mbit else "plain loopback"
    print(f"{link}; transformer d={a.hidden} x {a.depth} blocks, batch {a.batch_size}, 2 gloo ranks, {a.steps} steps, "
          f"{a.repeats} rounds of {len(points) // a.repeats} settings  [load {load0:.2f} at the start]", flush=True)
    results = run_sweep(experiment="comm_bench", parent_run_id=parent, points=points, base=base, work=work / "points",
                        echo=lambda line: None)
    print(f"[load {os.getloadavg()[0]:.2f} at the end]")
    failed = [r["point"] for r in results if r["status"] != "FINISHED"]
    if failed:
        raise SystemExit(f"points failed: {failed}; logs under {work / 'points'}")
    summary = summarize(results, client)
    print(summary_table(summary))

    print("\ngoal 1: with >= 4 buckets, exposed / in flight <= 0.60 (1.00 = nothing hidden)")
    for setting, m in summary.items():
        if setting.endswith(("-none", *(f"-none-b{c:g}" for c in a.caps))):
            verdict = "meets" if m.get("comm/collectives_per_step", 0) >= 4 and m.get("exposed/comm", 1) <= 0.6 else "-"
            print(f"  {setting:<34} {m.get('comm/collectives_per_step', 0):4.0f} buckets  exposed/comm "
                  f"{m.get('exposed/comm', float('nan')):.2f}  {verdict}")

    if "powersgd" in a.hooks and "none" in a.hooks:
        _powersgd_against_plain(client, results, points[:len(points) // a.repeats], a.caps)
    if not {"none", "fp16"} <= set(a.hooks):
        print(f"\nruns: MLflow {os.environ['MLFLOW_TRACKING_URI']} experiment comm_bench, logs under {work / 'points'}")
        return 0
    print("\ngoal 2: fp16 compression's exposed time / uncompressed, same bucket size, per round (<= 0.7)")
    exposed = {(r["setting"], r["point"]): _after_warmup(client, r["run_id"], "comm/exposed_s_per_step") for r in results}
    for cap in a.caps:
        none_key, fp16_key = (p.setting for p in points[:len(points) // a.repeats]
                              if p.bucket_cap_mb == cap and p.comm_hook in ("none", "fp16"))
        ratios = []
        for rnd in range(1, a.repeats + 1):
            suffix = f"-r{rnd}" if rnd > 1 else ""
            n, f = exposed.get((none_key, none_key + suffix)), exposed.get((fp16_key, fp16_key + suffix))
            if n and f is not None:
                ratios.append(f / n)
        if ratios:
            print(f"  bucket_cap_mb {cap:g}: rounds {' '.join(f'{x:.2f}' for x in ratios)}  median "
                  f"{statistics.median(ratios):.2f}")
    print(f"\nruns: MLflow {os.environ['MLFLOW_TRACKING_URI']} experiment comm_bench, logs under {work / 'points'}")
    return 0


def _powersgd_against_plain(client, results, settings, caps) -> None:
    """Per bucket size: the bytes a rank sends per step once compressing (after the warm-up window)
    over plain fp32's, and the time each takes to a train loss both reach (the higher of the two
    final ones): the first log window at or below it, times the run's median step time."""
    from training.results.bench import _after_warmup

    def history(run_id: str) -> list[tuple[int, float]]:
        return sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/loss"))

    print("\npowersgd against plain DDP, per round: bytes/step ratio, time to a train loss both reach")
    for cap in caps:
        plain, psgd = (next(p.setting for p in settings if p.bucket_cap_mb == cap and p.comm_hook == hook)
                       for hook in ("none", "powersgd"))
        runs = {hook: [r for r in results if r["setting"] == key] for hook, key in (("none", plain), ("powersgd", psgd))}
        for rnd, (n, c) in enumerate(zip(runs["none"], runs["powersgd"]), start=1):
            target = max(history(n["run_id"])[-1][1], history(c["run_id"])[-1][1])  # a loss both reach
            ratio = _after_warmup(client, c["run_id"], "comm/bytes_per_step") / _after_warmup(client, n["run_id"],
                                                                                                "comm/bytes_per_step")
            times = []
            for r in (n, c):
                step = next((s for s, v in history(r["run_id"]) if v <= target), None)
                step_s = _after_warmup(client, r["run_id"], "perf/step_s")
                times.append(f"{step * step_s:.1f} s (step {step})" if step else "not reached")
            print(f"  bucket_cap_mb {cap:g} round {rnd}: bytes {ratio:.4f}x; to loss {target:.4f}: plain {times[0]}, "
                  f"powersgd {times[1]}")


if __name__ == "__main__":
    sys.exit(main())
