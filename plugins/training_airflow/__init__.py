"""Airflow-side code of the pipeline, in layers (each imports only those below it; tests/test_layers.py):

- ``settings``, ``wiring``, ``conf_check``: where things live, the schedule, the enabled backends;
  ``body_task``; conf keys that are not Params, refused;
- ``handoff`` (the XCom contract), ``failures`` (bad input -> AirflowFailException), ``connections``
  (S3 settings from a connection), ``run_config`` (Params -> TrainConfig), ``mlflow_run`` (the run);
- ``assets``, ``links``, ``lifecycle``, ``inprocess_logs``: the Asset, the links between the two UIs,
  the MLflow run's status, the task logs of ``dag.test()`` runs;
- ``backends/``: one task group per backend (``local``, ``kubernetes``) with the same contract;
- ``params``: the trigger form, generated from the declared fields;
- ``tasks``, ``dataset_tasks``, ``bench_tasks``: the task bodies of the three DAGs.
"""
