"""Each model family learns its dataset kind, judged against what the data makes reachable."""

import pytest
import torch

from tests.conftest import run_torchrun
from training.checkpoint.export import load_exported
from training.data.dataset import load_split
from training.data.synthetic import make_digits_dataset, make_markov_dataset, markov_chain
from training.evaluate import score


def test_markov_entropy_rate_is_what_sampling_shows(tmp_path):
    """The loss floor written next to the data is the chain's real entropy rate."""
    trans, pi, h = markov_chain(8, seed=3)
    assert trans.shape == (8, 8) and abs(trans.sum(axis=1) - 1).max() < 1e-12
    assert abs(pi @ trans - pi).max() < 1e-12  # stationary
    meta = make_markov_dataset(tmp_path, n_train=4000, n_val=10, vocab=8, seq_len=16, seed=3)
    seq = load_split(tmp_path, "train").features
    # Empirical conditional entropy from the sampled transitions approaches the analytic rate.
    counts = torch.zeros(8, 8, dtype=torch.float64)
    for a, b in zip(seq[:, :-1].reshape(-1), seq[:, 1:].reshape(-1)):
        counts[a, b] += 1
    p = counts / counts.sum(dim=1, keepdim=True)
    empirical = -(counts * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum() / counts.sum()
    assert float(empirical) == pytest.approx(meta["loss_floor"], rel=0.03)
    assert meta["loss_floor"] < meta["uniform_loss"]


@pytest.mark.slow
def test_transformer_gets_within_10_percent_of_the_loss_floor(tmp_path):
    """Budget: 150 steps, global batch 32, 2 ranks on CPU (about a minute on 2 cores)."""
    data = tmp_path / "markov"
    meta = make_markov_dataset(data, n_train=4000, n_val=500, seed=0)
    proc = run_torchrun(2, [f"dataset_uri={data}", "model=transformer", "hidden=64", "depth=2", "n_heads=4",
                            f"checkpoint_dir={tmp_path / 'ck'}", "steps=150", "batch_size=32", "lr=3e-3",
                            "checkpoint_every=0", "log_every=50", "eval_every=75"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval step 150: loss" in proc.stdout  # evaluation during training reads the token ids as ids
    model, spec = load_exported(tmp_path / "ck" / "step_00000150")
    val = load_split(data, "validation")
    result = score(model, "tokens", torch.from_numpy(val.features), None)
    assert result["eval/loss"] <= 1.10 * meta["loss_floor"], (result, meta["loss_floor"])
    assert result["eval/loss"] >= meta["loss_floor"] * 0.97  # cannot beat the entropy rate by more than noise


@pytest.mark.slow
def test_cnn_learns_real_digits(tmp_path):
    data = tmp_path / "digits"
    make_digits_dataset(data)
    proc = run_torchrun(2, [f"dataset_uri={data}", "model=cnn", "hidden=64", f"checkpoint_dir={tmp_path / 'ck'}",
                            "steps=120", "batch_size=64", "lr=3e-3", "checkpoint_every=0", "log_every=40"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    model, _ = load_exported(tmp_path / "ck" / "step_00000120")
    val = load_split(data, "validation")
    result = score(model, "images", torch.from_numpy(val.features), torch.from_numpy(val.labels))
    assert result["eval/accuracy"] >= 0.90, result  # chance is 0.10; small CNNs reach ~0.98
