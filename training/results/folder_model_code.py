"""What MLflow runs to build a model registered from its exported folder ("models from code", so
loading it unpickles nothing): the model is training.results.folder_model.FolderModel."""

from mlflow.models import set_model

from training.results.folder_model import FolderModel

set_model(FolderModel())
