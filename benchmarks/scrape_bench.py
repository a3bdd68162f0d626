"""What scraping the live metrics costs a training step, as a ratio measured in one run: a 2-rank
torchrun run serves its metrics (training/metrics/live.py) while this script scrapes both ranks at
``--rate`` requests per second each during "on" phases and not at all during "off" phases, phases
of ``--phase-s`` seconds alternating until the run ends. Each step of rank 0's ``steps.jsonl`` falls
into the phase in which it ended; the first ``--skip-s`` seconds (warm-up) count in neither.
Prints the median step time of each kind of phase, their ratio (on / off), the scrape's own median
latency and size, and the machine's 1-minute load.

    .venv/bin/python benchmarks/scrape_bench.py [--steps 6000] [--rate 20] [--phase-s 5]

Prometheus scrapes every 15-60 s in practice; 20 per second per rank is several hundred times that,
so the ratio is an upper bound of what the scrape costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from training.data.synthetic import make_teacher_dataset  # noqa: E402 (after the path is set)
from training.distributed.launch import torchrun_command  # noqa: E402
from training.util import free_port  # noqa: E402


def scraper(urls: list[str], rate: float, phases: list[tuple[float, float, bool]], stop: threading.Event,
            phase_s: float, latencies: list[float], sizes: list[int]) -> None:
    """Alternate on/off phases; during "on" fetch every URL ``rate`` times a second."""
    on = False
    while not stop.is_set():
        start = time.time()
        end = start + phase_s
        while time.time() < end and not stop.is_set():
            if on:
                for url in urls:
                    t0 = time.perf_counter()
                    try:
                        with urllib.request.urlopen(url, timeout=5) as r:
                            sizes.append(len(r.read()))
                        latencies.append(time.perf_counter() - t0)
                    except OSError:  # not serving yet, or finished
                        pass
                time.sleep(max(0.0, 1.0 / rate - (time.perf_counter() - t0)))
            else:
                time.sleep(0.05)
        phases.append((start, time.time(), on))
        on = not on


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--rate", type=float, default=20.0, help="scrapes per second per rank in the on phases")
    ap.add_argument("--phase-s", type=float, default=5.0)
    ap.add_argument("--skip-s", type=float, default=5.0, help="warm-up left out")
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="scrape-bench-") as tmp:
        tmp = Path(tmp)
        make_teacher_dataset(tmp / "data", n_train=8_000, n_val=2_000, seed=0)
        base = free_port()
        sets = [f"dataset_uri={tmp / 'data'}", f"checkpoint_dir={tmp / 'ck'}", f"output_dir={tmp / 'out'}",
                f"steps={args.steps}", f"batch_size={args.batch_size}", "log_every=50", "checkpoint_every=0",
                f"metrics_port={base}"]
        cmd = torchrun_command([a for s in sets for a in ("--set", s)], nproc_per_node=2, master_port=free_port())
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        env.pop("MLFLOW_RUN_ID", None)
        phases: list[tuple[float, float, bool]] = []
        latencies: list[float] = []
        sizes: list[int] = []
        stop = threading.Event()
        urls = [f"http://127.0.0.1:{base + r}/metrics" for r in (0, 1)]
        thread = threading.Thread(target=scraper, args=(urls, args.rate, phases, stop, args.phase_s, latencies, sizes),
                                  daemon=True)
        with open(tmp / "torchrun.log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
            thread.start()
            code = proc.wait()
        stop.set()
        thread.join()
        if code != 0:
            sys.exit(f"torchrun exited {code}:\n{(tmp / 'torchrun.log').read_text()[-3000:]}")
        records = [json.loads(line) for line in (tmp / "out" / "steps.jsonl").read_text().splitlines()]

    first = records[0]["t"] + args.skip_s
    on, off = [], []
    for r in records:
        if r["t"] < first:
            continue
        for start, end, scraping in phases:
            if start <= r["t"] < end:
                (on if scraping else off).append(r["step_s"])
                break
    if not on or not off:
        sys.exit("the run was too short for both kinds of phase: raise --steps")
    on_ms, off_ms = 1000 * statistics.median(on), 1000 * statistics.median(off)
    print(f"date {time.strftime('%Y-%m-%d')} | load {os.getloadavg()[0]:.1f} | {len(records)} steps, 2 ranks, "
          f"batch {args.batch_size} | scraping {args.rate:g}/s per rank in {args.phase_s:g}s phases")
    print(f"step time median: scraped {on_ms:.3f} ms ({len(on)} steps), not scraped {off_ms:.3f} ms ({len(off)} steps) "
          f"| ratio {on_ms / off_ms:.3f}")
    print(f"step time mean:   scraped {1000 * statistics.mean(on):.3f} ms, not scraped {1000 * statistics.mean(off):.3f} ms "
          f"| ratio {statistics.mean(on) / statistics.mean(off):.3f}")
    if latencies:
        print(f"scrape: {len(latencies)} requests, median {1000 * statistics.median(latencies):.2f} ms, "
              f"{statistics.median(sizes)} bytes")


if __name__ == "__main__":
    main()
