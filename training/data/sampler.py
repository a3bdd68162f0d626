"""``ShardedSampler``: a deterministic global order of training rows, sharded by rank.

Training data is an endless stream of epochs. The rows are cut into blocks (Parquet row groups,
runs of token windows: what a reader fetches at once); epoch ``e`` permutes the blocks by
``(seed, e)``, groups them into shuffle windows of ``window`` blocks and shuffles the rows within
each window. A reader then holds one window (and prefetches the next), never the whole split; a
split of at most one window is one full permutation by ``(seed, epoch)``. The whole state is the
global position ``pos``; step ``s`` takes positions ``[s * B, (s + 1) * B)`` and rank ``r`` of
``W`` the ``r``-th contiguous ``B / W`` of them. Every sample is seen once per epoch across ranks,
a batch may straddle an epoch boundary, and resuming at ``pos`` (on any world size that divides
``B``) reproduces the same order exactly. Why blocks: docs/decisions/0009-streamed-training-data.md.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

_BLOCKS = 0xB10C  # a stream of its own for the block permutation


class ShardedSampler:
    """Deterministic global order, sharded by rank; state is the global position."""

    def __init__(self, n: int, *, global_batch: int, rank: int, world_size: int, seed: int, pos: int = 0,
                 blocks: Sequence[int] | None = None, window: int = 1):
        assert global_batch % world_size == 0, "checked by TrainConfig.check_world_size"
        self.n, self.global_batch, self.rank, self.world_size, self.seed = n, global_batch, rank, world_size, seed
        self.local_batch = global_batch // world_size
        self.pos = pos
        self.blocks = np.asarray(blocks if blocks is not None else [n], dtype=np.int64)  # rows per block
        assert int(self.blocks.sum()) == n and window >= 1
        self.starts = np.concatenate([[0], np.cumsum(self.blocks)[:-1]])  # first row of each block
        self.window = window
        self._epoch = -1
        self._windows: list[np.ndarray] = []  # epoch's windows: block ids, ascending within each
        self._ends = np.empty(0, dtype=np.int64)  # epoch position where each window ends
        self._rows_key: tuple[int, int] = (-1, -1)
        self._rows = np.empty(0, dtype=np.int64)

    def _plan(self, epoch: int) -> None:
        if epoch == self._epoch:
            return
        nb = len(self.blocks)
        order = np.random.default_rng([self.seed, epoch, _BLOCKS]).permutation(nb) if nb > self.window else np.arange(nb)
        self._windows = [np.sort(order[i : i + self.window]) for i in range(0, nb, self.window)]
        self._ends = np.cumsum([int(self.blocks[w].sum()) for w in self._windows])
        self._epoch = epoch

    def window_at(self, pos: int) -> tuple[int, int]:
        """(epoch, window) that global position ``pos`` falls in."""
        epoch, offset = divmod(pos, self.n)
        self._plan(epoch)
        return epoch, int(np.searchsorted(self._ends, offset, side="right"))

    def window_blocks(self, epoch: int, w: int) -> np.ndarray:
        """The block ids of window ``w`` of ``epoch`` (what a reader loads for it)."""
        self._plan(epoch)
        return self._windows[w % len(self._windows)]

    def next_window(self, epoch: int, w: int) -> tuple[int, int]:
        self._plan(epoch)
        return (epoch, w + 1) if w + 1 < len(self._windows) else (epoch + 1, 0)

    def _window_perm(self, epoch: int, w: int) -> np.ndarray:
        """Window ``w``'s shuffle: positions into its rows (its blocks' rows, blocks ascending)."""
        if self._rows_key != (epoch, w):
            size = int(self.blocks[self.window_blocks(epoch, w)].sum())
            # Window 0 draws from (seed, epoch) alone: a split in one window keeps the full permutation.
            key = [self.seed, epoch] if w == 0 else [self.seed, epoch, w]
            self._rows = np.random.default_rng(key).permutation(size)
            self._rows_key = (epoch, w)
        return self._rows

    def segments(self, pos: int, count: int) -> list[tuple[int, int, np.ndarray]]:
        """Positions ``[pos, pos + count)`` as (epoch, window, positions into the window's rows)."""
        out, filled = [], 0
        while filled < count:
            epoch, w = self.window_at(pos + filled)
            offset = (pos + filled) % self.n
            begin = int(self._ends[w - 1]) if w else 0
            take = min(count - filled, int(self._ends[w]) - offset)
            out.append((epoch, w, self._window_perm(epoch, w)[offset - begin : offset - begin + take]))
            filled += take
        return out

    def indices_at(self, pos: int, count: int) -> np.ndarray:
        """The sample (row) ids at positions ``[pos, pos + count)``."""
        parts = []
        for epoch, w, local in self.segments(pos, count):
            blocks = self.window_blocks(epoch, w)
            sizes = self.blocks[blocks]
            firsts = np.concatenate([[0], np.cumsum(sizes)[:-1]])  # where each block starts in the window
            at = np.searchsorted(firsts, local, side="right") - 1
            parts.append(self.starts[blocks][at] + (local - firsts[at]))
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

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
