"""A failed trial's steps count in the sweep's ``sweep/steps_spent``: read back from what its ranks
logged to its MLflow run, 0 when it logged nothing (and never an error that hides the failure)."""

from mlflow.tracking import MlflowClient

from training_airflow import sweep_tasks


def test_a_failed_trials_steps_are_the_last_step_its_loss_was_logged_at():
    client = MlflowClient()
    exp = client.get_experiment_by_name("sweep-steps") or client.get_experiment(client.create_experiment("sweep-steps"))
    run = client.create_run(exp.experiment_id).info.run_id
    assert sweep_tasks._steps_logged(run) == 0, "a trial that failed before its first logged step spent none we know of"
    for step in (10, 20, 30):
        client.log_metric(run, "train/loss", 1.0 / step, step=step)
    assert sweep_tasks._steps_logged(run) == 30
    assert sweep_tasks._steps_logged("no-such-run") == 0
