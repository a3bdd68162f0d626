"""Data gate time on 1,000,000 rows x 10 columns (9 float features + an integer label).

    .venv/bin/python benchmarks/validation_bench.py [--rows 1000000] [--repeats 3]

Writes a tabular dataset (900,000 train + 100,000 validation rows) with a dataset.json, imports
Great Expectations, pandas and pyarrow first (import time is reported apart), then times
``training.validation.validate`` end to end: file sha256s, Parquet reads, the GX suite on both
splits (columns, dtypes, nulls, min/max, label set, duplicate rows, class balance). It also times
one run that builds GX Data Docs, as the ``validate_data`` task does. Goal: <= 2 s after imports.
On a shared machine wall time includes waiting for a CPU; the process CPU time and the load
average are printed next to it.
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


def write_dataset(root: Path, rows: int) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    n_val = rows // 10
    for split, n in (("train", rows - n_val), ("validation", n_val)):
        x = np.clip(rng.normal(size=(n, 9)), -5.9, 5.9).astype(np.float32)
        y = rng.integers(0, 4, size=n)
        (root / split).mkdir(parents=True)
        pq.write_table(pa.table({**{f"f{i}": x[:, i] for i in range(9)}, "label": y}), root / split / "part-00000.parquet")
    (root / "dataset.json").write_text(json.dumps({
        "kind": "tabular", "features": [f"f{i}" for i in range(9)], "feature_dtype": "float",
        "feature_range": [-6.0, 6.0], "label": "label", "n_classes": 4}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows over both splits (default 1,000,000)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs (default 3)")
    a = ap.parse_args()

    t0 = time.perf_counter()
    import great_expectations  # noqa: F401
    import pandas  # noqa: F401
    import pyarrow.parquet  # noqa: F401

    from training.validation import validate

    imports = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "data"
        write_dataset(root, a.rows)
        times, cpu, report = [], [], None
        for _ in range(a.repeats):
            t, c = time.perf_counter(), time.process_time()
            report = validate(str(root))
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        assert report["success"], report["failures"]
        t = time.perf_counter()
        validate(str(root), docs_dir=Path(tmp) / "docs")
        with_docs = time.perf_counter() - t

    print(f"rows: {sum(report['rows'].values()):,} ({report['rows']}), columns: 10")
    print(f"imports (GX, pandas, pyarrow): {imports:.2f} s")
    print(f"validate, after imports: best {min(times):.2f} s, median {statistics.median(times):.2f} s "
          f"over {a.repeats} runs (goal <= 2 s); CPU time of the process: median {statistics.median(cpu):.2f} s")
    print(f"machine load (1-min average) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"validate + GX Data Docs (as the validate_data task runs it): {with_docs:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
