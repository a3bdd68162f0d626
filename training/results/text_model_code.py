"""What MLflow runs to build a registered text model ("models from code", so loading it unpickles
nothing): the model is training.results.text_model.TextModel."""

from mlflow.models import set_model

from training.results.text_model import TextModel

set_model(TextModel())
