"""The environment of this checkout, written once: Airflow's home and this project's DAG and plugin
folders, the MLflow store, gloo on loopback, no telemetry, and the checkout's own code first on the
path (``plugins/``, then the root, so ``training`` is this checkout's).

Every script the README names applies it first, before Airflow or MLflow is imported (both read
their settings when imported); ``python -m training`` run from a checkout takes the part the library
reads (``LIBRARY``); the Makefile runs its other commands through it. A variable already set wins,
so ``AIRFLOW_HOME=... TRAINING_VAR_DIR=... make demo`` moves the state elsewhere.

    import project_env; project_env.apply()     # first thing in scripts/*.py
    python3 scripts/project_env.py CMD ARGS...   # CMD in this environment (the Makefile does this)
    eval "$(python3 scripts/project_env.py)"     # the same in your shell, for airflow or mlflow by hand
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import MutableMapping

ROOT = Path(__file__).resolve().parents[1]
PATHS = (ROOT / "plugins", ROOT)  # training_airflow and the plugin, then this checkout's training/
# What `python -m training` needs of it: the project's MLflow store, and no telemetry.
LIBRARY = ("MLFLOW_TRACKING_URI", "GX_ANALYTICS_ENABLED", "MLFLOW_ENABLE_TELEMETRY", "DO_NOT_TRACK")


def defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """The project's value of each variable. ``TRAINING_HOME`` and ``TRAINING_VAR_DIR`` move the
    state folder as they do for the tasks (plugins/training_airflow/settings.py)."""
    env = os.environ if environ is None else environ
    var = Path(env.get("TRAINING_VAR_DIR") or Path(env.get("TRAINING_HOME") or ROOT) / "var")
    return {
        "AIRFLOW_HOME": str(ROOT / ".airflow"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "MLFLOW_TRACKING_URI": f"sqlite:///{var / 'mlflow' / 'mlflow.db'}",
        "GLOO_SOCKET_IFNAME": "lo",  # the ranks of one machine talk over loopback
        # Parquet/GX/MLflow print progress bars and telemetry notices we do not want in task logs.
        "GX_ANALYTICS_ENABLED": "False",
        "MLFLOW_ENABLE_TELEMETRY": "false",
        "DO_NOT_TRACK": "true",
    }


def apply(environ: MutableMapping[str, str] | None = None, *, names: tuple[str, ...] | None = None) -> MutableMapping[str, str]:
    """Fill ``environ`` (default: this process's, which also gets the checkout's folders on
    ``sys.path``) with the project's values that are not set yet, and put ``plugins/`` and the root
    first on ``PYTHONPATH``. ``names``: only those variables (and no path)."""
    env = os.environ if environ is None else environ
    for name, value in defaults(env).items():
        if names is None or name in names:
            env.setdefault(name, value)
    if names is not None:
        return env
    ours = [str(p) for p in PATHS]
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in ours]
    env["PYTHONPATH"] = os.pathsep.join(ours + rest)
    if env is os.environ:
        for path in reversed(ours):
            if path in sys.path:
                sys.path.remove(path)
            sys.path.insert(0, path)
    return env


def main(argv: list[str]) -> int:
    env = apply(dict(os.environ))
    if not argv:  # as shell: eval "$(python3 scripts/project_env.py)"
        for name in [*defaults(env), "PYTHONPATH"]:
            print(f"export {name}={shlex.quote(env[name])}")
        return 0
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        print(f"project_env: cannot run {argv[0]}: {e}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
