import gc
import runpy
import sys
from pathlib import Path

# Run from a checkout: its MLflow store and no telemetry, as for its scripts (scripts/project_env.py;
# a variable already set wins). The images have no scripts/ and take their environment as it is.
_PROJECT_ENV = Path(__file__).resolve().parents[1] / "scripts" / "project_env.py"
if _PROJECT_ENV.is_file():
    _env = runpy.run_path(str(_PROJECT_ENV))
    _env["apply"](names=_env["LIBRARY"])

from training.cli import main  # noqa: E402

code = main()
# At exit the interpreter's last garbage collection walks every object torch, sympy and MLflow
# created, after the work is done and every file is closed (docs/benchmarks.md, "What changed").
# Frozen objects are skipped; the process exits as usual otherwise (threads joined, atexit
# handlers run, buffers flushed) and the OS takes the memory back.
gc.freeze()
sys.exit(code)
