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


def _blocks(seed=0, count=40):
    return np.random.default_rng(seed).integers(1, 30, size=count).tolist()


def test_block_order_covers_every_sample_once_per_epoch_and_resumes_exactly():
    blocks = _blocks()
    n = sum(blocks)
    s = ShardedSampler(n, global_batch=16, rank=0, world_size=1, seed=3, blocks=blocks, window=4)
    order = s.indices_at(0, 3 * n)
    for e in range(3):
        assert sorted(order[e * n : (e + 1) * n].tolist()) == list(range(n))
    assert not np.array_equal(order[:n], order[n : 2 * n])
    for pos in (0, 5, n - 3, n + 17, 2 * n + 1):  # a fresh sampler at any position: the same order
        fresh = ShardedSampler(n, global_batch=16, rank=0, world_size=1, seed=3, blocks=blocks, window=4)
        np.testing.assert_array_equal(fresh.indices_at(pos, 40), np.concatenate([order, order])[pos : pos + 40])


def test_block_order_is_local_to_a_window_of_blocks():
    """Positions of one shuffle window draw only on that window's blocks: what bounds a reader."""
    blocks = [10] * 20
    s = ShardedSampler(200, global_batch=10, rank=0, world_size=1, seed=1, blocks=blocks, window=4)
    for w in range(5):
        rows = s.indices_at(w * 40, 40)
        assert set((rows // 10).tolist()) == set(s.window_blocks(0, w).tolist())


def test_one_window_keeps_the_full_permutation():
    s = ShardedSampler(97, global_batch=1, rank=0, world_size=1, seed=7, blocks=[50, 47], window=2)
    np.testing.assert_array_equal(s.indices_at(0, 97), np.random.default_rng([7, 0]).permutation(97))


def test_block_order_after_a_shrink_is_the_same_global_order():
    blocks = _blocks(1)
    n = sum(blocks)

    def global_order(world, start, steps):
        ss = [ShardedSampler(n, global_batch=24, rank=r, world_size=world, seed=9, pos=start, blocks=blocks, window=3)
              for r in range(world)]
        return np.concatenate([np.concatenate([s.next_indices() for s in ss]) for _ in range(steps)])

    four = global_order(4, 0, 30)
    np.testing.assert_array_equal(np.concatenate([four[: 24 * 10], global_order(2, 24 * 10, 20)]), four)


def test_streamed_batches_are_the_rows_the_sampler_names(tmp_path):
    from training.data.stream import NpyBlocks, StreamLoader

    rows = np.random.default_rng(0).integers(0, 60_000, size=(3000, 17)).astype(np.uint16)
    np.save(tmp_path / "train.npy", rows)
    blocks = NpyBlocks(tmp_path, "train", block_bytes=17 * 2 * 64)
    assert sum(blocks.sizes) == 3000 and len(blocks.sizes) == 47
    for rank in range(2):
        make = lambda: ShardedSampler(3000, global_batch=32, rank=rank, world_size=2, seed=5, blocks=blocks.sizes, window=4)
        loader, ref = StreamLoader(blocks, make()), make()
        for _ in range(250):  # past an epoch
            x, y = loader.next_batch()
            np.testing.assert_array_equal(x, rows[ref.next_indices()].astype(np.int64))
            assert y is None and x.dtype == np.int64
        assert loader.peak_windows == 2, "the buffer holds this window and the next"
        loader.close()
