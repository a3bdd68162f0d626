"""The Hugging Face models people fine-tune, through the whole DAG (dag.test, 2 gloo ranks): a GPT-2
style causal LM fine-tuned from its folder's weights with the folder's own tokenizer, exported as a
folder ``from_pretrained`` loads; a BERT-style classifier on labelled text; LoRA adapters on a
Llama-style folder classifying named classes under FSDP, and fine-tuned on instructions (SFT with the
folder's chat template, the loss on the answers) under FSDP; a hub id refused."""

import math

import mlflow
import pandas as pd
import pytest
import torch

from tests.e2e.test_text_pipeline import TEXT, _run
from tests.hf_models import bert_folder, gpt2_folder, llama_folder
from training.config.fields import ConfigError
from training.data.synthetic import make_instructions_dataset, make_text_dataset
from training.results.text_model import load_text_folder, predict_text

pytestmark = pytest.mark.slow
HF = {k: v for k, v in TEXT.items() if k not in ("model", "hidden", "depth", "n_heads")}


@pytest.fixture(scope="module")
def help_text(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-data")
    make_text_dataset(root / "lm")
    make_text_dataset(root / "classes", labels=True, names=True)  # classes by name: code, prose
    return root


def test_fine_tune_a_causal_lm_from_its_folder(airflow_db, help_text, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = gpt2_folder(tmp_path / "gpt2", pretrain_steps=150)
    states, client, run = _run({**HF, "model": f"hf:{folder}", "dataset_uri": str(help_text / "lm"), "steps": 20,
                                "lr": 1e-4, "experiment": "hf-lm", "store_uri": (tmp_path / "store").as_uri()})
    assert set(states.values()) == {"success"}, states
    m, tags = run.data.metrics, run.data.tags
    assert tags["tokenizer"] == str(folder), "the folder's own tokenizer when none is named"
    # Pretrained weights: after 20 small steps far below a randomly initialised model's loss.
    assert m["eval/loss"] < math.log(512) - 1.5, m
    assert "eval/bits_per_byte" in m and tags["registry.decision"] == "champion"
    # The evaluated checkpoint is a folder transformers loads, with the tokenizer, giving our logits.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.checkpoint.export import load_exported

    exported = tmp_path / "exported"
    step = tags["checkpoint.uri"].rsplit("/", 1)[-1]
    for name in ("config.json", "model.safetensors", "model_config.json", "tokenizer.json"):
        src = tmp_path / "store" / "hf-lm" / run.info.run_id / step / name
        exported.mkdir(exist_ok=True)
        (exported / name).write_bytes(src.read_bytes())
    hf = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(exported, local_files_only=True)
    ours, spec = load_exported(exported)
    x = torch.tensor([tok("The import statement")["input_ids"]])
    assert spec.is_hf and torch.allclose(hf(x).logits, ours(x), atol=1e-5)
    # The registered model (pyfunc) continues text as the checkpoint's model does.
    served = mlflow.pyfunc.load_model("models:/hf-lm@champion").predict(pd.DataFrame({"text": ["The import"]}),
                                                                       params={"new_tokens": 8})
    assert served == predict_text(*load_text_folder(exported), ["The import"], new_tokens=8)


def test_a_bert_classifier_on_labelled_text_and_a_config_only_folder(airflow_db, help_text, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = bert_folder(tmp_path / "bert")
    states, client, run = _run({**HF, "model": f"hf:{folder}", "dataset_uri": str(help_text / "classes"),
                                "steps": 60, "experiment": "hf-classes", "store_uri": (tmp_path / "s1").as_uri()})
    assert set(states.values()) == {"success"}, states
    assert run.data.tags["data.task"] == "classification" and run.data.metrics["eval/accuracy"] > 0.8
    # The exported folder names its classes as transformers does, and the registered model answers with them.
    from transformers import AutoModelForSequenceClassification

    step = run.data.tags["checkpoint.uri"].rsplit("/", 1)[-1]
    exported = tmp_path / "s1" / "hf-classes" / run.info.run_id / step
    hf = AutoModelForSequenceClassification.from_pretrained(exported, local_files_only=True)
    assert hf.config.id2label == {0: "code", 1: "prose"} and hf.config.label2id == {"code": 0, "prose": 1}
    served = mlflow.pyfunc.load_model("models:/hf-classes@champion").predict(
        pd.DataFrame({"text": [">>> import os\n>>> os.getcwd()", "The import statement finds and loads a module."]}))
    assert set(served) <= {"code", "prose"}, served
    # config.json alone: random weights, trained all the same.
    lm = gpt2_folder(tmp_path / "gpt2-config", weights=False)
    states, client, run = _run({**HF, "model": f"hf:{lm}", "dataset_uri": str(help_text / "lm"), "steps": 10,
                                "experiment": "hf-config", "store_uri": (tmp_path / "s2").as_uri()})
    assert set(states.values()) == {"success"}, states
    assert run.data.metrics["eval/loss"] > math.log(512) - 1.0, "random weights after 10 steps"


def test_lora_on_a_llama_folder_classifies_named_classes_under_fsdp(airflow_db, help_text, tmp_path, monkeypatch):
    """The form's "Adapt a model" fields: the base frozen, the adapters and the new head trained on 2
    ranks with FSDP; the registered (merged) model answers with class names, and the adapter folder on
    the base model answers as the merged one does."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = llama_folder(tmp_path / "llama")
    states, client, run = _run({**HF, "model": f"hf:{folder}", "dataset_uri": str(help_text / "classes"),
                                "adapter": "lora", "lora_r": 8, "lora_alpha": 16, "strategy": "fsdp", "steps": 40,
                                "lr": 3e-3, "experiment": "hf-lora", "store_uri": (tmp_path / "store").as_uri()})
    assert set(states.values()) == {"success"}, states
    p, tags = run.data.params, run.data.tags
    assert p["adapter"] == "lora" and tags["adapter"] == "lora"
    assert 0 < float(p["trainable_share"]) < 0.1 and int(p["n_trainable_params"]) < int(p["n_params"])
    assert run.data.metrics["eval/accuracy"] > 0.7, run.data.metrics
    served = mlflow.pyfunc.load_model("models:/hf-lora@champion").predict(
        pd.DataFrame({"text": [">>> import os\n>>> os.getcwd()", "The import statement finds and loads a module."]}))
    assert set(served) <= {"code", "prose"}, served
    version = client.get_model_version_by_alias("hf-lora", "champion")
    assert version.tags["adapter"] == "lora" and version.tags["adapter.base_model"] == f"hf:{folder}"
    assert len(version.tags["adapter.base_sha256"]) == 64
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    step = tags["checkpoint.uri"].rsplit("/", 1)[-1]
    exported = tmp_path / "store" / "hf-lora" / run.info.run_id / step
    merged = AutoModelForSequenceClassification.from_pretrained(exported, local_files_only=True).eval()
    base = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=2, local_files_only=True)
    adapted = PeftModel.from_pretrained(base, exported / "adapter", local_files_only=True).eval()
    x = torch.tensor([AutoTokenizer.from_pretrained(folder)("The import statement")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=x).logits, merged(input_ids=x).logits, rtol=1e-4, atol=1e-4)


def test_sft_with_lora_on_a_chat_llama_folder_answers_held_out_prompts(airflow_db, tmp_path, monkeypatch):
    """Instruction data (make-data --kind instructions) rendered with the folder's chat template: the
    run records the rendering and how the examples packed, scores the answers (loss and bits per
    byte), writes held-out prompts with generated and reference answers, and, with merge_adapter=false,
    exports and registers the adapter alone: it loads with peft on the base, and the registered model
    answers from the base read from its folder."""
    import json

    from mlflow.tracking import MlflowClient
    from peft import PeftModel

    from training.tracking.run import read_summary
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = llama_folder(tmp_path / "llama", chat=True)
    make_instructions_dataset(tmp_path / "instructions")
    conf = {**{k: v for k, v in HF.items() if k != "text_column"}, "model": f"hf:{folder}",
            "dataset_uri": str(tmp_path / "instructions"), "messages_column": "messages", "seq_len": 256,
            "batch_size": 8, "adapter": "lora", "lora_r": 8, "lora_alpha": 16, "lora_targets": "all-linear",
            "strategy": "fsdp", "steps": 20, "lr": 3e-3, "experiment": "hf-sft", "store_uri": (tmp_path / "store").as_uri(),
            "merge_adapter": False}
    states, client, run = _run(conf)
    assert set(states.values()) == {"success"}, states
    m, tags = run.data.metrics, run.data.tags
    assert tags["sft.rendering"] == f"the chat template of hf:{folder}"
    summary = read_summary(run.info.run_id, client)
    assert summary["validation_truncated_share"] == 0
    assert 0 < summary["validation_answer_tokens"] < summary["validation_tokens"]
    assert 0 < m["eval/bits_per_byte"] and m["eval/loss"] < math.log(514), m
    samples = MlflowClient().download_artifacts(run.info.run_id, "samples/samples.json", str(tmp_path / "dl"))
    samples = json.loads(open(samples).read())
    assert samples["prompts"][0].endswith("<|im_start|>assistant\n") and len(samples["answers"]) == len(samples["greedy"])
    step = tags["checkpoint.uri"].rsplit("/", 1)[-1]
    exported = tmp_path / "store" / "hf-sft" / run.info.run_id / step
    assert not (exported / "model.safetensors").exists(), "the base's weights are not stored again"
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), exported / "adapter").eval()
    base = AutoModelForCausalLM.from_pretrained(folder).eval()
    x = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert not torch.allclose(adapted(input_ids=x).logits, base(input_ids=x).logits, atol=1e-4), "adapters trained"
    version = client.get_model_version_by_alias("hf-sft", "champion")
    assert version.tags["adapter.base_model"] == f"hf:{folder}"
    served = mlflow.pyfunc.load_model("models:/hf-sft@champion")
    answer = served.predict(pd.DataFrame({"text": [samples["prompts"][0]]}))
    assert isinstance(answer[0], str), answer


def test_a_hub_id_is_refused_naming_the_download(tmp_path):
    from training.models.hf import folder

    with pytest.raises(ConfigError, match=r"config field .model.: hf:gpt2: gpt2 is not a folder with a config.json \(a model hub id\? nothing is downloaded"):
        folder("hf:gpt2")
