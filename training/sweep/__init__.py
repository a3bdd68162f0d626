"""Hyperparameter sweeps: the search space, the study and the pruning of trials (Optuna)."""
