"""The portable model: ``model.safetensors`` + ``model_config.json``, written from the sharded
model by rank 0 and rebuilt anywhere without pickle."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from training.models.spec import ModelSpec
from training.util import atomic_write


MODEL_FILE = "model.safetensors"
MODEL_CONFIG_FILE = "model_config.json"
TOKENIZER_FILE = "tokenizer.json"  # a language model's tokenizer, exported beside it
HF_CONFIG_FILE = "config.json"  # an hf: model's: the folder is what from_pretrained loads
EXPORTED = (MODEL_FILE, MODEL_CONFIG_FILE, TOKENIZER_FILE, HF_CONFIG_FILE)  # the files of an export that exist


def export_model(model, path: str | Path, spec: ModelSpec, tokenizer_file: Path | None = None) -> None:
    """Collective: consolidate the full model on rank 0 and write safetensors + its config (and
    a language model's ``tokenizer.json``)."""
    from safetensors.torch import save_file

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if spec.is_hf:
            from training.models.hf import save_folder

            save_folder(full, spec.arch, path)
        else:
            tmp = path / (MODEL_FILE + ".tmp")
            save_file({k: v.contiguous() for k, v in full.items()}, str(tmp))
            os.replace(tmp, path / MODEL_FILE)
        atomic_write(path / MODEL_CONFIG_FILE, json.dumps(spec.to_json(), indent=2) + "\n")
        if tokenizer_file is not None:
            atomic_write(path / TOKENIZER_FILE, Path(tokenizer_file).read_text())
    dist.barrier()


def read_spec(path: str | Path) -> ModelSpec:
    """The spec of an exported model folder (its ``model_config.json``), without building the model."""
    return ModelSpec.from_json(json.loads((Path(path) / MODEL_CONFIG_FILE).read_text()))


def load_exported(path: str | Path):
    """Rebuild the model from ``model.safetensors`` + ``model_config.json`` (no pickle involved)."""
    from safetensors.torch import load_file

    from training.models.build import build_model

    path = Path(path)
    spec = read_spec(path)
    model = build_model(spec)
    if spec.is_hf:  # the folder's names are the hf model's own
        from training.models.hf import load_folder_weights

        load_folder_weights(model, path)
    else:
        model.load_state_dict(load_file(str(path / MODEL_FILE)))
    return model.eval(), spec  # for inference: dropout off
