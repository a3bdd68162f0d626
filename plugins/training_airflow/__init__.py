"""Airflow-side code of the pipeline: Params, the torchrun launcher and the task bodies.

The DAG files in ``dags/`` only wire these together. Nothing here imports torch, mlflow,
great_expectations or boto3 at module level, so DAG parsing stays fast.
"""
