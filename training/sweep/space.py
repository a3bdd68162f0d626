"""A sweep's search space, objective, sampler and pruner, checked before any trial.

The space is JSON, a trainer field to what it may take:

- a list: the choices (``{"hidden": [32, 64, 128]}``), each one a value the field accepts;
- ``{"low": 1e-4, "high": 1e-2, "log": true}``: a range of the field's type (a float, or an int
  field's integers), sampled on a log scale with ``log``; ``step`` makes it a grid of steps.

Every value is checked by the trainer's own rules on the base run (``TrainConfig`` with it), so a
sweep whose fifth trial would be refused is refused before the first. The sampling, pruning and
bookkeeping are Optuna's (``optuna.distributions``, ``optuna.samplers``, ``optuna.pruners``):
nothing here searches by hand.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from training.config.fields import _ARTICLE, ConfigError, specs
from training.config.train_config import TASK_METRICS, TrainConfig, higher_is_better, metric_task

SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("asha", "none")
OBJECTIVES = ("auto", "eval/accuracy", "eval/loss", "eval/r2", "eval/rmse", "eval/bits_per_byte")
# Where a sweep's trials take their values from, never from the space: they say where a trial's
# files go, what it reads, or how many ranks it has (the base run's, the same for every trial).
NOT_SEARCHABLE = ("dataset_uri", "label_column", "feature_columns", "task", "text_column", "prompt_column",
                  "response_column", "messages_column", "chat_template", "validation_fraction",
                  "split_seed", "checkpoint_dir", "output_dir", "token_shards", "dataset_fingerprint", "metrics_port",
                  "metrics_host", "target_metric", "target_value", "eval_every", "steps")
FIELD = "search_space"


def _where(name: str) -> str:
    return f"{FIELD}.{name}"


def objective_for(objective: str, task: str) -> str:
    """The metric the sweep optimizes: ``auto`` is the registry gate's default for the task
    (accuracy, R², bits per byte); a metric the task does not measure is refused."""
    from training.results.registry import DEFAULT_GATE_METRIC

    if objective == "auto":
        return DEFAULT_GATE_METRIC[task]
    if metric_task(objective) not in (None, task):
        raise ConfigError("objective", f"{objective} is not measured for {task}",
                          f"use {TASK_METRICS[task]}, eval/loss or auto")
    return objective


def direction_of(metric: str) -> str:
    return "maximize" if higher_is_better(metric) else "minimize"


def distributions(space: Any, base: dict[str, Any]) -> dict[str, Any]:
    """The space as Optuna distributions, every value checked against the trainer's rules on
    ``base`` (the run's Params, as ``TrainConfig`` keyword arguments); a ConfigError names
    ``search_space.<field>`` and the fix."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if not isinstance(space, dict) or not space:
        raise ConfigError(FIELD, f"{space!r} is not a JSON object of fields", 'give each field its choices or range, '
                          'e.g. {"lr": {"low": 1e-4, "high": 1e-2, "log": true}, "hidden": [32, 64]}')
    fields = specs(TrainConfig)
    out: dict[str, Any] = {}
    for name, given in space.items():
        spec = fields.get(name)
        if spec is None or not spec.form:
            near = sorted(n for n, s in fields.items() if s.form and n not in NOT_SEARCHABLE)
            raise ConfigError(_where(name), "is not a field of the trainer", f"search one of {', '.join(near)}")
        if name in NOT_SEARCHABLE:
            raise ConfigError(_where(name), "is the same for every trial of a sweep (its data, files, budget or "
                              "objective)", "set it as the base run's parameter and search other fields")
        if isinstance(given, list):
            if not given:
                raise ConfigError(_where(name), "has no choices", "list at least one value, e.g. [32, 64]")
            if len({repr(v) for v in given}) != len(given):
                raise ConfigError(_where(name), f"lists a choice twice: {given}", "list each value once")
            for value in given:
                _check_value(name, value, base)
            out[name] = CategoricalDistribution(given)
        elif isinstance(given, dict):
            out[name] = _range(name, given, spec, base, FloatDistribution, IntDistribution)
        else:
            raise ConfigError(_where(name), f"{given!r} is neither a list of choices nor a range",
                              'write [a, b, ...] or {"low": a, "high": b} (and "log": true for a log scale)')
    return out


def _range(name: str, given: dict[str, Any], spec: Any, base: dict[str, Any], floats, ints):
    unknown = sorted(set(given) - {"low", "high", "log", "step"})
    if unknown or "low" not in given or "high" not in given:
        raise ConfigError(_where(name), f"{given!r} is not a range" + (f" (unknown keys {unknown})" if unknown else ""),
                          'write {"low": a, "high": b} with optional "log": true or "step": s')
    if spec.kind not in ("number", "integer"):
        raise ConfigError(_where(name), f"is a {spec.kind} field: a range needs numbers",
                          f"list its choices instead, e.g. {spec.choices or [spec.default]}")
    low, high, log, step = given["low"], given["high"], bool(given.get("log", False)), given.get("step")
    numeric = (int, float) if spec.kind == "number" else (int,)
    for key, v in (("low", low), ("high", high)):
        if isinstance(v, bool) or not isinstance(v, numeric) or not math.isfinite(v):
            raise ConfigError(_where(name), f"{key}={v!r} is not {_ARTICLE[spec.kind]}", f"give {key} as {_ARTICLE[spec.kind]}")
    if low >= high:
        raise ConfigError(_where(name), f"low={low} is not below high={high}", "give a low below the high")
    if log and low <= 0:
        raise ConfigError(_where(name), f"a log scale needs low > 0, not {low}", "give a positive low, or drop log")
    if log and step is not None:
        raise ConfigError(_where(name), "takes either log or step, not both", "drop one of them")
    for v in (low, high):
        _check_value(name, v, base)
    if spec.kind == "integer":
        return ints(int(low), int(high), log=log, step=int(step or 1))
    return floats(float(low), float(high), log=log, step=float(step) if step is not None else None)


def _check_value(name: str, value: Any, base: dict[str, Any]) -> None:
    """The base run with this one value must be a config the trainer accepts."""
    try:
        TrainConfig(**{**base, name: value})
    except ConfigError as e:
        raise ConfigError(_where(name), f"the value {value!r} is refused by the trainer ({e})",
                          "remove it from the search space, or change the base run so that it fits") from None
    except TypeError as e:
        raise ConfigError(_where(name), f"the value {value!r} is refused by the trainer ({e})",
                          "give a value of the field's type") from None


def grid_size(dists: dict[str, Any]) -> int | None:
    """How many points the grid sampler has (None: a continuous range, which a grid cannot take)."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    n = 1
    for d in dists.values():
        if isinstance(d, CategoricalDistribution):
            n *= len(d.choices)
        elif isinstance(d, IntDistribution) and not d.log:
            n *= (d.high - d.low) // d.step + 1
        elif isinstance(d, FloatDistribution) and d.step is not None:
            n *= int(round((d.high - d.low) / d.step)) + 1
        else:
            return None
    return n


def grid_points(dists: dict[str, Any]) -> dict[str, list]:
    """Each field's values on the grid (what ``GridSampler`` walks)."""
    from optuna.distributions import CategoricalDistribution, IntDistribution

    out = {}
    for name, d in dists.items():
        if isinstance(d, CategoricalDistribution):
            out[name] = list(d.choices)
        elif isinstance(d, IntDistribution):
            out[name] = list(range(d.low, d.high + 1, d.step))
        else:
            k = int(round((d.high - d.low) / d.step))
            out[name] = [d.low + i * d.step for i in range(k + 1)]
    return out


@dataclasses.dataclass(frozen=True)
class Search:
    """A sweep's checked settings: what is searched, how, how many trials and what is optimized."""

    space: dict[str, Any]
    sampler: str
    pruner: str
    trials: int
    max_parallel_trials: int
    objective: str  # "auto" until the data gate said what the task is
    seed: int
    eval_every: int
    steps: int

    def check(self, base: dict[str, Any]) -> dict[str, Any]:
        """Every rule a sweep has, before any trial; returns the distributions."""
        if self.sampler not in SAMPLERS:
            raise ConfigError("sampler", f"{self.sampler!r} is not a sampler", f"use one of {', '.join(SAMPLERS)}")
        if self.pruner not in PRUNERS:
            raise ConfigError("pruner", f"{self.pruner!r} is not a pruner", f"use one of {', '.join(PRUNERS)}")
        if self.objective not in OBJECTIVES:
            raise ConfigError("objective", f"{self.objective!r} is not an evaluation metric",
                              f"use one of {', '.join(OBJECTIVES)}")
        if self.trials < 1:
            raise ConfigError("trials", f"{self.trials} trials", "run at least 1 trial")
        if not 1 <= self.max_parallel_trials <= self.trials:
            raise ConfigError("max_parallel_trials", f"{self.max_parallel_trials} is not between 1 and trials="
                              f"{self.trials}", f"use 1 to {self.trials}")
        if self.pruner == "asha" and not self.eval_every:
            raise ConfigError("eval_every", "is 0, so the trials never report to the pruner (asha prunes at "
                              "evaluations)", f"set eval_every to a rung, e.g. {max(1, self.steps // 8)}, or pruner=none")
        if self.pruner == "asha" and self.eval_every >= self.steps:
            raise ConfigError("eval_every", f"{self.eval_every} is not below steps={self.steps}: a trial reaches no "
                              "rung before its end", f"use eval_every <= {max(1, self.steps // 4)}, or pruner=none")
        dists = distributions(self.space, base)
        if self.sampler == "grid":
            n = grid_size(dists)
            if n is None:
                raise ConfigError(FIELD, "holds a continuous range, which a grid cannot walk",
                                  'list choices, give the range a "step", or use sampler=tpe or random')
            if self.trials > n:
                raise ConfigError("trials", f"{self.trials} is more than the grid's {n} points",
                                  f"use trials <= {n}, or widen the space")
        return dists

    def sampler_object(self, dists: dict[str, Any]):
        import optuna

        if self.sampler == "grid":
            return _grid_class()(grid_points(dists), seed=self.seed)
        if self.sampler == "random":
            return optuna.samplers.RandomSampler(seed=self.seed)
        # constant_liar: trials running side by side are counted as bad, so two parallel asks
        # do not land on the same point (Optuna's advice for parallel TPE).
        return optuna.samplers.TPESampler(seed=self.seed, constant_liar=True,
                                          n_startup_trials=max(2, min(10, self.trials // 3)))

    def pruner_object(self):
        import optuna

        if self.pruner == "none":
            return optuna.pruners.NopPruner()
        # Asynchronous successive halving: rungs at eval_every x 2^k steps; at each rung a trial
        # goes on only if it is in the best half of the trials that reached that rung.
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=self.eval_every, reduction_factor=2,
                                                      min_early_stopping_rate=0)


@functools.lru_cache(maxsize=1)
def _grid_class():
    import optuna

    class Grid(optuna.samplers.GridSampler):
        """Optuna's grid, but a lane that tells the last point does not call ``study.stop()``
        (which only works inside ``study.optimize``): the sweep ends at its ``trials``."""

        def after_trial(self, study, trial, state, values) -> None:
            return None

    return Grid
