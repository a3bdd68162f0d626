-- Runs once, when the Postgres volume is first initialised: a second database for MLflow.
CREATE DATABASE mlflow;
