"""A sweep's search checked against the base run, the backend and the policy's ``sweeps`` bounds,
before anything is spent: by the api-server's middleware (``conf_check``) and by ``open_sweep``.
Light imports at module level (the plugin loads the middleware in every Airflow process)."""

from __future__ import annotations

from typing import Any

from training.config.fields import ConfigError
from training_airflow import policy


def search_of(params: dict[str, Any]):
    from training.sweep.space import Search

    return Search(space=params["search_space"], sampler=params["sampler"], pruner=params["pruner"],
                  trials=int(params["trials"]), max_parallel_trials=int(params["max_parallel_trials"]),
                  objective=params["objective"], seed=int(params["seed"]), eval_every=int(params["eval_every"]),
                  steps=int(params["steps"]))


def base_config(params: dict[str, Any]) -> dict[str, Any]:
    """The base run as TrainConfig keyword arguments (every value a trial does not change)."""
    import dataclasses

    from training_airflow.run_config import train_config

    cfg = train_config(params)
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def check_search(params: dict[str, Any]) -> dict[str, Any]:
    """Every rule of a sweep, before anything is spent: the backend, the policy's bounds, the
    search (each value of the space on the base run); returns the distributions."""
    if params.get("backend", "local") != "local":
        raise ConfigError("backend", f"{params['backend']} trials are not supported yet: each trial reports to the "
                          "study from the worker's machine", "use backend=local")
    search = search_of(params)
    policy.check_sweep(search.trials, search.max_parallel_trials, search.steps, policy.load())
    return search.check(base_config(params))
