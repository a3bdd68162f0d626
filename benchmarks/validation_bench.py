"""Data gate time on 1,000,000 rows x 10 columns (9 float features + an integer label).

    .venv/bin/python benchmarks/validation_bench.py [--rows 1000000] [--repeats 3]

Writes the same rows three ways and times ``training.data.gate.validate`` end to end on each, after
importing Great Expectations, pandas and pyarrow (import time is reported apart):

- ``inferred``: train/ and validation/ folders (900,000 + 100,000 rows), no metadata file: the
  schema, the task and the description are inferred from train, then both splits are checked;
- ``one table``: one Parquet file of all rows, split by the row hash (validation_fraction 0.1),
  then inferred and checked the same way;
- ``declared``: the folders plus a dataset.json (the gate before schema inference), the baseline.

Each: file sha256s, Parquet reads, the GX suite on both splits (columns, dtypes, nulls, min/max,
label set, duplicate rows; class balance where declared), plus the train profile and data_schema.
It also times one inferred run that builds GX Data Docs, as the ``validate_data`` task does.
Goal: <= 2 s of CPU after imports. On a shared machine wall time includes waiting for a CPU; the
process CPU time and the load average are printed next to it.
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


def write_datasets(base: Path, rows: int) -> dict[str, tuple[Path, dict]]:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    x = np.clip(rng.normal(size=(rows, 9)), -5.9, 5.9).astype(np.float32)
    table = pa.table({**{f"f{i}": x[:, i] for i in range(9)}, "label": rng.integers(0, 4, size=rows)})
    n_val = rows // 10
    folders = base / "folders"
    for split, part in (("train", table.slice(0, rows - n_val)), ("validation", table.slice(rows - n_val))):
        (folders / split).mkdir(parents=True)
        pq.write_table(part, folders / split / "part-00000.parquet")
    (base / "one").mkdir()
    pq.write_table(table, base / "one" / "table.parquet")
    declared = base / "declared"
    declared.mkdir()
    for split in ("train", "validation"):
        (declared / split).symlink_to(folders / split)
    (declared / "dataset.json").write_text(json.dumps({
        "kind": "tabular", "features": [f"f{i}" for i in range(9)], "feature_dtype": "float",
        "feature_range": [-6.0, 6.0], "label": "label", "n_classes": 4}))
    return {"inferred": (folders, {}), "one table": (base / "one" / "table.parquet", {"validation_fraction": 0.1}),
            "declared": (declared, {})}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows over both splits (default 1,000,000)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per variant (default 3)")
    a = ap.parse_args()

    t0 = time.perf_counter()
    import great_expectations  # noqa: F401
    import pandas  # noqa: F401
    import pyarrow.parquet  # noqa: F401

    from training.data.options import DataOptions
    from training.data.gate import validate

    imports = time.perf_counter() - t0
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        variants = write_datasets(Path(tmp), a.rows)
        for _ in range(a.repeats):  # interleaved, so load changes hit every variant alike
            for name, (uri, opts) in variants.items():
                t, c = time.perf_counter(), time.process_time()
                report = validate(str(uri), options=DataOptions(**opts))
                wall, cpu = time.perf_counter() - t, time.process_time() - c
                assert report["success"], report["failures"]
                results.setdefault(name, {"wall": [], "cpu": [], "rows": report["rows"]})
                results[name]["wall"].append(wall)
                results[name]["cpu"].append(cpu)
        t = time.perf_counter()
        validate(str(variants["inferred"][0]), docs_dir=Path(tmp) / "docs")
        with_docs = time.perf_counter() - t

    print(f"rows: {a.rows:,}, columns: 10; imports (GX, pandas, pyarrow): {imports:.2f} s")
    base = statistics.median(results["declared"]["cpu"])
    for name, r in results.items():
        cpu = statistics.median(r["cpu"])
        print(f"  {name:10s} {r['rows']}: CPU median {cpu:.2f} s (x{cpu / base:.2f} of declared), "
              f"wall best {min(r['wall']):.2f} s, median {statistics.median(r['wall']):.2f} s over {a.repeats} runs")
    print("goal: schema inference + gate <= 2 s of CPU after imports")
    print(f"machine load (1-min average) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"inferred + GX Data Docs (as the validate_data task runs it): {with_docs:.2f} s wall")
    return 0


if __name__ == "__main__":
    sys.exit(main())
