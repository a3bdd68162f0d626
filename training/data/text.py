"""Text data: a split's documents (``documents``), the checks the data gate adds for them beyond
its Great Expectations suite (``text_checks``: invalid UTF-8, documents of only white space, the
same document in train and validation) and their sizes (documents and UTF-8 bytes per split, what
bits per byte are counted in)."""

from __future__ import annotations

import hashlib
from typing import Any


def documents(table, column: str) -> list[Any]:
    """The split's documents in order: strings, or lists of token ids."""
    return table.column(column).to_pylist()


def _invalid_utf8(column) -> list[int]:
    """Rows whose bytes are not UTF-8 (Parquet strings are not checked when read)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    bad, offset = [], 0
    for chunk in column.chunks:
        try:
            chunk.validate(full=True)
        except pa.ArrowInvalid:
            for i, raw in enumerate(pc.cast(chunk, pa.binary()).to_pylist()):
                try:
                    if raw is not None:
                        raw.decode("utf-8")
                except UnicodeDecodeError:
                    bad.append(offset + i)
        offset += len(chunk)
    return bad


def _digest(doc: Any) -> bytes:
    data = doc.encode("utf-8", "surrogatepass") if isinstance(doc, str) else repr(list(doc)).encode()
    return hashlib.sha256(data).digest()


def text_checks(tables: dict[str, Any], column: str) -> tuple[list[str], dict[str, dict[str, int]], dict[str, Any]]:
    """(failure lines, sizes per split, the tables with bytes that are not UTF-8 decoded with
    replacement characters, so the suite can still read them). Nulls and empty strings are the
    suite's to report."""
    import pyarrow as pa

    failures: list[str] = []
    sizes: dict[str, dict[str, int]] = {}
    digests: dict[str, set[bytes]] = {}
    readable = dict(tables)
    for split, table in tables.items():
        col = table.column(column)
        is_text = pa.types.is_string(col.type) or pa.types.is_large_string(col.type)
        bad = set(_invalid_utf8(col)) if is_text else set()
        if bad:
            failures.append(f"{split}: {len(bad)} documents of {column!r} are not valid UTF-8, e.g. row {min(bad)}")
            values = _decoded(col)
            readable[split] = table.set_column(table.column_names.index(column), column, pa.array(values, pa.string()))
        docs = [d for i, d in enumerate(_decoded(col) if bad else col.to_pylist()) if d is not None and i not in bad]
        if is_text:
            blank = sum(1 for d in docs if d and not d.strip())
            if blank:
                failures.append(f"{split}: {blank} documents of {column!r} hold only white space")
            nbytes = sum(len(d.encode("utf-8")) for d in docs)
        else:
            nbytes = 0
        sizes[split] = {"documents": len(docs), "bytes": nbytes}
        digests[split] = {_digest(d) for d in docs if d}
    if "train" in digests and "validation" in digests:
        shared = digests["train"] & digests["validation"]
        if shared:
            failures.append(f"train/validation: {len(shared)} documents of validation are also in train (exact "
                            f"copies): validation would score text the model trained on")
    return failures, sizes, readable


def _decoded(column) -> list[Any]:
    """The column's values as str, bytes that are not UTF-8 as replacement characters."""
    import pyarrow as pa
    import pyarrow.compute as pc

    out: list[Any] = []
    for chunk in column.chunks:
        for raw in pc.cast(chunk, pa.binary()).to_pylist():
            out.append(None if raw is None else raw.decode("utf-8", errors="replace"))
    return out


def unigram_byte_entropy(docs: list[str]) -> float:
    """Bits per byte of the documents' own byte distribution: what a model that learned nothing but
    byte frequencies reaches (a language model worth its name gets well below it)."""
    import math
    from collections import Counter

    counts: Counter[int] = Counter()
    for d in docs:
        counts.update(d.encode("utf-8"))
    total = sum(counts.values())
    return -sum(c / total * math.log2(c / total) for c in counts.values()) if total else 0.0
