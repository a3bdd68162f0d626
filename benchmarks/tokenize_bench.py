"""The tokenize step's speed: MB of text per second through ``training.data.tokens.build`` (encode,
join with end-of-text tokens, pack into windows, write the shards and their manifest) against the
``tokenizers`` library's own batch encoding of the same documents with the same tokenizer, timed
alternately in one run. The corpus is Python's help text repeated to ``--mb`` MB (each copy's
documents numbered, so no two are equal).

    .venv/bin/python benchmarks/tokenize_bench.py [--mb 40] [--tokenizer bpe:4096] [--seq-len 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=40.0)
    ap.add_argument("--tokenizer", default="bpe:4096")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()

    import pyarrow as pa
    import pyarrow.parquet as pq

    from training.data.dataset import open_dataset
    from training.data.options import DataOptions
    from training.data.synthetic import python_help_paragraphs
    from training.data.text import documents
    from training.data.tokenizer import resolve
    from training.data.tokens import build

    base = python_help_paragraphs()
    size = sum(len(d.encode()) for d in base)
    copies = max(1, int(a.mb * 1e6 // size))
    docs = [f"{i}. {d}" for i in range(copies) for d in base]
    tmp = Path(tempfile.mkdtemp(prefix="tokenize-bench-"))
    for split, part in (("train", docs[: len(docs) * 9 // 10]), ("validation", docs[len(docs) * 9 // 10:])):
        (tmp / "data" / split).mkdir(parents=True)
        pq.write_table(pa.table({"text": part}), tmp / "data" / split / "part-0.parquet")
    ds = open_dataset(tmp / "data", DataOptions(text_column="text"))
    both = [d for split in ("train", "validation") for d in documents(ds.table(split), "text")]
    mb = sum(len(d.encode()) for d in both) / 1e6
    tok = resolve(a.tokenizer, train_documents=lambda: documents(ds.table("train"), "text")[:20_000])
    print(f"{mb:.1f} MB of text, {len(both)} documents, tokenizer {a.tokenizer}, seq_len {a.seq_len}, "
          f"{os.cpu_count()} CPUs  [load {os.getloadavg()[0]:.2f}]")
    ours, library = [], []
    for i in range(a.repeats):
        t0 = time.perf_counter()
        built = build(ds, text_column="text", tokenizer=tok, seq_len=a.seq_len, store_uri=str(tmp / f"store{i}"))
        ours.append(mb / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        tok.tokenizer.encode_batch(both, add_special_tokens=False)
        library.append(mb / (time.perf_counter() - t0))
        print(f"  round {i + 1}: tokenize step {ours[-1]:6.2f} MB/s ({built.stats['splits']['train']['tokens']} train "
              f"tokens) | tokenizers encode_batch alone {library[-1]:6.2f} MB/s  [load {os.getloadavg()[0]:.2f}]")
    print(f"tokenize step {statistics.median(ours):.2f} MB/s, encode_batch alone {statistics.median(library):.2f} MB/s: "
          f"the step runs at {statistics.median(o / b for o, b in zip(ours, library)):.2f}x the library's encoding "
          "(median of rounds; the step also reads the table, packs the windows and writes the shards)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
