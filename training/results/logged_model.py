"""How an exported model folder is logged to an MLflow run, and why that way (``choose_flavour``):

- ``pt2``: the whole model loaded and exported by ``torch.export`` (MLflow's pytorch flavour), with
  an input example, the signature of its real output and the two source files as extra files;
- ``pyfunc-folder``: a model too large to load here, as pyfunc from code
  (``folder_model_code.py``) whose artifact is the exported folder (a file copy); its signature
  comes from the model built on the meta device, so no weight is read;
- ``pyfunc-text``: a text model as pyfunc from code (``text_model_code.py``): text in, text or
  classes out, through its tokenizer.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

TAG_FLAVOUR = "registry.flavour"
PT2, FOLDER, TEXT = "pt2", "pyfunc-folder", "pyfunc-text"
FLAVOURS = ("auto", PT2, FOLDER)  # the choices of the field registry_flavour
# pt2 grows the process by about 2.5 times the parameter bytes (docs/benchmarks.md, "Registering a
# model"): auto allows it a quarter of the memory left, room for the baseline it also adds.
PT2_SHARE = 4


@dataclass(frozen=True)
class Flavour:
    """How a model is logged, and why: ``pt2`` (the whole model loaded and exported), ``pyfunc-folder``
    (pyfunc from code around the exported folder, never loaded here) or ``pyfunc-text`` (a text
    model; ``load``: its example output is computed by the loaded model, else from its spec)."""

    name: str
    load: bool
    reason: str
    parameter_bytes: int
    bound: int

    def tags(self) -> dict[str, str]:
        return {TAG_FLAVOUR: self.name, f"{TAG_FLAVOUR}_reason": self.reason,
                "registry.parameter_bytes": str(self.parameter_bytes), "registry.pt2_bound_bytes": str(self.bound)}


def choose_flavour(model_dir: str | Path, choice: str = "auto", *, bound: int | None = None) -> Flavour:
    """``choice`` (the field ``registry_flavour``): ``pt2``, ``pyfunc-folder``, or ``auto``: ``pt2``
    when the model's parameter bytes (its safetensors header, no tensor read) are at most ``bound``,
    by default a share of the memory this process may still take (its cgroup limit less its
    working set, else MemAvailable), else ``pyfunc-folder``. A text model is always ``pyfunc-text``."""
    from training.checkpoint.export import TOKENIZER_FILE, read_spec, tensor_bytes

    if choice not in FLAVOURS:
        from training.config.fields import ConfigError

        raise ConfigError("registry_flavour", f"unknown flavour {choice!r}", f"use one of {', '.join(FLAVOURS)}")
    model_dir = Path(model_dir)
    size = tensor_bytes(model_dir)
    where = "given"
    if bound is None:
        from training.metrics.preflight import local_budget

        budget = local_budget(1)
        bound = budget.per_rank // PT2_SHARE
        where = f"1/{PT2_SHARE} of the {_mib(budget.per_rank)} this process may still use: {budget.source}"
    fits = size <= bound
    load = choice == PT2 or (choice == "auto" and fits)
    why = (f"parameters {_mib(size)} {'<=' if fits else '>'} the pt2 bound {_mib(bound)} ({where})"
           if choice == "auto" else f"registry_flavour={choice}")
    spec = read_spec(model_dir)
    if spec.kind in ("tokens", "text") and (model_dir / TOKENIZER_FILE).is_file():
        how = "its example output computed by the model" if load else "not loaded: its signature from its spec"
        return Flavour(TEXT, load, f"a text model, {how}; {why}", size, bound)
    if load:
        return Flavour(PT2, True, f"the whole model exported by torch.export; {why}", size, bound)
    return Flavour(FOLDER, False, f"pyfunc from code around the exported folder, never loaded whole here; {why}",
                   size, bound)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def log_model(run_id: str, model_dir: str | Path, *, example_inputs, step: int, flavour: Flavour | None = None):
    """Log the exported model of ``model_dir`` to the run as ``flavour`` chooses (default:
    ``choose_flavour(model_dir)``); returns MLflow's ModelInfo."""
    import mlflow.pytorch
    import numpy as np
    import torch
    from mlflow.models import infer_signature
    from mlflow.tracking import MlflowClient

    from training.checkpoint.export import EXPORTED, load_exported

    model_dir = Path(model_dir)
    flavour = flavour or choose_flavour(model_dir)
    experiment_id = MlflowClient().get_run(run_id).info.experiment_id
    if flavour.name == TEXT:
        with _experiment(experiment_id):
            return _log_text_model(run_id, model_dir, step=step, load=flavour.load)
    if flavour.name == FOLDER:
        with _experiment(experiment_id):
            return _log_folder_model(run_id, model_dir, example_inputs=example_inputs, step=step)
    model, spec = load_exported(model_dir)
    example = np.ascontiguousarray(example_inputs)
    with torch.no_grad():
        output = model(torch.from_numpy(example)).numpy()
    with _experiment(experiment_id):
        return mlflow.pytorch.log_model(
            model,
            name="model",
            run_id=run_id,
            step=step,
            input_example=example,
            signature=infer_signature(example, output),
            serialization_format="pt2",
            # Pinned instead of inferred: inference imports the model in a subprocess (slow) and
            # would list this machine's whole environment.
            pip_requirements=_requirements(),
            extra_files=[str(model_dir / name) for name in EXPORTED if (model_dir / name).is_file() and "/" not in name],
            metadata={"model_config": json.dumps(spec.to_json())},
        )


def _requirements(*more: str) -> list[str]:
    import torch

    return [f"torch=={torch.__version__.split('+')[0]}", "numpy", *more]


def _log_folder_model(run_id: str, model_dir: Path, *, example_inputs, step: int):
    """A model too large to load here as ``mlflow.pyfunc`` from code (training/results/folder_model_code.py):
    the exported folder is its artifact (a file copy), its signature comes from running the example
    through the model built on the meta device (shapes only), and MLflow's check of the example,
    which loads the model, is skipped."""
    import numpy as np
    import pandas as pd
    import safetensors
    from mlflow.models import Model, infer_signature

    import training
    from training.checkpoint.export import read_spec
    from training.results.folder_model import ARTIFACT

    spec = read_spec(model_dir)
    example = np.ascontiguousarray(example_inputs)
    code = Path(training.__file__).parent
    return Model.log(
        artifact_path=None, flavor=_UncheckedPyfunc, name="model", run_id=run_id, step=step,
        python_model=str(code / "results" / "folder_model_code.py"), artifacts={ARTIFACT: str(model_dir)},
        code_paths=[str(code)], signature=infer_signature(example, _output_without_weights(spec, example)),
        input_example=example, validate_serving_input=False,
        pip_requirements=_requirements(f"safetensors=={safetensors.__version__}", f"pandas=={pd.__version__}"),
        metadata={"model_config": json.dumps(spec.to_json())})


class _UncheckedPyfunc:
    """``mlflow.pyfunc`` for ``Model.log`` with its serving-input check turned off: that check loads
    the model and runs the example (the whole model in this process); ``pyfunc.save_model`` refuses
    the switch, so it is taken off here (MLflow's transformers flavour turns it off for the same reason)."""

    __name__ = "mlflow.pyfunc"

    @staticmethod
    def save_model(*, validate_serving_input: bool = True, **kwargs):
        import mlflow.pyfunc

        return mlflow.pyfunc.save_model(**kwargs)


def _output_without_weights(spec, example):
    """What the model gives for ``example``, as zeros of its shape and dtype: the model built on the
    meta device runs it (no weight is read), or, where it cannot run there, the spec's output shape
    in float32."""
    import numpy as np
    import torch

    from training.models.build import build_model

    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):  # not even one tensor allocated
            model = build_model(spec, meta=True).to("meta").eval()
        with torch.no_grad():
            out = model(torch.from_numpy(example).to("meta"))
        shape, dtype = tuple(out.shape), torch.empty((), dtype=out.dtype).numpy().dtype
    except Exception as e:  # a factory model that needs real tensors
        log.info("the model does not run on the meta device (%s); its output shape comes from its spec", e)
        shape, dtype = (len(example), *spec.output_shape), np.dtype("float32")
    return np.zeros(shape, dtype=dtype)


def _log_text_model(run_id: str, model_dir: Path, *, step: int, load: bool = True):
    """A text model as ``mlflow.pyfunc`` from code (training/results/text_model_code.py): text in,
    continuations or classes out, through the tokenizer exported beside it; the exported folder
    is its artifact, the ``training`` package its code. ``load=False``: the model is not loaded
    here; its example output is of the type its spec gives (a continuation, a class) and MLflow's
    check of the example, which loads it, is skipped."""
    import mlflow.pyfunc
    import pandas as pd
    import safetensors
    import tokenizers
    import torch
    from mlflow.models import Model, infer_signature

    import training
    from training.checkpoint.export import read_spec
    from training.results.text_model import ARTIFACT, NEW_TOKENS, TEXT_COLUMN, load_text_folder, predict_text

    example = pd.DataFrame({TEXT_COLUMN: ["The ", "A"]})
    if load:
        model, spec, tokenizer = load_text_folder(model_dir)
        output = predict_text(model, spec, tokenizer, list(example[TEXT_COLUMN]), new_tokens=4)
    else:
        spec = read_spec(model_dir)
        output = [""] * len(example) if spec.kind == "tokens" else [(spec.classes or [0])[0]] * len(example)
    params = {"new_tokens": NEW_TOKENS} if spec.kind == "tokens" else None
    requirements = [f"torch=={torch.__version__.split('+')[0]}", f"tokenizers=={tokenizers.__version__}",
                    f"safetensors=={safetensors.__version__}", "numpy", "pandas"]
    if spec.is_hf:
        import transformers

        requirements.append(f"transformers=={transformers.__version__}")
    code = Path(training.__file__).parent
    # Model.log: pyfunc.log_model has no run_id (it logs to the fluent active run; we log by id).
    return Model.log(
        artifact_path=None, flavor=mlflow.pyfunc if load else _UncheckedPyfunc, name="model", run_id=run_id,
        step=step, python_model=str(code / "results" / "text_model_code.py"), artifacts={ARTIFACT: str(model_dir)},
        code_paths=[str(code)],
        signature=infer_signature(example, output, params=params), input_example=example,
        pip_requirements=requirements, metadata={"model_config": json.dumps(spec.to_json())},
        **({} if load else {"validate_serving_input": False}))


@contextlib.contextmanager
def _experiment(experiment_id: str):
    """MLflow files a logged model under the *active* experiment, not under its source run's
    (``_create_logged_model`` looks only at the fluent active run). We log through the client
    without an active run, so point MLflow's own variable at the run's experiment meanwhile."""
    old = os.environ.get("MLFLOW_EXPERIMENT_ID")
    os.environ["MLFLOW_EXPERIMENT_ID"] = experiment_id
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MLFLOW_EXPERIMENT_ID", None)
        else:
            os.environ["MLFLOW_EXPERIMENT_ID"] = old
