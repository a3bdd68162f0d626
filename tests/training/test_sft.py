"""Supervised fine-tuning: examples rendered with a chat template, packed into windows, the loss on
the answers only; packed examples computed as if alone; refusals naming the field; and a Llama-style
folder fine-tuned with LoRA on 2 FSDP ranks, whose eval/loss is the answers' loss of the exported
model as transformers computes it on each example alone."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import run_torchrun
from tests.hf_models import llama_folder
from training.config.fields import ConfigError
from training.config.train_config import TrainConfig
from training.data import sft
from training.data.dataset import open_dataset
from training.data.options import DataOptions
from training.data.synthetic import _write_split, make_instructions_dataset
from training.data.tokens import build_for, open_shards
from training.models.build import build_model
from training.models.loss import split_batch
from training.models.spec import ModelSpec

SEQ = 256


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory):
    return llama_folder(tmp_path_factory.mktemp("chat-llama") / "llama", chat=True)


@pytest.fixture(scope="module")
def instructions(tmp_path_factory):
    root = tmp_path_factory.mktemp("instructions") / "data"
    make_instructions_dataset(root)
    return root


def _shards(data, model, store, **sets):
    cfg = TrainConfig(dataset_uri=str(data), model=model, seq_len=sets.pop("seq_len", SEQ), **sets)
    folder = Path(model.removeprefix("hf:")) if model.startswith("hf:") else None
    built, tok = build_for(cfg, open_dataset(cfg.dataset_uri, DataOptions.of(cfg)), str(store), model_folder=folder)
    return built, tok, open_shards(built.uri)


def test_answers_alone_are_targets_and_examples_are_packed_whole(chat_llama, instructions, tmp_path):
    built, tok, shards = _shards(instructions, f"hf:{chat_llama}", tmp_path, messages_column="messages")
    assert built.stats["sft"]["rendering"] == f"the chat template of hf:{chat_llama}"
    assert shards.meta["task"] == "language_modeling" and shards.meta["sft"]
    val = shards.split("validation")
    x, y = split_batch("tokens", torch.from_numpy(val.features), torch.from_numpy(val.labels))
    assert x.shape == (len(val.features), 2, SEQ)
    ids, pos = x[:, 0], x[:, 1]
    # The targets, read back as text: each example's answer and its end-of-turn marker, nothing else.
    answers = []
    for r in range(len(ids)):
        starts = [int(i) for i in torch.nonzero(pos[r] == 0)] + [SEQ]
        for a, b in zip(starts, starts[1:]):
            t = y[r, a:b][y[r, a:b] != sft.IGNORE].tolist()
            if t:
                answers.append(tok.tokenizer.decode(t, skip_special_tokens=False))
    table = open_dataset(str(instructions), DataOptions()).table("validation").column("response").to_pylist()
    assert answers == [f"{a}<|im_end|>\n" for a in table]  # in order, whole, no example cut
    s = built.stats["splits"]["validation"]
    assert s["examples"] == len(table) and s["truncated"] == 0 and 0.5 < s["fill"] <= 1
    assert s["answer_tokens"] == int((y != sft.IGNORE).sum())
    assert built.stats["prompts"][0].endswith("<|im_start|>assistant\n") and "Answer with the words only" in \
        built.stats["prompts"][0]


def test_prompt_and_response_without_a_template_are_plain_text_ending_in_end_of_text(instructions, tmp_path):
    built, tok, shards = _shards(instructions, "transformer", tmp_path, prompt_column="prompt",
                                 response_column="response", tokenizer="bytes", seq_len=512)
    assert built.stats["sft"]["rendering"].startswith("plain text")
    val = shards.split("validation", limit=1)
    x, y = split_batch("tokens", torch.from_numpy(val.features), torch.from_numpy(val.labels))
    first = (y[0] != sft.IGNORE).nonzero()[0, 0]
    end = int((x[0, 1, 1:] == 0).nonzero()[0, 0]) + 1  # where the second example starts
    target = y[0, :end][y[0, :end] != sft.IGNORE].tolist()
    table = open_dataset(str(instructions), DataOptions()).table("validation")
    assert bytes(target[:-1]).decode() == table.column("response")[0].as_py()
    assert target[-1] == 256 and int(first) > 0  # the end-of-text token closes the answer


def _packed_vs_alone(model, a: list[int], b: list[int]) -> float:
    """Largest difference between example ``b``'s logits packed after ``a`` and computed alone."""
    ids = torch.tensor([a + b])
    pos = torch.tensor([list(range(len(a))) + list(range(len(b)))])
    packed = model(torch.stack((ids, pos), dim=1))[0, len(a):]
    alone = model(torch.tensor([b]))[0]
    return float((packed - alone).abs().max())


@pytest.mark.parametrize("family", ["hf", "transformer"])
def test_a_packed_example_is_computed_as_alone(chat_llama, family):
    """No token attends to another example, and positions count from the example's start: the
    packed logits equal the lone ones (and differ without the resets, so the check can fail)."""
    meta = {"task": "language_modeling", "kind": "tokens", "features": ["tokens"], "vocab_size": 514, "seq_len": 32}
    name = f"hf:{chat_llama}" if family == "hf" else "transformer"
    torch.manual_seed(0)
    model = build_model(ModelSpec.for_data(name, meta, hidden=32, depth=2, n_heads=4)).eval()
    a, b = list(range(5, 16)), list(range(40, 52))
    with torch.no_grad():
        assert _packed_vs_alone(model, a, b) < 1e-5
        ids = torch.tensor([a + b])
        unpacked = model(torch.stack((ids, torch.arange(len(a) + len(b))[None]), dim=1))[0, len(a):]
        assert float((unpacked - model(torch.tensor([b]))[0]).abs().max()) > 1e-3


def test_sft_refusals_name_the_field(chat_llama, instructions, tmp_path):
    with pytest.raises(ConfigError) as e:
        TrainConfig(dataset_uri="x", prompt_column="prompt")
    assert e.value.field == "response_column"
    with pytest.raises(ConfigError) as e:
        TrainConfig(dataset_uri="x", messages_column="m", prompt_column="p", response_column="r")
    assert e.value.field == "prompt_column"
    with pytest.raises(ConfigError) as e:
        TrainConfig(dataset_uri="x", text_column="text", prompt_column="p", response_column="r")
    assert e.value.field == "text_column"
    with pytest.raises(ConfigError) as e:  # examples longer than the window, beyond the share allowed
        _shards(instructions, f"hf:{chat_llama}", tmp_path, messages_column="messages", seq_len=48)
    assert e.value.field == "seq_len" and "max_truncated_share" in str(e.value)
    with pytest.raises(ConfigError) as e:  # conversations need a template; plain text renders a pair
        _shards(instructions, "transformer", tmp_path, messages_column="messages", tokenizer="bytes")
    assert e.value.field == "chat_template"
    unstable = tmp_path / "count.jinja"  # renders the number of turns first: prefixes do not extend
    unstable.write_text("{{ messages|length }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")
    with pytest.raises(ConfigError) as e:
        _shards(instructions, f"hf:{chat_llama}", tmp_path, messages_column="messages", chat_template=str(unstable))
    assert e.value.field == "chat_template" and "prefixes" in str(e.value)
    with pytest.raises(ConfigError) as e:
        _shards(instructions, f"hf:{chat_llama}", tmp_path, prompt_column="prompt", response_column="nope")
    assert e.value.field == "response_column"


def test_the_gate_names_empty_answers_unknown_roles_and_conversations_without_an_answer(tmp_path):
    from training.data.gate import DataValidationError, validate

    turn = lambda role, content: {"role": role, "content": content}
    good = [[turn("user", f"question {i} about something"), turn("assistant", f"answer {i}")] for i in range(150)]
    bad = [*good[:147], [turn("user", "q"), turn("assistant", "  ")], [turn("user", "q"), turn("bot", "a")],
           [turn("system", "s"), turn("user", "q")]]
    _write_split(tmp_path, "train", {"messages": bad})
    _write_split(tmp_path, "validation", {"messages": good[:120]})
    with pytest.raises(DataValidationError) as e:
        validate(tmp_path, options=DataOptions(sft=(("messages_column", "messages"),)))
    failures = e.value.report["failures"]
    assert "train: 1 conversations have an empty answer, e.g. row 147" in failures
    assert "train: 1 conversations have a role outside system, user, assistant, tool (bot), e.g. row 148" in failures
    assert any(f.startswith("train: 2 conversations have no assistant turn") for f in failures), failures


@pytest.mark.slow
def test_lora_sft_on_two_fsdp_ranks_scores_the_answers_as_transformers_does_alone(chat_llama, instructions, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    built, tok, shards = _shards(instructions, f"hf:{chat_llama}", tmp_path / "store", messages_column="messages")
    steps = 20
    sets = {"dataset_uri": instructions, "messages_column": "messages", "token_shards": built.uri,
            "model": f"hf:{chat_llama}", "seq_len": SEQ, "adapter": "lora", "lora_r": 8, "lora_alpha": 16,
            "lora_targets": "all-linear", "steps": steps, "batch_size": 8, "log_every": 5, "warmup_steps": 2,
            "lr": 3e-3, "eval_every": steps, "checkpoint_every": 0, "strategy": "fsdp",
            "checkpoint_dir": tmp_path / "ck", "output_dir": tmp_path / "out"}
    proc = run_torchrun(2, [f"{k}={v}" for k, v in sets.items()], env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    logged = float(re.search(rf"eval step {steps}: loss ([0-9.]+)", proc.stdout + proc.stderr)[1])
    losses = [json.loads(line)["loss"] for line in (tmp_path / "out" / "steps.jsonl").read_text().splitlines()]
    assert float.fromhex(losses[-1]) < float.fromhex(losses[0]), "the answers' loss falls"

    # The exported adapter on the base, in transformers and peft, each validation example alone.
    final = tmp_path / "ck" / f"step_{steps:08d}"
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(chat_llama), final / "adapter").eval()
    table = open_dataset(str(instructions), DataOptions()).table("validation").column("messages").to_pylist()
    rend = sft.renderer(None, model=f"hf:{chat_llama}", tokenizer=tok.tokenizer, eot_id=tok.eot_id, messages=True,
                        model_folder=chat_llama)
    ids, masks, _ = sft.encode(table, rend, tok.tokenizer, tok.eot_id)
    total, count = 0.0, 0
    with torch.no_grad():
        for t, m in zip(ids, masks):
            logits = model(input_ids=torch.from_numpy(t)[None]).logits[0, :-1]
            keep = torch.from_numpy(m[1:])
            total += float(torch.nn.functional.cross_entropy(logits[keep], torch.from_numpy(t[1:])[keep],
                                                             reduction="sum"))
            count += int(keep.sum())
    assert logged == pytest.approx(total / count, rel=2e-3)
    assert math.isfinite(logged) and count == built.stats["splits"]["validation"]["answer_tokens"]
