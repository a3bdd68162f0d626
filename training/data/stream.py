"""Streamed training data: a split read block by block (``NpyBlocks``: runs of rows of ``.npy``
shards, e.g. token windows; ``ParquetBlocks`` in training/data/table_stream.py: a table's row
groups), never whole. ``StreamLoader`` serves a rank's batches in the
sampler's global order (training/data/sampler.py) from a bounded buffer: the rows of the current
shuffle window, and the next window read ahead by one background thread. A rank's memory is two
windows, whatever the split's size. Why this and not a library:
docs/decisions/0009-streamed-training-data.md.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from training.data.sampler import ShardedSampler

BLOCK_BYTES = 1 << 20  # rows per block: about 1 MiB of the shard's bytes


class NpyRows:
    """Rows of a C-ordered ``.npy`` file read with ``os.preadv`` (no memory map: the pages a map
    touches stay in the process's resident set)."""

    def __init__(self, path: Path):
        header = np.load(path, mmap_mode="r")  # shape, dtype and data offset; no page is touched
        assert header.flags.c_contiguous, f"{path}: not a C-ordered array"
        self.path, self.shape, self.dtype, self.offset = path, header.shape, header.dtype, header.offset
        del header
        self.row_bytes = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize

    def read_into(self, out: np.ndarray, a: int) -> None:
        """Rows ``[a, a + len(out))`` into ``out`` (contiguous, this file's dtype)."""
        view, at, done = memoryview(out.reshape(-1).view(np.uint8)), self.offset + a * self.row_bytes, 0
        with open(self.path, "rb", buffering=0) as f:  # opened per read: nothing held between windows
            while done < len(view):
                got = os.preadv(f.fileno(), [view[done:]], at + done)
                if got <= 0:
                    raise OSError(f"{self.path}: short read at row {a}")
                done += got

    def read(self, a: int, b: int) -> np.ndarray:
        out = np.empty((b - a, *self.shape[1:]), dtype=self.dtype)
        self.read_into(out, a)
        return out


class NpyBlocks:
    """A split kept as ``{split}.npy`` (and ``{split}_labels.npy`` when it has labels) in blocks of
    about ``block_bytes``; batches come out as ``dtype`` (int64 for token ids)."""

    def __init__(self, folder: Path, split: str, dtype=np.int64, block_bytes: int = BLOCK_BYTES):
        self.rows = NpyRows(folder / f"{split}.npy")
        labels = folder / f"{split}_labels.npy"
        self.labels = NpyRows(labels) if labels.is_file() else None
        self.dtype = np.dtype(dtype)
        self.label_dtype = np.dtype(np.int64)
        n = self.rows.shape[0]
        self.per_block = max(1, block_bytes // self.rows.row_bytes)
        self.sizes = [min(self.per_block, n - a) for a in range(0, n, self.per_block)]

    def window_for(self, shuffle_window: int) -> int:
        """Blocks per shuffle window: ``shuffle_window`` (a block is about 1 MiB)."""
        return shuffle_window

    def held_bytes(self, window: int) -> int:
        """The most a ``StreamLoader`` holds: two windows of ``window`` blocks."""
        label_bytes = self.labels.row_bytes if self.labels is not None else 0
        return 2 * window * self.per_block * (self.rows.row_bytes + label_bytes)

    def read_window(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """The rows of ``blocks`` (ascending) in one array each, in the file's dtype."""
        total = sum(self.sizes[b] for b in blocks)
        x = np.empty((total, *self.rows.shape[1:]), dtype=self.rows.dtype)
        y = np.empty((total, *self.labels.shape[1:]), dtype=self.labels.dtype) if self.labels is not None else None
        at = 0
        for b in blocks.tolist():
            k = self.sizes[b]
            self.rows.read_into(x[at : at + k], b * self.per_block)
            if y is not None:
                self.labels.read_into(y[at : at + k], b * self.per_block)
            at += k
        return x, y


class StreamLoader:
    """This rank's batches in the sampler's order from the current shuffle window's rows; the next
    window is read in the background while this one trains."""

    def __init__(self, blocks: NpyBlocks, sampler: ShardedSampler):
        self.source, self.sampler = blocks, sampler
        self._windows: dict[tuple[int, int], Future] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="prefetch")
        self.peak_windows = 0  # the most windows held or in flight at once (the buffer's bound)

    def _window(self, key: tuple[int, int]) -> Future:
        if key not in self._windows:
            self._windows[key] = self._pool.submit(self.source.read_window, self.sampler.window_blocks(*key))
        return self._windows[key]

    def next_batch(self) -> tuple[np.ndarray, np.ndarray | None]:
        """(features, labels) of this rank's share of the next global batch; advances the sampler."""
        s = self.sampler
        segments = s.segments(s.pos + s.rank * s.local_batch, s.local_batch)
        s.pos += s.global_batch
        keys = [(e, w) for e, w, _ in segments]
        # Read ahead the window after this one; a batch that spans two windows waits for the next batch.
        ahead = s.next_window(*keys[0]) if len(keys) == 1 else None
        for key in [k for k in self._windows if k not in keys and k != ahead]:
            self._windows.pop(key).cancel()  # a finished window: its rows are dropped
        parts = [(self._window(key).result(), local) for key, (_, _, local) in zip(keys, segments)]
        if ahead is not None:
            self._window(ahead)
        self.peak_windows = max(self.peak_windows, len(self._windows))
        xs = [wx[local] for (wx, _), local in parts]
        x = (xs[0] if len(xs) == 1 else np.concatenate(xs)).astype(self.source.dtype, copy=False)
        if parts[0][0][1] is None:
            return x, None
        ys = [wy[local] for (_, wy), local in parts]
        return x, (ys[0] if len(ys) == 1 else np.concatenate(ys)).astype(self.source.label_dtype, copy=False)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
