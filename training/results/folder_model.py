"""The registered model of a model too large to register in MLflow's ``pt2`` flavour, as
``mlflow.pyfunc`` serves it: ``predict`` takes the model's input as an array (a table's raw feature
rows, a DataFrame of them, images, token windows) and returns its outputs, as the ``pt2`` model
would. It rebuilds the model from the exported folder (``model.safetensors`` + ``model_config.json``)
logged as its artifact; the ``training`` package travels with it as the model's code.

    loaded = mlflow.pyfunc.load_model("models:/big-table@champion")
    loaded.predict(rows)  # [n, n_classes] float32, or [n] for regression
"""

from __future__ import annotations

from typing import Any

import mlflow.pyfunc
import numpy as np

ARTIFACT = "model"  # the key of the exported folder among the pyfunc model's artifacts


class FolderModel(mlflow.pyfunc.PythonModel):
    def load_context(self, context) -> None:
        from training.checkpoint.export import load_exported

        self.model, self.spec = load_exported(context.artifacts[ARTIFACT])

    def predict(self, context, model_input, params: dict[str, Any] | None = None) -> np.ndarray:
        import pandas as pd
        import torch

        # As MLflow's pytorch flavour reads its input: a DataFrame as float32 rows, an array as it is.
        x = model_input.to_numpy(dtype=np.float32) if isinstance(model_input, pd.DataFrame) else model_input
        with torch.no_grad():
            return self.model(torch.from_numpy(np.ascontiguousarray(x))).numpy()
