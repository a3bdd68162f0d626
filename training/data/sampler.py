"""``ShardedSampler``: a deterministic global order of training rows, sharded by rank.

Training data is an endless stream of epochs, each a fresh permutation seeded by ``(seed, epoch)``.
The whole state is the global position ``pos``; step ``s`` takes positions ``[s * B, (s + 1) * B)``
and rank ``r`` of ``W`` the ``r``-th contiguous ``B / W`` of them. Every sample is seen once per
epoch across ranks, a batch may straddle an epoch boundary, and resuming at ``pos`` (on any world
size that divides ``B``) reproduces the same order exactly.
"""

from __future__ import annotations

import numpy as np


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
