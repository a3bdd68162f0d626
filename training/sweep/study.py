"""The sweep's record: an Optuna study in an RDB storage (SQLite on one machine, Postgres in the
compose stack), one per sweep run, named by the sweep's MLflow run id.

The study is what survives: a lane (a mapped Airflow task that trains trials one after another)
asks it for the next trial, resumes its own trial that was RUNNING when it was killed, and tells it
how each trial ended; a retried or restarted sweep finds every finished trial there and does not
train it again. The trainer's rank 0 reports its evaluations to the same study (``pruning.py``).
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any, Iterator

from training.sweep.space import Search

STATE_TAG = "sweep.state"


def storage(url: str):
    """Optuna's RDB storage at ``url``; SQLite waits for a lock instead of failing at once (lanes
    and ranks write to it side by side)."""
    import optuna

    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
    return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)


def sqlite_path(url: str) -> Path | None:
    return Path(url.removeprefix("sqlite:///")) if url.startswith("sqlite:///") else None


@contextlib.contextmanager
def ask_lock(url: str) -> Iterator[None]:
    """Counting the trials and asking for one must not interleave between two lanes, or a sweep
    would run more trials than it asked for: a file lock beside a SQLite file. Postgres: a
    transaction-level advisory lock (Optuna has no atomic 'ask unless full')."""
    path = sqlite_path(url)
    if path is not None:
        from filelock import FileLock

        with FileLock(str(path) + ".ask.lock", timeout=120):
            yield
        return
    if url.startswith("postgresql"):
        import sqlalchemy

        engine = sqlalchemy.create_engine(url)
        with engine.begin() as conn:
            conn.execute(sqlalchemy.text("SELECT pg_advisory_xact_lock(7254911)"))
            yield
        engine.dispose()
        return
    yield


def open_study(name: str, search: Search, dists: dict[str, Any], *, direction: str, url: str, seed_offset: int = 0):
    """The sweep's study, created the first time (its settings as user attributes), loaded after."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if (path := sqlite_path(url)) is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    search = Search(**{**vars(search), "seed": search.seed + seed_offset})
    study = optuna.create_study(study_name=name, storage=storage(url), direction=direction, load_if_exists=True,
                                sampler=search.sampler_object(dists), pruner=search.pruner_object())
    if "search" not in study.user_attrs:
        study.set_user_attr("search", {**vars(search), "direction": direction})
    return study


def next_trial(name: str, search: Search, dists: dict[str, Any], *, direction: str, url: str, lane: int):
    """This lane's next trial: its own that was RUNNING when it was killed (trained again from its
    last checkpoint), else a new one while the sweep has fewer than ``trials``; None when done."""
    import optuna
    from optuna.trial import TrialState

    with ask_lock(url):
        study = open_study(name, search, dists, direction=direction, url=url)
        # Enqueued trials (WAITING: values fixed in advance) are what ask() hands out first, not yet trials.
        trials = [t for t in study.get_trials(deepcopy=False) if t.state != TrialState.WAITING]
        for t in trials:
            if t.state == TrialState.RUNNING and t.user_attrs.get("lane") == lane:
                return study, optuna.trial.Trial(study, t._trial_id), True
        if len(trials) >= search.trials:
            return study, None, False
        # A sampler seeded by the trial's number, so that lanes in other processes do not draw the same
        # values; the grid keeps one seed (its shuffled order is the same in every lane).
        offset = 0 if search.sampler == "grid" else len(trials)
        study = open_study(name, search, dists, direction=direction, url=url, seed_offset=offset)
        trial = study.ask(dists)
        trial.set_user_attr("lane", lane)
        return study, trial, False


def trial_id(trial) -> int:
    return trial._trial_id  # the storage's key, which the trainer's rank 0 reports under


def rows(study) -> list[dict[str, Any]]:
    """One row per trial: number, state, value, steps trained, the sampled values, its MLflow run."""
    out = []
    for t in study.get_trials(deepcopy=False):
        out.append({"trial": t.number, "state": t.state.name.lower(), "value": t.value,
                    "steps": t.user_attrs.get("steps"), "pruned_at": t.user_attrs.get("pruned_at"),
                    "mlflow_run_id": t.user_attrs.get("mlflow_run_id"), **{f"params.{k}": v for k, v in t.params.items()}})
    return out


def table_markdown(rows_: list[dict[str, Any]], objective: str) -> str:
    keys = sorted({k for r in rows_ for k in r if k.startswith("params.")})
    head = ["trial", "state", objective, "steps", *[k.removeprefix("params.") for k in keys], "MLflow run"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows_:
        value = "" if r["value"] is None or not math.isfinite(r["value"]) else f"{r['value']:.4f}"
        cells = [r["trial"], r["state"], value, r["steps"] or "", *[_fmt(r.get(k)) for k in keys], r["mlflow_run_id"] or ""]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def plots(study, out: Path, objective: str) -> list[Path]:
    """The optimization history and the parallel coordinates of the sampled values (Optuna's own
    matplotlib plots), as PNG files; none while no trial completed."""
    import warnings

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.trial import TrialState
    from optuna.visualization import matplotlib as vis

    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        return []
    out.mkdir(parents=True, exist_ok=True)
    made = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
        for name, draw in (("optimization_history.png", vis.plot_optimization_history),
                           ("parallel_coordinates.png", vis.plot_parallel_coordinate)):
            ax = draw(study, target_name=objective)
            fig = (ax.flat[0] if hasattr(ax, "flat") else ax).figure
            fig.set_size_inches(9, 5)
            fig.tight_layout()
            fig.savefig(out / name, dpi=100)
            plt.close(fig)
            made.append(out / name)
    return made


def history_json(study) -> str:
    return json.dumps(rows(study), indent=2)
