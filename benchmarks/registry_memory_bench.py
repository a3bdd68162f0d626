"""How much registering a model grows the registering process, ``pt2`` against ``pyfunc-folder``
(training/results/logged_model.py), for table models of a few sizes: each registration in a fresh
process whose libraries and tracking store are loaded first (as a worker's are), its resident set's
growth (``ru_maxrss``) and wall time, on a throw-away SQLite MLflow store. The models (an ``mlp`` of
width 4096) are written tensor by tensor, never trained.

    .venv/bin/python scripts/project_env.py .venv/bin/python benchmarks/registry_memory_bench.py [--depths 5 9]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.training.test_registry_folder import write_model  # noqa: E402

CHILD = r"""
import json, resource, sys, time
import numpy as np
folder, flavour, name = sys.argv[1:]
import mlflow.pyfunc, mlflow.pytorch, pandas, torch
from training.results import registry
from training.tracking.run import open_run
run_id = open_run(name, dag_id="bench", dag_run_id=name)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
start = time.perf_counter()
registry.register_and_gate(run_id=run_id, model_dir=folder, registered_model=name, metric_value=0.5, margin=0.0,
                           example_inputs=np.zeros((5, 16), dtype=np.float32), step=1, flavour=flavour)
print(json.dumps({"grew": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base,
                  "s": time.perf_counter() - start}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[5, 9], help="hidden layers of width 4096")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="registry-bench-") as tmp:
        env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db"}
        for depth in args.depths:
            size = write_model(Path(tmp) / f"d{depth}", depth)
            for flavour in ("pt2", "pyfunc-folder"):
                name = f"bench-{depth}-{flavour}"
                out = subprocess.run([sys.executable, "-c", CHILD, str(Path(tmp) / f"d{depth}"), flavour, name],
                                     env=env, capture_output=True, text=True, check=True)
                got = json.loads(out.stdout.strip().splitlines()[-1])
                print(json.dumps({"parameters_mib": round(size / 2**20), "flavour": flavour,
                                  "rss_growth_mib": round(got["grew"] / 2**20),
                                  "growth_per_parameter_byte": round(got["grew"] / size, 2),
                                  "seconds": round(got["s"], 1)}), flush=True)


if __name__ == "__main__":
    main()
