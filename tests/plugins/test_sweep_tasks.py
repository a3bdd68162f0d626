"""A failed trial's steps count in the sweep's ``sweep/steps_spent``: read back from what its ranks
logged to its MLflow run, 0 when it logged nothing (and never an error that hides the failure). A
lane's name in the grid says how its trials ended, within what Airflow keeps."""

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


def test_a_lanes_name_says_how_each_trial_ended_and_fits_airflows_column():
    ran = {"lane": 1, "trials": [{"trial": 1, "state": "pruned", "steps": 10}, {"trial": 3, "state": "complete", "steps": 40},
                                 {"trial": 4, "state": "failed", "steps": 7}]}
    assert sweep_tasks.lane_label(ran) == "lane 1: trial 1 pruned at step 10, trial 3 complete, trial 4 failed at step 7"
    assert sweep_tasks.lane_label({"lane": 0, "trials": []}) == "lane 0: no trial left to train"
    many = sweep_tasks.lane_label({"lane": 0, "trials": [{"trial": i, "state": "complete", "steps": 40} for i in range(100)]})
    assert len(many) == 200 and many.startswith("lane 0: trial 0 complete") and many.endswith("\u2026")
