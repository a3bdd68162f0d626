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
              env: Mapping[str, str] | None = None, adapter: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``arch`` of an hf model's spec: its ``config.json`` as the model to build (a classifier's
    ``num_labels``, its classes as ``id2label``/``label2id`` and padding set), the class to build,
    whether the folder has weights and the adapter trained beside them (its target modules resolved:
    peft's default for the architecture where none are named)."""
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
    arch = {"hf_config": config.to_dict(), "hf_head": head, "pretrained": (where / WEIGHTS).is_file()}
    if adapter is not None:
        if not arch["pretrained"]:
            raise ConfigError("adapter", f"{model} has no {WEIGHTS}: an adapter trains beside trained weights, and "
                              "these would be random", "give a folder save_pretrained wrote with its weights, or "
                              "adapter=none to train every weight from random ones")
        arch["adapter"] = {**adapter, "targets": adapter.get("targets") or default_targets(config.model_type)}
    return arch


def default_targets(model_type: str) -> list[str] | str:
    """peft's LoRA target modules for an architecture (its own table), else every linear layer."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as TARGETS

    return list(TARGETS.get(model_type) or ()) or "all-linear"


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
        adapter = arch.get("adapter")
        self.adapter = adapter if adapter and not adapter.get("merged") else None  # a merged export has none
        if self.adapter is not None:
            self._inject(self.adapter)

    def _inject(self, adapter: dict[str, Any]) -> None:
        """LoRA layers in the target modules, through peft (``inject_adapter_in_model``: the modules keep
        their names, the base weight moves to ``<module>.base_layer``); every other weight is frozen but
        a classifier's head, new for the task."""
        from unittest import mock

        from peft import inject_adapter_in_model

        # peft moves each new layer and adapter to its base layer's device with Module.to; here they are
        # made beside it already (on the CPU, the meta device, or as fake tensors when the memory preflight
        # counts), where that move does nothing but fails on fake tensors (torch swaps a fake parameter,
        # which the base layer's other references forbid). The model is moved as a whole later.
        try:
            with mock.patch.object(nn.Module, "to", lambda module, *a, **k: module):
                inject_adapter_in_model(lora_config(adapter), self.model)
        except ValueError as e:
            linear = sorted({n.rpartition(".")[2] for n, m in self.model.named_modules()
                             if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"})
            raise ConfigError("lora_targets", f"{adapter['targets']} do not name modules of the model ({e})",
                              f"name some of its linear layers: {','.join(linear)}, or all-linear") from None
        head = self.head_name
        if head is not None:
            for p in getattr(self.model, head).parameters():
                p.requires_grad_(True)

    @property
    def head_name(self) -> str | None:
        """A classifier's head (new for the task, trained beside the adapters): peft's names for it."""
        if not self.classifier:
            return None
        return next((n for n in ("score", "classifier") if isinstance(getattr(self.model, n, None), nn.Module)), None)

    def init_module(self, _name: str, m: nn.Module) -> None:
        """The model's own ``_init_weights`` of one module (weights materialised after sharding); a LoRA
        layer's adapters as peft initialises them (A drawn, B zero: the adapted model starts as the base)."""
        if m is self:
            return
        from peft.tuners.lora import LoraLayer

        if isinstance(m, LoraLayer):
            m.reset_lora_parameters(ADAPTER_NAME, True)
        else:
            self.model._init_weights(m)

    @property
    def fsdp_units(self) -> list[nn.Module]:
        names = set(getattr(self.model, "_no_split_modules", None) or ())
        return [m for m in self.model.modules() if type(m).__name__ in names]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.dim() == 3:  # packed SFT examples: ids and positions (training/data/sft.py)
            # Positions that restart at 0 with no attention mask: transformers' masking builds the
            # block-diagonal causal mask from them (masking_utils.find_packed_sequence_indices), for
            # sdpa and eager attention alike, so no token attends to another example.
            return self.model(input_ids=idx[:, 0], position_ids=idx[:, 1], use_cache=False).logits
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
    weights (an LM head sharing the embedding) are stored once, under the first name. With an
    adapter, the adapted weights are stored merged under the base layer's own names (``merges``)
    and the adapters themselves left out (they go to the adapter folder)."""
    from training.models.materialize import tied_parameters

    tied = {f"model.{k}" for k in tied_parameters(model.model)} if isinstance(model, HFModel) else set()
    return {k: k.removeprefix("model.").replace(".base_layer.", ".") for k in names
            if k not in tied and not is_adapter_tensor(k)}


EXPORT_METADATA = {"format": "pt"}  # what save_pretrained writes into the safetensors header


# --------------------------------------------------------------------------- LoRA adapters (peft)

ADAPTER_NAME = "default"  # peft's name of the one adapter; its saved files leave it out
ADAPTER_DIR = "adapter"  # the export's adapter folder: adapter_config.json + adapter_model.safetensors
PEFT_PREFIX = "base_model.model."  # what a PeftModel puts before the hf model's own names


def lora_config(adapter: dict[str, Any], *, task_type: str | None = None, modules_to_save: list[str] | None = None,
                base: str | None = None):
    from peft import LoraConfig

    return LoraConfig(r=int(adapter["r"]), lora_alpha=float(adapter["alpha"]), lora_dropout=float(adapter["dropout"]),
                      target_modules=adapter["targets"], task_type=task_type, modules_to_save=modules_to_save,
                      base_model_name_or_path=base)


def is_adapter_tensor(name: str) -> bool:
    """A LoRA adapter's A or B matrix, by its state-dict name."""
    return ".lora_A." in name or ".lora_B." in name


def adapter_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The wrapper's LoRA layers by their names in its state dict."""
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def merges(model: nn.Module) -> dict[str, tuple[str, str, float, bool]]:
    """For each adapted base weight (by its state-dict name): its adapter's A and B, their scaling and
    whether the weight is stored transposed (GPT-2's Conv1D): the merged weight is
    ``W + scaling * B @ A`` (transposed there), what peft's ``merge_and_unload`` computes."""
    out = {}
    for name, layer in adapter_layers(model).items():
        out[f"{name}.base_layer.weight"] = (f"{name}.lora_A.{ADAPTER_NAME}.weight", f"{name}.lora_B.{ADAPTER_NAME}.weight",
                                            float(layer.scaling[ADAPTER_NAME]), bool(getattr(layer, "fan_in_fan_out", False)))
    return out


def merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, transposed: bool) -> torch.Tensor:
    delta = (b.float() @ a.float()) * scaling
    return (weight.float() + (delta.T if transposed else delta)).to(weight.dtype)


def adapter_names(state_names: list[str], model: nn.Module) -> dict[str, str]:
    """The wrapper's trained tensors -> their names in peft's ``adapter_model.safetensors`` (the
    adapter's name left out, as ``PeftModel.save_pretrained`` writes them), a classifier's head
    included (peft's ``modules_to_save``)."""
    head = model.head_name
    out = {}
    for k in state_names:
        local = k.removeprefix("model.")
        if is_adapter_tensor(k):
            out[k] = PEFT_PREFIX + local.replace(f".{ADAPTER_NAME}.", ".")
        elif head is not None and local.startswith(f"{head}."):
            out[k] = PEFT_PREFIX + local
    return out


def write_adapter_config(path: Path, model: nn.Module, base: str) -> None:
    """``adapter_config.json``: the adapter as trained (its target modules as found), the task and the
    base model's folder, so ``PeftModel.from_pretrained(AutoModel...from_pretrained(base), path)`` loads it."""
    targets = sorted({n.rpartition(".")[2] for n in adapter_layers(model)})
    head = model.head_name
    config = lora_config({**model.adapter, "targets": targets}, task_type="SEQ_CLS" if model.classifier else "CAUSAL_LM",
                         modules_to_save=[head] if head else None, base=base)
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(path))


def base_weights(spec) -> Path:
    """The weights file of the base an adapted model was trained on (its ``hf:`` folder's)."""
    return folder(spec.model) / WEIGHTS


def exported_arch(arch: dict[str, Any], model: str, *, merged: bool, base_sha256: str | None = None) -> dict[str, Any]:
    """The ``arch`` of an adapted model's export, with the base model's identity (its folder and the
    sha256 of its weights: ``base_sha256`` when the run hashed them already, else hashed here).
    ``merged``: the export's weights are the merged model's (it is built without an adapter); else
    the export is the adapter alone, built on the base read again."""
    from training.util import sha256_file

    base = {"model": model, "sha256": base_sha256 or sha256_file(folder(model) / WEIGHTS)}
    return {**arch, "adapter": {**arch["adapter"], "merged": merged, "base": base}}
