"""The configuration: every knob declared once (``fields.knob``), the trainer's fields and the
rules between them (``train_config.TrainConfig``). CLI, trigger form, MLflow params and docs are
generated from these declarations. Imports no other part, nor torch."""
