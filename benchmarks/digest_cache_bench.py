"""A second open of a local dataset with and without the machine's cache of verified digests
(training/util.py ``sha256_cached``), one run: ``--gib`` GiB of Parquet (``--parts`` train files of
uncompressed float32 columns, one validation file), opened once to fill the cache, then
``open_dataset(..., expect_fingerprint=...)`` timed ``--rounds`` times each way, alternated:
the cache on (a stat per file) and ``TRAINING_DIGEST_CACHE=off`` (every file hashed, as before).
"warm": the files in the page cache (the best case for hashing); "cold": each file evicted from
the page cache first (``posix_fadvise(DONTNEED)`` on those files only), as a rank on a fresh node.

    .venv/bin/python scripts/project_env.py .venv/bin/python benchmarks/digest_cache_bench.py [--gib 1] [--parts 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write(root: Path, gib: float, parts: int) -> int:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    rows = int(gib * (1 << 30) / 72 / (parts + 1))  # 16 float32 columns and an int64: 72 bytes a row
    for i, name in enumerate([*(f"train/part-{p}.parquet" for p in range(parts)), "validation/part-0.parquet"]):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        x = rng.standard_normal((rows, 16), dtype=np.float32)
        table = pa.table({**{f"f{j}": x[:, j] for j in range(16)}, "label": (x[:, 0] > 0).astype(np.int64)})
        pq.write_table(table, root / name, compression="none", use_dictionary=False,
                       row_group_size=1 << 18)
    return sum(p.stat().st_size for p in root.rglob("*.parquet"))


def evict(root: Path) -> None:
    for p in root.rglob("*.parquet"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--parts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    from training import util
    from training.data.dataset import open_dataset
    from training.data.options import DataOptions

    options = DataOptions(label_column="label")
    with tempfile.TemporaryDirectory(prefix="digest-bench-") as tmp:
        os.environ["TRAINING_CACHE_DIR"] = str(Path(tmp) / "machine")
        root = Path(tmp) / "data"
        size = write(root, a.gib, a.parts)
        time.sleep(util.RACY_NS / 1e9 + 0.1)  # past the window in which a fresh file is not recorded
        t0 = time.perf_counter()
        gate = open_dataset(root, options).fingerprint
        first = time.perf_counter() - t0
        times: dict[str, list[float]] = {k: [] for k in ("warm on", "warm off", "cold on", "cold off")}
        for _ in range(a.rounds):
            for key in times:
                temp, mode = key.split()
                os.environ[util.DIGEST_CACHE_ENV] = mode
                if temp == "cold":
                    evict(root)
                before = dict(util.digest_counts)
                t0 = time.perf_counter()
                assert open_dataset(root, options, expect_fingerprint=gate).fingerprint == gate
                times[key].append(time.perf_counter() - t0)
                hits = util.digest_counts["hit"] - before.get("hit", 0)
                assert hits == (a.parts + 1 if mode == "on" else 0), (key, hits)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(json.dumps({"bytes": size, "files": a.parts + 1, "first_open_s": round(first, 3),
                          **{f"{k.replace(' ', '_')}_s": round(v, 4) for k, v in med.items()},
                          "ratio_warm": round(med["warm off"] / med["warm on"], 1),
                          "ratio_cold": round(med["cold off"] / med["cold on"], 1),
                          "rounds": {k: [round(t, 4) for t in v] for k, v in times.items()}}, indent=1))


if __name__ == "__main__":
    main()
