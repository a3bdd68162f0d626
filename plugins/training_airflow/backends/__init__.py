"""Backends: where the ranks run. Each is a module with the same contract:

- ``train_and_commit(validated: XComArg[Validated]) -> XComArg[Handoff]``: a TaskGroup that trains
  and commits the final checkpoint to the store, handing on the same keys whatever the backend
  (``handoff.Handoff``);
- ``check_params(params) -> int``: the backend's own rules, checked by ``open_run`` before anything
  runs; returns the largest world size the run may have;
- ``memory_budget(params) -> (Budget | None, world_size)``: each rank's share of the memory it
  will run in, for the memory preflight before launch (None: the ranks check it themselves);
- ``PARAMS``: the dataclass of its fields in the trigger form, or None.

``local``: torchrun as a child of the Airflow task. ``kubernetes``: an Indexed Job of pods. The
deployment chooses which exist (``TRAINING_BACKENDS``, read when the DAGs are parsed); with more
than one, a branch follows the Param ``backend`` into one of them.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from airflow.sdk import TriggerRule, task

from training_airflow import settings


def module(name: str) -> ModuleType:
    if name not in settings.BACKENDS:
        raise ValueError(f"unknown backend {name!r}; use one of {', '.join(settings.BACKENDS)}")
    return importlib.import_module(f"training_airflow.backends.{name}")


def param_classes(names: list[str]) -> list[type]:
    """The form's dataclasses of these backends (imported without their operators)."""
    out = []
    for name in names:
        if name == "kubernetes":
            from training_airflow.backends.kubernetes.params import KubernetesParams

            out.append(KubernetesParams)
    return out


def check_params(params: dict[str, Any]) -> int:
    """The chosen backend's rules; returns the largest world size of the run."""
    return module(params.get("backend", "local")).check_params(params)


def memory_budget(params: dict[str, Any]) -> tuple[Any, int]:
    """The chosen backend's memory budget per rank and the world size it is for."""
    return module(params.get("backend", "local")).memory_budget(params)


def train_and_commit(validated: Any) -> Any:
    """The enabled backends' task groups, wired after ``validated``; returns the XComArg of the Handoff."""
    names = settings.enabled_backends()
    if len(names) == 1:
        return module(names[0]).train_and_commit(validated)

    @task.branch
    def choose_backend(validated: dict, params=None) -> str:
        return params["backend"]  # the group id: the branch follows into that group

    # The groups' results are pulled by task id: only the chosen group ran, the others were skipped.
    ends = {name: module(name).train_and_commit(validated) for name in names}

    @task(trigger_rule=TriggerRule.NONE_FAILED_MIN_ONE_SUCCESS)
    def trained(params=None, ti=None) -> dict:
        return ti.xcom_pull(task_ids=ends[params["backend"]].operator.task_id)

    choose = choose_backend(validated)
    done = trained()
    for end in ends.values():
        choose >> end.operator.task_group
        end >> done
    return done
