-- Runs once, when the Postgres volume is first initialised: the database of the sweeps' Optuna studies.
CREATE DATABASE optuna;
