"""Activation checkpointing (training/models/activations.py): with dropout on, the gradients of a
step are bit-identical to those without it, for the built-in decoder, the text classifier and a
Hugging Face GPT-2; what autograd keeps for backward shrinks (full below selective below none);
a model without blocks is refused naming the field."""

import pytest
import torch

from training.config.fields import ConfigError
from training.config.train_config import TrainConfig, check_rules
from training.models import activations
from training.models.builtin import MLP, TextClassifier, Transformer

VOCAB, SEQ = 101, 48


def _decoder():
    return Transformer(vocab_size=VOCAB, seq_len=SEQ, d_model=64, n_layers=4, n_heads=4, dropout=0.2)


def _classifier():
    return TextClassifier(vocab_size=VOCAB, n_classes=3, pad_id=0, d_model=64, n_layers=4, n_heads=4, dropout=0.2)


def _gpt2():
    from transformers import GPT2Config

    from training.models.hf import HFModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=4, n_head=4, resid_pdrop=0.2,
                        embd_pdrop=0.2, attn_pdrop=0.2)
    return HFModel({"hf_head": "causal_lm", "hf_config": config.to_dict()})


def _step(make, mode: str):
    torch.manual_seed(0)
    model = make().train()
    chosen = activations.apply(model, mode)
    x = torch.randint(1, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(7)  # the dropout masks' stream
    out = model(x)
    target = x if out.dim() == 3 else x[:, 0] % out.shape[-1]
    torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.manual_seed(7)
    return grads, activations.saved_bytes(model, x), len(chosen)


@pytest.mark.parametrize("make", [_decoder, _classifier, _gpt2], ids=["decoder", "classifier", "gpt2"])
def test_recomputed_blocks_give_the_same_gradients_and_keep_less(make):
    ref, kept_none, _ = _step(make, "none")
    kept = {}
    for mode in ("full", "selective"):
        grads, kept[mode], n = _step(make, mode)
        assert n == (4 if mode == "full" else 2)
        assert grads.keys() == ref.keys() and all(torch.equal(grads[k], ref[k]) for k in ref), mode
    assert kept["full"] < kept["selective"] < kept_none
    assert kept["full"] < 0.5 * kept_none, (kept, kept_none)


def test_the_parameter_names_stay_the_same():
    plain, recomputed = _decoder(), _decoder()
    activations.apply(recomputed, "full")
    assert list(plain.state_dict()) == list(recomputed.state_dict())


def test_a_model_without_blocks_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        check_rules(TrainConfig(dataset_uri="x", model="mlp", activation_checkpointing="full"))
    with pytest.raises(ConfigError, match="activation_checkpointing.*fsdp_units"):
        activations.apply(torch.nn.Sequential(torch.nn.Linear(2, 2)), "full")
    assert activations.apply(MLP(in_features=4, hidden=8, depth=2, n_classes=2), "none") == []
