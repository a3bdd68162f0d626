"""LoRA adapters on a Llama-style ``hf:`` folder (made here with ``save_pretrained``): the frozen
base with adapters trains on 2 ranks (FSDP2 shards the frozen base too, DDP), only the adapters
change, a rank killed mid-run resumes bit-identical, and the export is both the adapter folder
``PeftModel.from_pretrained`` loads on the base and the merged folder ``from_pretrained`` loads,
answering alike (or, with merge_adapter=false, the adapter alone, which our loader builds on the base). Bad adapter settings are refused before anything runs, naming the field."""

import json

import pytest
import torch

from tests.conftest import run_torchrun
from tests.hf_models import llama_folder
from training.config.fields import ConfigError
from training.config.train_config import TrainConfig
from training.data.dataset import open_dataset
from training.data.options import DataOptions
from training.data.synthetic import make_text_dataset
from training.data.tokenizer import resolve
from training.data.tokens import build
from training.models.build import build_for_training, build_model, check_model
from training.models.spec import ModelSpec

STEPS = 20
LM = {"task": "language_modeling", "kind": "tokens", "features": ["tokens"], "vocab_size": 512, "seq_len": 16}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return llama_folder(tmp_path_factory.mktemp("llama") / "llama")


def _spec(folder, **lora):
    cfg = TrainConfig(dataset_uri="x", model=f"hf:{folder}", adapter="lora", **lora)
    return ModelSpec.for_data(cfg.model, LM, hidden=8, depth=1, adapter=cfg.adapter_spec())


def test_an_adapted_model_starts_as_its_base_and_trains_only_the_adapters(llama):
    spec = _spec(llama, lora_r=4, lora_targets="q_proj,k_proj,v_proj,o_proj")
    model, initial = build_for_training(spec, seed=3, strategy="fsdp")
    initial(model, torch.device("cpu"))
    base = build_model(ModelSpec.for_data(f"hf:{llama}", LM, hidden=8, depth=1), pretrained=True)
    x = torch.randint(0, 512, (2, 16))
    assert torch.equal(model(x), base(x)), "B starts at zero: the adapted model is the base at step 0"
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert {n.split(".")[-4] for n in trained} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert sum(p.numel() for n, p in model.named_parameters() if n in trained) == 2 * 4 * (4 * 64 + 64 + 32 + 32 + 64)


def test_bad_adapter_settings_are_refused_naming_the_field(llama, tmp_path):
    with pytest.raises(ConfigError, match=r"'adapter': lora adapts a pretrained Hugging Face model, but model is 'mlp'"):
        TrainConfig(dataset_uri="x", model="mlp", adapter="lora")
    with pytest.raises(ConfigError, match=r"'lora_targets'"):
        TrainConfig(dataset_uri="x", model=f"hf:{llama}", adapter="lora", lora_targets="q_proj;v_proj")
    with pytest.raises(ConfigError, match=r"'merge_adapter': false exports an adapter.*but adapter is none.*adapter=lora"):
        TrainConfig(dataset_uri="x", model=f"hf:{llama}", merge_adapter=False)
    with pytest.raises(ConfigError, match=r"'lora_r'"):
        TrainConfig(dataset_uri="x", model=f"hf:{llama}", adapter="lora", lora_r=0)
    spec = _spec(llama, lora_targets="qkv_proj")
    with pytest.raises(ConfigError, match=r"^config field 'lora_targets': \['qkv_proj'\] do not name modules.*q_proj"):
        check_model(spec, torch.zeros((2, 17), dtype=torch.int64).numpy(), strategy="fsdp")
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text((llama / "config.json").read_text())
    with pytest.raises(ConfigError, match=r"'adapter': hf:.*config-only has no model.safetensors"):
        _spec(config_only)


@pytest.fixture(scope="module")
def windows(llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-data")
    make_text_dataset(root / "data")
    ds = open_dataset(root / "data", DataOptions(text_column="text"))
    tok = resolve("", default=str(llama), train_documents=lambda: [])
    return root / "data", build(ds, text_column="text", tokenizer=tok, seq_len=32, store_uri=str(root / "store")).uri


def _sets(llama, data, uri, root, strategy, *extra):
    base = {"dataset_uri": data, "text_column": "text", "token_shards": uri, "model": f"hf:{llama}", "seq_len": 32,
            "adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.1, "steps": STEPS,
            "checkpoint_every": 10, "batch_size": 8, "log_every": 5, "warmup_steps": 2, "lr": 1e-2,
            "strategy": strategy, "checkpoint_dir": root / "ck", "output_dir": root / "out"}
    return [f"{k}={v}" for k, v in base.items()] + list(extra)


def _ok(proc):
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def _exported(root):
    return root / "ck" / f"step_{STEPS:08d}"


def _check_export(llama, step_dir):
    """The adapter folder on the base and the merged folder answer alike; only adapted weights moved."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(step_dir, local_files_only=True).eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama, local_files_only=True),
                                        step_dir / "adapter", local_files_only=True).eval()
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=x).logits, adapted(input_ids=x).logits, rtol=1e-4, atol=1e-4)
    base, out = load_file(llama / "model.safetensors"), load_file(step_dir / "model.safetensors")
    assert set(out) == set(base)
    moved = {k for k in base if not torch.equal(base[k], out[k])}
    assert moved and {k.split(".")[-2] for k in moved} == {"q_proj", "v_proj"}, sorted(moved)
    config = json.loads((step_dir / "model_config.json").read_text())["adapter"]
    assert config["merged"] and config["base"]["model"] == f"hf:{llama}" and len(config["base"]["sha256"]) == 64
    assert json.loads((step_dir / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(llama)


def _losses(root):
    return {json.loads(line)["step"]: json.loads(line)["loss"] for line in (root / "out" / "steps.jsonl").read_text().splitlines()}


@pytest.mark.slow
def test_lora_under_fsdp_killed_mid_run_resumes_bit_identical_and_exports_adapter_and_merged_model(llama, windows,
                                                                                                      tmp_path):
    import hashlib

    data, uri = windows
    env = {"HF_HUB_OFFLINE": "1"}
    base, killed = tmp_path / "base", tmp_path / "killed"
    _ok(run_torchrun(2, _sets(llama, data, uri, base, "fsdp"), env=env))
    proc = _ok(run_torchrun(2, _sets(llama, data, uri, killed, "fsdp"), max_restarts=1,
                            env={**env, "TRAINING_FAULT_KILL_AT_STEP": "15:1"}))
    assert "rank 1 SIGKILLs itself after step 15" in proc.stdout and "(step 10)" in proc.stdout
    digest = lambda root, name: hashlib.sha256((_exported(root) / name).read_bytes()).hexdigest()
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        assert digest(killed, name) == digest(base, name), name
    got, want = _losses(killed), _losses(base)
    assert [got[s] for s in range(11, STEPS + 1)] == [want[s] for s in range(11, STEPS + 1)]
    assert want[STEPS] < want[1], "the adapters learn"
    _check_export(llama, _exported(base))
    # A checkpoint holds what trains, not the frozen base (read from its folder again on resume).
    from torch.distributed.checkpoint import FileSystemReader

    saved = [k for k in FileSystemReader(str(killed / "ck" / "step_00000010")).read_metadata().state_dict_metadata
             if k.startswith("train.model.")]
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved), saved[:5]


@pytest.mark.slow
def test_lora_under_ddp_in_bf16_with_activation_checkpointing_exports_the_adapter_alone(llama, windows, tmp_path):
    """merge_adapter=false: the export is the adapter folder and the spec, not the base's weights
    again; our loader (evaluation, the registry) builds it on the base as peft does, and refuses a
    base whose weights are no longer those trained on."""
    import shutil

    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from training.checkpoint.commit import CheckpointCorrupt
    from training.checkpoint.export import load_exported, tensor_bytes
    from training.util import sha256_file

    data, uri = windows
    _ok(run_torchrun(2, _sets(llama, data, uri, tmp_path, "ddp", "activation_checkpointing=full", "precision=bf16",
                              "merge_adapter=false"), env={"HF_HUB_OFFLINE": "1"}))
    summary = json.loads((tmp_path / "out" / "train_summary.json").read_text())
    assert summary["final_step"] == STEPS
    losses = _losses(tmp_path)
    assert losses[STEPS] < losses[1], "the adapters learn under bf16 autocast"
    step_dir = _exported(tmp_path)
    assert not (step_dir / "model.safetensors").exists()
    with safe_open(str(step_dir / "adapter" / "adapter_model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}, "fp32 master weights, bf16 compute only"
    config = json.loads((step_dir / "model_config.json").read_text())["adapter"]
    assert config["merged"] is False and config["base"]["sha256"] == sha256_file(llama / "model.safetensors")
    assert tensor_bytes(step_dir) > (llama / "model.safetensors").stat().st_size * 0.99, "the base counts in its size"

    ours, _ = load_exported(step_dir)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama, local_files_only=True),
                                     step_dir / "adapter", local_files_only=True).eval()
    base = AutoModelForCausalLM.from_pretrained(llama, local_files_only=True).eval()
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), peft(input_ids=x).logits, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(peft(input_ids=x).logits, base(input_ids=x).logits, atol=1e-4)

    moved = tmp_path / "moved"  # the same export, recorded against a base whose weights differ
    shutil.copytree(step_dir, moved)
    spec = json.loads((moved / "model_config.json").read_text())
    spec["adapter"]["base"]["sha256"] = "0" * 64
    (moved / "model_config.json").write_text(json.dumps(spec))
    with pytest.raises(CheckpointCorrupt, match=r"trained on .*model.safetensors with sha256 0{64}.*merge_adapter=true"):
        load_exported(moved)


@pytest.mark.slow
def test_a_checkpoint_does_not_resume_onto_a_base_whose_weights_changed(llama, windows, tmp_path):
    """The checkpoint holds the adapter, not the base it trained beside: its manifest records the
    base's sha256, and a resume after the folder's weights changed is refused naming model, before
    any step, with the checkpoint kept."""
    import shutil

    from safetensors.torch import load_file, save_file

    from training.util import sha256_file

    data, uri = windows
    base = tmp_path / "base"
    shutil.copytree(llama, base)
    sets = lambda steps: _sets(base, data, uri, tmp_path, "ddp", f"steps={steps}", "checkpoint_every=0")
    _ok(run_torchrun(1, sets(5), env={"HF_HUB_OFFLINE": "1"}))
    step_dir = tmp_path / "ck" / "step_00000005"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert manifest["base"] == {"weights": str(base / "model.safetensors"), "sha256": sha256_file(base / "model.safetensors")}

    weights = load_file(base / "model.safetensors")
    name = next(k for k in weights if k.endswith("q_proj.weight"))
    weights[name] += 1e-3  # a base fine-tuned again, saved to the same path
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    proc = run_torchrun(1, sets(10), env={"HF_HUB_OFFLINE": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "config field 'model': checkpoint" in out, out[-3000:]
    assert f"with sha256 {manifest['base']['sha256']}, and {base / 'model.safetensors'} now has sha256 " \
           f"{sha256_file(base / 'model.safetensors')}" in out and "another checkpoint_dir" in out, out[-3000:]
    assert not (tmp_path / "ck" / "step_00000010").exists() and (step_dir / "manifest.json").is_file()


def test_the_memory_preflight_counts_a_frozen_base_without_gradients_or_optimizer_state(llama):
    import numpy as np

    from training.metrics.memory import estimate

    example = np.zeros((17,), dtype=np.int64)
    full_cfg = TrainConfig(dataset_uri="x", model=f"hf:{llama}", strategy="fsdp", batch_size=8)
    lora_cfg = TrainConfig(dataset_uri="x", model=f"hf:{llama}", strategy="fsdp", batch_size=8, adapter="lora")
    full = estimate(full_cfg, ModelSpec.for_data(full_cfg.model, LM, hidden=8, depth=1), example, world_size=2)
    lora = estimate(lora_cfg, _spec(llama), example, world_size=2)
    trained = lora.setup["trained_parameters"]
    assert 0 < trained < lora.setup["parameters"] / 20
    assert lora.terms["optimizer"] == -(-2 * 4 * trained // 2) and lora.terms["gradients"] == -(-4 * trained // 2)
    assert full.terms["optimizer"] > 20 * lora.terms["optimizer"]
    assert lora.terms["parameters"] >= full.terms["parameters"], "the frozen base is still held (sharded)"
