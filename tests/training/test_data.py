import numpy as np
import pytest

from training.data.dataset import load_split
from training.data.sampler import ShardedSampler
from training.data.synthetic import make_teacher_dataset, read_meta, teacher_labels


def _positions(n, batch, world, steps, seed=7, start_pos=0):
    """Indices each step hands out, per rank."""
    samplers = [ShardedSampler(n, global_batch=batch, rank=r, world_size=world, seed=seed, pos=start_pos) for r in range(world)]
    out = []
    for _ in range(steps):
        out.append([s.next_indices() for s in samplers])
    return out


@pytest.mark.parametrize("n, batch, world", [(100, 10, 2), (103, 12, 4), (37, 8, 1), (50, 6, 3), (64, 64, 2)])
def test_every_sample_exactly_once_per_epoch_across_ranks(n, batch, world):
    steps = (3 * n) // batch + 1
    flat = np.concatenate([np.concatenate(step) for step in _positions(n, batch, world, steps)])
    for epoch in range(len(flat) // n):
        chunk = flat[epoch * n : (epoch + 1) * n]
        assert sorted(chunk.tolist()) == list(range(n)), f"epoch {epoch} does not cover every sample once"


def test_ranks_get_disjoint_shards_of_each_step():
    for step in _positions(1000, 40, 4, 10):
        union = np.concatenate(step)
        assert len(set(union.tolist())) == 40


def test_resume_from_position_reproduces_the_order():
    full = _positions(97, 12, 2, 20)
    s = ShardedSampler(97, global_batch=12, rank=0, world_size=2, seed=7)
    for _ in range(9):
        s.next_indices()
    state = s.state_dict()
    assert state == {"pos": 108, "epoch": 1, "offset": 11}
    resumed = _positions(97, 12, 2, 11, start_pos=state["pos"])
    for a, b in zip(full[9:], resumed):
        for ra, rb in zip(a, b):
            np.testing.assert_array_equal(ra, rb)


def test_epochs_are_shuffled_differently():
    s = ShardedSampler(50, global_batch=50, rank=0, world_size=1, seed=1)
    assert not np.array_equal(s.next_indices(), s.next_indices())


def test_generated_dataset_matches_its_metadata(tmp_path):
    meta = make_teacher_dataset(tmp_path, n_train=500, n_val=200, n_features=5, n_classes=3, label_noise=0.2, seed=3)
    assert read_meta(tmp_path) == meta
    assert meta["bayes_accuracy"] == pytest.approx(1 - 0.2 * 2 / 3)
    train = load_split(tmp_path, "train")
    assert train.features.shape == (500, 5) and train.features.dtype == np.float32
    assert set(np.unique(train.labels)) <= {0, 1, 2}
    # The share of labels that agree with the noise-free teacher is what the metadata promises.
    agree = (teacher_labels(train.features.astype(np.float64), 3, 3) == train.labels).mean()
    assert agree == pytest.approx(meta["bayes_accuracy"], abs=0.05)
