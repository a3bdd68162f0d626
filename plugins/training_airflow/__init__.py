"""Airflow-side code of the pipeline, in layers (each imports only those below it):

- ``settings``: where things live, the schedule, the enabled backends;
- ``context``: what every task shares (the XCom contract, Params -> TrainConfig, the MLflow run,
  S3 settings from a connection, bad input -> AirflowFailException);
- ``params``: the trigger form, generated from the declared fields;
- ``backends/``: one task group per backend (``local``, ``kubernetes``) with the same contract;
- ``tasks``: the backend-independent task bodies (data gate, evaluate, register, report);
- ``bench_tasks``, ``dataset_tasks``, ``assets``: the other two DAGs.
"""
