"""Parquet loading and a resumable, deterministic, rank-sharded sampler.

The sampler treats training data as an endless stream of epochs, each a fresh permutation
seeded by ``(seed, epoch)``. Its whole state is one integer, the global sample position ``pos``;
``(epoch, offset) = divmod(pos, n)``. Step ``s`` takes the global positions
``[s * B, (s + 1) * B)`` and rank ``r`` of ``W`` takes the ``r``-th contiguous ``B / W`` of them.
So across ranks every sample is seen exactly once per epoch, a batch may straddle an epoch
boundary instead of dropping a tail, and resuming at ``pos`` reproduces the same order exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from training.datasets import read_meta


@dataclass
class Split:
    features: np.ndarray  # float32 [n, d] (tabular, images) or int64 [n, seq_len + 1] (tokens)
    labels: np.ndarray | None  # int64 [n]; None for tokens (targets are the shifted sequence)


def load_split(root: str | Path, split: str) -> Split:
    """Read every Parquet part of ``split`` into memory, columns in the order dataset.json gives."""
    import pyarrow.parquet as pq

    meta = read_meta(root)
    parts = sorted((Path(root) / split).glob("*.parquet"))
    if not parts:
        raise FileNotFoundError(f"no Parquet files under {Path(root) / split}")
    label = meta.get("label")
    columns = [*meta["features"], *([label] if label else [])]
    tables = []
    for p in parts:
        # ParquetFile rather than pq.read_table, whose dataset layer imports pandas.
        with pq.ParquetFile(p) as f:
            tables.append(f.read(columns=columns))
    dtype = np.int64 if meta.get("feature_dtype") == "int" else np.float32
    x = np.concatenate(
        [np.stack([_to_numpy(t.column(c)) for c in meta["features"]], axis=1) for t in tables]
    ).astype(dtype)
    y = np.concatenate([_to_numpy(t.column(label)) for t in tables]).astype(np.int64) if label else None
    return Split(features=x, labels=y)


def _to_numpy(column) -> np.ndarray:
    """One Arrow column as a numpy array, through DLPack (no copy) where it applies: pyarrow's
    ``to_numpy`` goes through its pandas bridge, and importing pandas is about half a second of
    every rank's start-up. Columns DLPack cannot take (nulls, other types) use ``to_numpy``."""
    try:
        if column.num_chunks:
            return np.concatenate([np.from_dlpack(chunk) for chunk in column.chunks])
    except (BufferError, TypeError, ValueError, NotImplementedError):
        pass
    return column.to_numpy()


class ShardedSampler:
    """Deterministic global order, sharded by rank; state is the global position."""

    def __init__(self, n: int, *, global_batch: int, rank: int, world_size: int, seed: int, pos: int = 0):
        assert global_batch % world_size == 0, "checked by TrainConfig.check_world_size"
        self.n, self.global_batch, self.rank, self.world_size, self.seed = n, global_batch, rank, world_size, seed
        self.local_batch = global_batch // world_size
        self.pos = pos
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def _perm_for(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            self._perm_epoch = epoch
        return self._perm

    def indices_at(self, pos: int, count: int) -> np.ndarray:
        out = np.empty(count, dtype=np.int64)
        filled = 0
        while filled < count:
            epoch, offset = divmod(pos + filled, self.n)
            take = min(count - filled, self.n - offset)
            out[filled : filled + take] = self._perm_for(epoch)[offset : offset + take]
            filled += take
        return out

    def next_indices(self) -> np.ndarray:
        """This rank's sample indices for the next step; advances the shared position."""
        start = self.pos + self.rank * self.local_batch
        idx = self.indices_at(start, self.local_batch)
        self.pos += self.global_batch
        return idx

    @property
    def epoch(self) -> int:
        return self.pos // self.n

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos, "epoch": self.pos // self.n, "offset": self.pos % self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = int(state["pos"])
