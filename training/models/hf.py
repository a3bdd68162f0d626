"""Hugging Face ``transformers`` models: ``model=hf:<folder or s3:// prefix>`` names a checkpoint
folder as ``save_pretrained`` writes it (``config.json``, ``model.safetensors`` if there are
weights, the tokenizer's files). A causal LM for text without a label, sequence classification
with one. With weights it fine-tunes from them, with ``config.json`` alone it starts from random
weights. Nothing is ever downloaded: a hub id is refused. ``HFModel`` wraps the model so that it
maps token ids to logits like the built-ins; FSDP shards its ``_no_split_modules`` blocks. The
export is a folder ``from_pretrained`` loads (``config.json`` and ``model.safetensors`` under the
model's own names, beside ``model_config.json``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from training.config.fields import ConfigError

PREFIX = "hf:"
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
FOLDER_FILES = (CONFIG, WEIGHTS, "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "generation_config.json")


def is_hf(model: str) -> bool:
    return model.startswith(PREFIX)


def folder(model: str, env: Mapping[str, str] | None = None) -> Path:
    """The checkpoint folder ``hf:...`` names, on this machine: a local folder, or an ``s3://``
    prefix downloaded once into the data cache. A name that is neither (a hub id) is refused."""
    uri = model.removeprefix(PREFIX)
    if uri.startswith("s3://"):
        from training.data.sources import cache_dir
        from training.store import open_store

        store = open_store(uri, env, field="model")
        if store.stat(CONFIG) is None:
            raise ConfigError("model", f"{uri} holds no {CONFIG}", "upload the folder save_pretrained wrote there")
        import hashlib

        local = cache_dir() / "hf" / hashlib.sha256(json.dumps([uri, store.get_bytes(CONFIG).decode()]).encode()).hexdigest()[:32]
        local.mkdir(parents=True, exist_ok=True)
        for name in FOLDER_FILES:
            st = store.stat(name)
            if st is not None and not ((local / name).is_file() and (local / name).stat().st_size == st["size"]):
                tmp = local / f"{name}.partial-{os.getpid()}"
                store.get_file(name, tmp)
                os.replace(tmp, local / name)
        return local
    path = Path(uri.removeprefix("file://"))
    if not (path / CONFIG).is_file():
        hub = "/" not in uri and not path.exists()
        raise ConfigError("model", f"{model}: {path} is not a folder with a {CONFIG}" + (
            " (a model hub id? nothing is downloaded here)" if hub else ""),
            "download it first (e.g. huggingface-cli download ID --local-dir DIR, or save_pretrained) and give "
            "model=hf:DIR or an s3:// prefix of that folder")
    return path


def default_tokenizer(model: str, env: Mapping[str, str] | None = None) -> str:
    """The tokenizer a run takes when its ``tokenizer`` field is empty: an hf model's own (its
    folder's tokenizer.json), else ``bytes``."""
    return str(folder(model, env)) if is_hf(model) else "bytes"


def hf_config(model: str, *, task: str, n_classes: int, pad_id: int | None, classes: list[Any] | None = None,
              env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The ``arch`` of an hf model's spec: its ``config.json`` as the model to build (a classifier's
    ``num_labels``, its classes as ``id2label``/``label2id`` and padding set), the class to build and
    whether the folder has weights."""
    from transformers import AutoConfig

    where = folder(model, env)
    config = AutoConfig.from_pretrained(where, local_files_only=True)
    head = "sequence_classification" if task == "classification" else "causal_lm"
    if head == "sequence_classification":
        config.num_labels = n_classes
        if classes is not None:  # after num_labels, which resets them to LABEL_0...
            config.id2label = {i: str(c) for i, c in enumerate(classes)}
            config.label2id = {str(c): i for i, c in enumerate(classes)}
        if pad_id is not None and pad_id < config.vocab_size:
            config.pad_token_id = pad_id
    return {"hf_config": config.to_dict(), "hf_head": head, "pretrained": (where / WEIGHTS).is_file()}


def _config(arch: dict[str, Any]):
    from transformers import AutoConfig

    d = dict(arch["hf_config"])
    return AutoConfig.for_model(d.pop("model_type"), **d)


class HFModel(nn.Module):
    """A ``transformers`` model mapping token ids to logits: a causal LM's per position, a
    classifier's per row (padding masked; ids past the model's vocabulary read as ``fill_id``)."""

    def __init__(self, arch: dict[str, Any], *, pad_id: int | None = None, fill_id: int = 0,
                 pretrained_from: Path | None = None):
        super().__init__()
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        cls = AutoModelForSequenceClassification if arch["hf_head"] == "sequence_classification" else AutoModelForCausalLM
        config = _config(arch)
        if arch["hf_head"] == "sequence_classification" and config.pad_token_id is None:
            config.pad_token_id = fill_id  # where a GPT-style classifier finds each row's last token
        if pretrained_from is not None:
            self.model = cls.from_pretrained(pretrained_from, config=config, local_files_only=True, dtype=torch.float32)
        else:
            self.model = cls.from_config(config, dtype=torch.float32)
        self.classifier = arch["hf_head"] == "sequence_classification"
        self.pad_id, self.fill_id = pad_id, config.pad_token_id if self.classifier else fill_id

    def init_module(self, _name: str, m: nn.Module) -> None:
        """The model's own ``_init_weights`` of one module (weights materialised after sharding)."""
        if m is not self:
            self.model._init_weights(m)

    @property
    def fsdp_units(self) -> list[nn.Module]:
        names = set(getattr(self.model, "_no_split_modules", None) or ())
        return [m for m in self.model.modules() if type(m).__name__ in names]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if not self.classifier:
            return self.model(input_ids=idx, use_cache=False).logits
        real = idx != self.pad_id
        ids = idx.masked_fill(~real, self.fill_id)
        return self.model(input_ids=ids, attention_mask=real.long()).logits


def check_vocabulary(model: str, arch: dict[str, Any], vocab_size: int) -> None:
    """The tokenizer's ids must index the model's embedding."""
    have = int(arch["hf_config"].get("vocab_size") or 0)
    if vocab_size > have:
        raise ConfigError("tokenizer", f"its {vocab_size} tokens do not fit {model}, whose embedding holds {have}",
                          "use the model folder's own tokenizer (leave tokenizer empty), or one of at most that many "
                          "tokens")


def write_config(arch: dict[str, Any], path: Path) -> None:
    """The ``config.json`` of an exported folder, naming the head ``from_pretrained`` builds."""
    config = _config(arch)
    head = "ForSequenceClassification" if arch["hf_head"] == "sequence_classification" else "ForCausalLM"
    config.architectures = config.architectures or [f"{type(config).__name__.removesuffix('Config')}{head}"]
    (path / CONFIG).write_text(config.to_json_string())


def export_names(names: list[str], model: nn.Module) -> dict[str, str]:
    """The wrapper's state-dict names -> the hf model's own names in ``model.safetensors``; tied
    weights (an LM head sharing the embedding) are stored once, under the first name."""
    from training.models.materialize import tied_parameters

    tied = {f"model.{k}" for k in tied_parameters(model.model)} if isinstance(model, HFModel) else set()
    return {k: k.removeprefix("model.") for k in names if k not in tied}


EXPORT_METADATA = {"format": "pt"}  # what save_pretrained writes into the safetensors header
