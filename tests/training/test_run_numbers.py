"""Runs compare by numbers: a run's headline one-off figures are metrics of one value, so
``mlflow.search_runs`` filters and orders runs by them numerically (a tag sorts as text: "9" > "10")."""

import mlflow
from mlflow.tracking import MlflowClient

from training.tracking.run import RunLogger, get_or_create_experiment, summary_of


def test_headline_figures_filter_and_order_runs_as_numbers():
    exp = get_or_create_experiment("numbers")
    client = MlflowClient()
    runs = {}
    for name, ttt, goodput in (("slow", 120.0, 0.91), ("fast", 9.5, 0.97), ("mid", 10.5, 0.88)):
        run_id = client.create_run(exp, run_name=name).info.run_id
        RunLogger(run_id).log_summary({"time_to_target_s": ttt, "goodput": goodput, "warmup_steps": 10.0})
        runs[name] = run_id
    RunLogger(runs["mid"]).log_summary({"time_to_target_s": 11.0})  # a re-run: the newer value counts
    assert [m.step for m in client.get_metric_history(runs["mid"], "time_to_target_s")] == [0, 1]

    found = mlflow.search_runs([exp], filter_string="metrics.time_to_target_s < 60",
                               order_by=["metrics.time_to_target_s ASC"])
    assert list(found["tags.mlflow.runName"]) == ["fast", "mid"]  # as text, "120.0" < "9.5" would sort first
    assert list(found["metrics.time_to_target_s"]) == [9.5, 11.0]
    best = mlflow.search_runs([exp], order_by=["metrics.goodput DESC"], max_results=1)
    assert best["tags.mlflow.runName"][0] == "fast"
    run = client.get_run(runs["slow"])
    assert "warmup_steps" not in run.data.metrics, "only the headline figures are metrics; all are in summary.json"
    assert summary_of(run)["time_to_target_s"] == 120.0
