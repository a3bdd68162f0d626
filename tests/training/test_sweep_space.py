"""A sweep's search, checked before any trial: bad spaces are refused naming the field and the fix;
the study hands each lane its interrupted trial first, never more trials than asked, and lanes in
separate processes do not draw the same values. No training here (the DAG's test trains)."""

import multiprocessing

import optuna
import pytest

from training.config.fields import ConfigError
from training.sweep.space import Search, direction_of, objective_for
from training.sweep.study import next_trial, open_study

BASE = {"dataset_uri": "/data", "model": "mlp", "steps": 100, "eval_every": 10}


def _search(space, **kw) -> Search:
    values = dict(space=space, sampler="tpe", pruner="asha", trials=6, max_parallel_trials=2, objective="auto",
                  seed=0, eval_every=10, steps=100)
    return Search(**{**values, **kw})


@pytest.mark.parametrize("space, field, says", [
    ({"no_such": [1, 2]}, "search_space.no_such", "not a field of the trainer"),
    ({"steps": [10, 20]}, "search_space.steps", "the same for every trial"),
    ({"dataset_uri": ["/a", "/b"]}, "search_space.dataset_uri", "the same for every trial"),
    ({"lr": {"low": 1e-2, "high": 1e-3}}, "search_space.lr", "low=0.01 is not below high=0.001"),
    ({"lr": {"low": 0.0, "high": 1e-2, "log": True}}, "search_space.lr", "a log scale needs low > 0"),
    ({"lr": {"low": -1.0, "high": 1e-2}}, "search_space.lr", "refused by the trainer"),
    ({"hidden": [64, 0]}, "search_space.hidden", "the value 0 is refused by the trainer"),
    ({"hidden": {"low": 16.5, "high": 64}}, "search_space.hidden", "is not an integer"),
    ({"strategy": ["ddp", "zero3"]}, "search_space.strategy", "'zero3' is refused"),
    ({"strategy": {"low": 1, "high": 2}}, "search_space.strategy", "a range needs numbers"),
    ({"hidden": []}, "search_space.hidden", "has no choices"),
    ({"hidden": [64, 64]}, "search_space.hidden", "lists a choice twice"),
    ({"lr": {"low": 1e-4, "hi": 1e-2}}, "search_space.lr", "is not a range"),
    ({"lr": 0.01}, "search_space.lr", "neither a list of choices nor a range"),
    ([], "search_space", "not a JSON object"),
])
def test_a_bad_space_is_refused_naming_the_field(space, field, says):
    with pytest.raises(ConfigError) as err:
        _search(space).check(BASE)
    assert err.value.field == field and says in str(err.value) and "Fix:" in str(err.value), str(err.value)


@pytest.mark.parametrize("kw, field, says", [
    (dict(sampler="bayes"), "sampler", "not a sampler"),
    (dict(trials=0), "trials", "at least 1"),
    (dict(max_parallel_trials=7), "max_parallel_trials", "between 1 and trials=6"),
    (dict(eval_every=0), "eval_every", "never report to the pruner"),
    (dict(eval_every=100), "eval_every", "reaches no rung"),
    (dict(sampler="grid"), "search_space", "continuous range"),
    (dict(sampler="grid", space={"hidden": [32, 64]}), "trials", "more than the grid's 2 points"),
])
def test_bad_sweep_settings_are_refused(kw, field, says):
    with pytest.raises(ConfigError) as err:
        _search(kw.pop("space", {"lr": {"low": 1e-4, "high": 1e-2, "log": True}}), **kw).check(BASE)
    assert err.value.field == field and says in str(err.value), str(err.value)


def test_a_good_space_becomes_optuna_distributions():
    dists = _search({"lr": {"low": 1e-4, "high": 1e-2, "log": True}, "hidden": [32, 64],
                     "depth": {"low": 1, "high": 4}}).check(BASE)
    assert dists["lr"] == optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)
    assert dists["hidden"] == optuna.distributions.CategoricalDistribution([32, 64])
    assert dists["depth"] == optuna.distributions.IntDistribution(1, 4)
    grid = _search({"hidden": [32, 64], "depth": {"low": 1, "high": 3}}, sampler="grid", trials=6).check(BASE)
    assert len(grid) == 2


def test_the_objective_follows_the_task():
    assert objective_for("auto", "classification") == "eval/accuracy"
    assert objective_for("auto", "regression") == "eval/r2"
    assert objective_for("auto", "language_modeling") == "eval/bits_per_byte"
    assert direction_of("eval/accuracy") == "maximize" and direction_of("eval/loss") == "minimize"
    with pytest.raises(ConfigError, match="objective.*eval/accuracy is not measured for regression"):
        objective_for("eval/accuracy", "regression")


def _ask(url: str, lane: int, queue) -> None:
    search = _search({"lr": {"low": 1e-4, "high": 1e-2, "log": True}}, sampler="random", trials=4)
    dists = search.check(BASE)
    _, trial, _ = next_trial("s", search, dists, direction="maximize", url=url, lane=lane)
    queue.put(trial.params["lr"])


def _random_search():
    search = _search({"lr": {"low": 1e-4, "high": 1e-2, "log": True}}, sampler="random", trials=4)
    return search, search.check(BASE)


@pytest.mark.slow  # two processes
def test_two_lanes_asking_at_once_get_two_trials_with_different_values(tmp_path):
    url = f"sqlite:///{tmp_path / 'sweeps.db'}"
    search, dists = _random_search()
    open_study("s", search, dists, direction="maximize", url=url)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_ask, args=(url, lane, queue)) for lane in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    drawn = sorted(queue.get(timeout=5) for _ in procs)
    assert drawn[0] != drawn[1]
    study = optuna.load_study(study_name="s", storage=url)
    assert sorted(t.user_attrs["lane"] for t in study.trials) == [0, 1]


def test_the_study_resumes_a_lanes_trial_and_never_runs_more_than_asked(tmp_path):
    url = f"sqlite:///{tmp_path / 'sweeps.db'}"
    search, dists = _random_search()
    first = [next_trial("s", search, dists, direction="maximize", url=url, lane=lane)[1] for lane in (0, 1)]
    assert first[0].params["lr"] != first[1].params["lr"]  # the sampler is seeded by the trial's number
    # Lane 0's trial was RUNNING when its process died: lane 0 gets it back, lane 1 gets its own.
    study, trial, resumed = next_trial("s", search, dists, direction="maximize", url=url, lane=0)
    assert resumed and trial.number == first[0].number and trial.params == first[0].params
    study.tell(trial, 0.5)
    _, other, resumed = next_trial("s", search, dists, direction="maximize", url=url, lane=1)
    assert resumed and other.number == first[1].number
    study.tell(other, 0.6)
    # Two more new trials, then the sweep is full: no fifth trial for anyone.
    for lane in (0, 1):
        study, t, resumed = next_trial("s", search, dists, direction="maximize", url=url, lane=lane)
        assert not resumed
        study.tell(t, 0.1)
    assert next_trial("s", search, dists, direction="maximize", url=url, lane=0)[1] is None
    assert len(study.trials) == 4 and study.best_value == 0.6
    # An enqueued trial (values fixed in advance) is handed out first and counts once it is asked.
    other_search = Search(**{**vars(search), "trials": 1})
    s2 = open_study("s2", other_search, dists, direction="maximize", url=url)
    s2.enqueue_trial({"lr": 0.005})
    _, t, _ = next_trial("s2", other_search, dists, direction="maximize", url=url, lane=0)
    assert t.params == {"lr": 0.005}
    s2.tell(t, 1.0)
    assert next_trial("s2", other_search, dists, direction="maximize", url=url, lane=0)[1] is None
