"""Streamed training data: a split read block by block (``TokenBlocks``: runs of token windows of
an ``.npy`` shard; ``RowGroupBlocks``: Parquet row groups), never whole. ``StreamLoader`` serves a
rank's batches in the sampler's global order (training/data/sampler.py) from a bounded buffer: the
blocks of the current shuffle window, and the next window read ahead by one background thread. A
rank's memory is about two windows, whatever the split's size.
Why this and not a library: docs/decisions/0009-streamed-training-data.md.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import numpy as np

from training.data.sampler import ShardedSampler

BLOCK_BYTES = 1 << 20  # token windows per block: about 1 MiB of the shard's bytes


class Blocks(Protocol):
    """A split cut into blocks a reader fetches at once."""

    sizes: list[int]  # rows per block

    def read(self, block: int) -> tuple[np.ndarray, np.ndarray | None]:
        """(features, labels) of one block, in the dtype the model reads."""
        ...


class NpyRows:
    """Rows ``[a, b)`` of a C-ordered ``.npy`` file read with ``os.pread`` (no memory map: the
    pages a map touches stay in the process's resident set)."""

    def __init__(self, path: Path):
        header = np.load(path, mmap_mode="r")  # shape, dtype and data offset; no page is touched
        assert header.flags.c_contiguous, f"{path}: not a C-ordered array"
        self.path, self.shape, self.dtype, self.offset = path, header.shape, header.dtype, header.offset
        del header
        self.row_bytes = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize
        self.fd = os.open(path, os.O_RDONLY)

    def read(self, a: int, b: int) -> np.ndarray:
        buf = bytearray((b - a) * self.row_bytes)
        view, at, done = memoryview(buf), self.offset + a * self.row_bytes, 0
        while done < len(buf):
            got = os.preadv(self.fd, [view[done:]], at + done)
            if got <= 0:
                raise OSError(f"{self.path}: short read at row {a}")
            done += got
        return np.frombuffer(buf, dtype=self.dtype).reshape((b - a, *self.shape[1:]))

    def close(self) -> None:
        os.close(self.fd)


class TokenBlocks:
    """A token split (``{split}.npy``, and ``{split}_labels.npy`` for a classifier) in blocks of
    about ``BLOCK_BYTES``; features come out int64 as the model reads them."""

    def __init__(self, folder: Path, split: str, block_bytes: int = BLOCK_BYTES):
        self.rows = NpyRows(folder / f"{split}.npy")
        labels = folder / f"{split}_labels.npy"
        self.labels = NpyRows(labels) if labels.is_file() else None
        n = self.rows.shape[0]
        per = max(1, block_bytes // self.rows.row_bytes)
        self.per_block = per
        self.sizes = [min(per, n - a) for a in range(0, n, per)]

    def read(self, block: int) -> tuple[np.ndarray, np.ndarray | None]:
        a = block * self.per_block
        b = a + self.sizes[block]
        x = self.rows.read(a, b).astype(np.int64)
        return x, (self.labels.read(a, b).astype(np.int64) if self.labels is not None else None)


class StreamLoader:
    """This rank's batches in the sampler's order, from the blocks of the current shuffle window;
    the next window is read in the background while this one trains."""

    def __init__(self, blocks: Blocks, sampler: ShardedSampler):
        self.source, self.sampler = blocks, sampler
        self.starts = sampler.starts
        self._have: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}
        self._pending: dict[int, Future] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="prefetch")
        self.peak_blocks = 0  # the most blocks held at once (the buffer's bound, measured)

    def _get(self, block: int) -> tuple[np.ndarray, np.ndarray | None]:
        if block not in self._have:
            fut = self._pending.pop(block, None)
            self._have[block] = fut.result() if fut is not None else self.source.read(block)
        return self._have[block]

    def next_batch(self) -> tuple[np.ndarray, np.ndarray | None]:
        """(features, labels) of this rank's share of the next global batch; advances the sampler."""
        s = self.sampler
        first = s.pos + s.rank * s.local_batch
        here = s.window_at(first)
        after = s.next_window(*here)
        idx = s.next_indices()
        block_of = np.searchsorted(self.starts, idx, side="right") - 1
        needed = np.unique(block_of)
        keep = set(needed.tolist()) | set(s.window_blocks(*here).tolist()) | set(s.window_blocks(*after).tolist())
        for b in [b for b in self._have if b not in keep]:
            del self._have[b]
        for b in [b for b in self._pending if b not in keep]:
            self._pending.pop(b).cancel()
        ahead = [*s.window_blocks(*here).tolist(), *s.window_blocks(*after).tolist()]
        for b in ahead:  # read ahead, in order: this window's blocks, then the next window's
            if b not in self._have and b not in self._pending:
                self._pending[b] = self._pool.submit(self.source.read, b)
        x0, y0 = self._get(int(needed[0]))
        x = np.empty((len(idx), *x0.shape[1:]), dtype=x0.dtype)
        y = np.empty(len(idx), dtype=y0.dtype) if y0 is not None else None
        for b in needed.tolist():
            bx, by = self._get(b)
            sel = block_of == b
            rows = idx[sel] - self.starts[b]
            x[sel] = bx[rows]
            if y is not None:
                y[sel] = by[rows]
        self.peak_blocks = max(self.peak_blocks, len(self._have) + len(self._pending))
        return x, y

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
