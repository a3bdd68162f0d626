"""The registered model of a text run, as ``mlflow.pyfunc`` serves it: ``predict`` takes a
DataFrame with a column ``text`` and returns each row's continuation (a language model: greedy,
``params={"new_tokens": N}``) or its class (a classifier), through the tokenizer the model was
trained with. It loads the exported folder (weights, ``model_config.json``, ``tokenizer.json``)
logged as its artifact; the ``training`` package travels with it as the model's code.

    loaded = mlflow.pyfunc.load_model("models:/my-lm@champion")
    loaded.predict(pd.DataFrame({"text": ["Once upon"]}), params={"new_tokens": 20})
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlflow.pyfunc

TEXT_COLUMN = "text"
ARTIFACT = "model"  # the key of the exported folder among the pyfunc model's artifacts
NEW_TOKENS = 32  # a continuation's default length


class TextModel(mlflow.pyfunc.PythonModel):
    def load_context(self, context) -> None:
        self.model, self.spec, self.tokenizer = load_text_folder(context.artifacts[ARTIFACT])

    def predict(self, context, model_input, params: dict[str, Any] | None = None) -> list[Any]:
        if TEXT_COLUMN not in getattr(model_input, "columns", ()):
            raise ValueError(f"the input needs a column {TEXT_COLUMN!r} of text (a DataFrame)")
        texts = [str(t) for t in model_input[TEXT_COLUMN]]
        return predict_text(self.model, self.spec, self.tokenizer, texts, **(params or {}))


def load_text_folder(folder: str | Path):
    """(model, spec, tokenizer) of an exported text model's folder."""
    from training.checkpoint.export import TOKENIZER_FILE, load_exported
    from training.data.tokenizer import resolve

    folder = Path(folder)
    model, spec = load_exported(folder)
    tokenizer = resolve(str(folder / TOKENIZER_FILE), train_documents=list)  # a file: read, never trained
    return model, spec, tokenizer


def predict_text(model, spec, tokenizer, texts: list[str], *, new_tokens: int = NEW_TOKENS) -> list[Any]:
    """What the registered model answers for ``texts``, computed from the model itself.
    ``tokenizer``: a training.data.tokenizer.LoadedTokenizer."""
    import torch

    from training.data.tokens import classifier_rows, encode_documents
    from training.models.generate import continue_text

    if spec.kind == "tokens":  # a language model: the continuation
        return continue_text(model, tokenizer.tokenizer, texts, seq_len=spec.seq_len, new_tokens=int(new_tokens),
                             stop_id=tokenizer.eot_id)
    # A classifier's document, tokenized as its token shards were (the template applies, padded rows).
    ids, _ = encode_documents(texts, tokenizer, special=True)
    with torch.no_grad():
        logits = model(torch.from_numpy(classifier_rows(ids, spec.pad_id, spec.seq_len)))
    classes = spec.classes or list(range(spec.n_classes))
    return [classes[i] for i in logits.argmax(dim=-1).tolist()]
