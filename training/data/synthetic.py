"""Dataset generators with a known answer, so convergence is judged against a number written next
to the data (``dataset.json``):

- ``teacher``: standard normal features labelled by a fixed random two-layer network, each label
  replaced by a random class with probability ``label_noise``: ``bayes_accuracy = 1 - label_noise
  * (C - 1) / C`` is the best any model can reach;
- ``digits``: scikit-learn's 8x8 handwritten digits (64 columns ``p0..p63``, 10 classes, 80/20);
- ``markov``: token sequences of a fixed first-order Markov chain over ``vocab`` symbols, started
  from its stationary distribution; ``loss_floor`` is the chain's entropy rate (nats).

Every kind writes ``{root}/dataset.json`` (``kind``, ``features``, ``feature_dtype``,
``feature_range``, ``label``, ``n_classes`` and its answer), ``{root}/train/part-00000.parquet``
and ``{root}/validation/part-00000.parquet``, so validation and loading stay generic.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

SPLITS = ("train", "validation")


def teacher_labels(x: np.ndarray, n_classes: int, seed: int) -> np.ndarray:
    """Labels from the fixed teacher network determined by ``seed`` (noise-free)."""
    rng = np.random.default_rng(seed + 10_000)
    d = x.shape[1]
    w1 = rng.normal(0.0, 1.0 / np.sqrt(d), size=(d, 32))
    w2 = rng.normal(0.0, 1.0 / np.sqrt(32), size=(32, n_classes))
    return np.argmax(np.tanh(x @ w1) @ w2, axis=1)


def make_teacher_dataset(
    root: str | Path,
    *,
    n_train: int = 20_000,
    n_val: int = 4_000,
    n_features: int = 16,
    n_classes: int = 4,
    label_noise: float = 0.1,
    seed: int = 0,
) -> dict[str, Any]:
    """Write the ``teacher`` dataset under ``root`` and return its ``dataset.json`` content."""
    if n_train <= 0 or n_val <= 0:
        raise ValueError("n_train and n_val must be positive")
    if not 0.0 <= label_noise < 1.0:
        raise ValueError("label_noise must be in [0, 1)")
    root = Path(root)
    rng = np.random.default_rng(seed)
    feature_names = [f"f{i}" for i in range(n_features)]
    counts = {"train": n_train, "validation": n_val}
    for split in SPLITS:
        n = counts[split]
        x = rng.normal(size=(n, n_features)).astype(np.float32)
        y = teacher_labels(x, n_classes, seed)
        flip = rng.random(n) < label_noise
        y = np.where(flip, rng.integers(0, n_classes, size=n), y).astype(np.int64)
        _write_split(root, split, {**{name: x[:, i] for i, name in enumerate(feature_names)}, "label": y})
    meta = {
        "kind": "tabular",
        "generator": "teacher",
        "feature_dtype": "float",
        "seed": seed,
        "features": feature_names,
        "label": "label",
        "n_classes": n_classes,
        # 6 sigma of a standard normal: wider values mean the data is not what it claims.
        "feature_range": [-6.0, 6.0],
        "label_noise": label_noise,
        "bayes_accuracy": 1.0 - label_noise * (n_classes - 1) / n_classes,
        "chance_accuracy": 1.0 / n_classes,
        "rows": counts,
    }
    (root / "dataset.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _write_split(root: Path, split: str, columns: dict[str, np.ndarray]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / split).mkdir(parents=True, exist_ok=True)
    tmp = root / split / "part-00000.parquet.tmp"
    pq.write_table(pa.table(columns), tmp)
    tmp.replace(root / split / "part-00000.parquet")


def make_digits_dataset(root: str | Path, *, seed: int = 0) -> dict[str, Any]:
    """Real data: scikit-learn's bundled 8x8 digits (no download), split 80/20 by ``seed``."""
    from sklearn.datasets import load_digits

    root = Path(root)
    digits = load_digits()
    x = digits.data.astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    cut = int(0.8 * len(y))
    names = [f"p{i}" for i in range(x.shape[1])]
    rows = {}
    for split, idx in (("train", order[:cut]), ("validation", order[cut:])):
        _write_split(root, split, {**{n: x[idx, i] for i, n in enumerate(names)}, "label": y[idx]})
        rows[split] = len(idx)
    meta = {"kind": "images", "generator": "digits", "seed": seed, "features": names, "feature_dtype": "float",
            "image_shape": [1, 8, 8], "label": "label", "n_classes": 10, "feature_range": [0.0, 16.0],
            "chance_accuracy": 0.1, "rows": rows}
    (root / "dataset.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def markov_chain(vocab: int, seed: int, concentration: float = 0.1) -> tuple[np.ndarray, np.ndarray, float]:
    """Transition matrix, stationary distribution and entropy rate (nats) of the fixed chain."""
    rng = np.random.default_rng(seed + 20_000)
    trans = rng.dirichlet(np.full(vocab, concentration), size=vocab)
    # Stationary distribution: left eigenvector for eigenvalue 1, by power iteration (exact enough).
    pi = np.full(vocab, 1.0 / vocab)
    for _ in range(10_000):
        nxt = pi @ trans
        if np.abs(nxt - pi).max() < 1e-15:
            break
        pi = nxt
    with np.errstate(divide="ignore", invalid="ignore"):
        row_entropy = -np.nansum(np.where(trans > 0, trans * np.log(trans), 0.0), axis=1)
    return trans, pi, float(pi @ row_entropy)


def make_markov_dataset(root: str | Path, *, n_train: int = 8_000, n_val: int = 1_000, vocab: int = 16,
                        seq_len: int = 32, seed: int = 0) -> dict[str, Any]:
    """Token sequences of ``seq_len + 1`` tokens (inputs and shifted targets) from a fixed chain."""
    root = Path(root)
    trans, pi, entropy_rate = markov_chain(vocab, seed)
    cdf = np.cumsum(trans, axis=1)
    rng = np.random.default_rng(seed)
    names = [f"t{i}" for i in range(seq_len + 1)]
    counts = {"train": n_train, "validation": n_val}
    for split in SPLITS:
        n = counts[split]
        seq = np.empty((n, seq_len + 1), dtype=np.int64)
        seq[:, 0] = rng.choice(vocab, size=n, p=pi)
        for t in range(1, seq_len + 1):
            u = rng.random(n)[:, None]
            seq[:, t] = np.minimum((u > cdf[seq[:, t - 1]]).sum(axis=1), vocab - 1)
        _write_split(root, split, {name: seq[:, i] for i, name in enumerate(names)})
    meta = {"kind": "tokens", "generator": "markov", "seed": seed, "features": names, "feature_dtype": "int",
            "label": None, "n_classes": vocab, "vocab_size": vocab, "seq_len": seq_len,
            "feature_range": [0, vocab - 1], "loss_floor": entropy_rate,
            "uniform_loss": float(np.log(vocab)), "rows": counts}
    (root / "dataset.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def python_help_paragraphs() -> list[str]:
    """Real English text that ships with Python: the paragraphs of its interactive help topics
    (``pydoc_data.topics``, about 0.5 MB), each once, in a fixed order."""
    from pydoc_data.topics import topics

    seen: dict[str, None] = {}
    for name in sorted(topics):
        for para in topics[name].split("\n\n"):
            para = para.strip("\n")
            if len(para.strip()) >= 40:
                seen.setdefault(para, None)
    return list(seen)


def looks_like_code(paragraph: str) -> int:
    """1 for a paragraph of code or grammar (``::=`` rules, ``>>>`` sessions, indented lines), else 0."""
    return int("::=" in paragraph or ">>>" in paragraph or any(line.startswith("   ") for line in paragraph.splitlines()))


def make_text_dataset(root: str | Path, *, validation_share: float = 0.2, labels: bool = False,
                      names: bool = False) -> dict[str, Any]:
    """Documents of real text (``python_help_paragraphs``) in train/ and validation/ Parquet files
    with one column ``text``; a document goes to validation by a hash of its text. No dataset.json:
    text needs none (``text_column=text``). ``labels``: also a column ``label``, 1 where the
    paragraph is code or grammar and 0 where it is prose (``looks_like_code``): a classifier's data;
    with ``names``, the classes as names: ``code`` and ``prose``."""
    import hashlib

    root = Path(root)
    docs = python_help_paragraphs()
    val = [hashlib.sha256(d.encode()).digest()[0] < 256 * validation_share for d in docs]
    counts = {}
    for split, keep in (("train", False), ("validation", True)):
        part = [d for d, v in zip(docs, val) if v == keep]
        columns: dict[str, Any] = {"text": part}
        if labels:
            codes = np.array([looks_like_code(d) for d in part], dtype=np.int64)
            columns["label"] = np.array(["prose", "code"])[codes] if names else codes
        _write_split(root, split, columns)
        counts[split] = len(part)
    return {"kind": "text", "text_column": "text", "label": "label" if labels else None, "rows": counts}


INSTRUCTIONS = (  # (the instruction, how its answer follows from the words): learnable from the prompt alone
    ("Write these words in capitals:", lambda words: " ".join(w.upper() for w in words)),
    ("Write these words in reverse order:", lambda words: " ".join(reversed(words))),
    ("Give the first and the last of these words:", lambda words: f"{words[0]} {words[-1]}"),
)


def make_instructions_dataset(root: str | Path, *, validation_share: float = 0.2, words: int = 6) -> dict[str, Any]:
    """Instruction data for supervised fine-tuning, from ``python_help_paragraphs``: each example
    an instruction over the first ``words`` words of a paragraph and its answer (the words in
    capitals, in reverse order, or the first and the last). Three columns in train/ and
    validation/ Parquet files: ``prompt`` and ``response`` (strings), and ``messages`` (the same
    as a conversation after a system turn: ``[{role, content}]``). A paragraph goes to validation
    by a hash of its text, as ``make_text_dataset`` splits."""
    import hashlib

    root = Path(root)
    examples, seen = [], set()
    for i, para in enumerate(python_help_paragraphs()):
        picked = [w.strip(".,:;()\"'`") for w in para.split()[:words]]
        picked = [w for w in picked if w]
        instruction, answer = INSTRUCTIONS[i % len(INSTRUCTIONS)]
        prompt = f"{instruction} {' '.join(picked)}"
        if len(picked) < 3 or prompt in seen:  # paragraphs that begin alike: one example each
            continue
        seen.add(prompt)
        examples.append((para, prompt, answer(picked)))
    counts = {}
    for split, keep in (("train", False), ("validation", True)):
        part = [(p, r) for d, p, r in examples if (hashlib.sha256(d.encode()).digest()[0] < 256 * validation_share) == keep]
        prompts, responses = [p for p, _ in part], [r for _, r in part]
        messages = [[{"role": "system", "content": "Answer with the words only."}, {"role": "user", "content": p},
                     {"role": "assistant", "content": r}] for p, r in part]
        _write_split(root, split, {"prompt": prompts, "response": responses, "messages": messages})
        counts[split] = len(part)
    return {"kind": "text", "prompt_column": "prompt", "response_column": "response", "messages_column": "messages",
            "rows": counts}


GENERATORS = {"teacher": make_teacher_dataset, "digits": make_digits_dataset, "markov": make_markov_dataset,
              "text": make_text_dataset, "text-classes": lambda root: make_text_dataset(root, labels=True, names=True),
              "instructions": make_instructions_dataset}


def read_meta(root: str | Path) -> dict[str, Any]:
    path = Path(root) / "dataset.json"
    if not path.exists():
        raise FileNotFoundError(
            f"{path} not found: dataset_uri must be a folder written by `python -m training make-data`"
        )
    return json.loads(path.read_text())


def write_repeated_npy(path: str | Path, rows: np.ndarray, nbytes: int) -> int:
    """``rows`` repeated into an ``.npy`` file of at least ``nbytes`` (data larger than memory,
    written in 64 MiB chunks, never held whole); returns its rows."""
    chunk = np.tile(rows, (max(1, -(-min(64 << 20, nbytes) // rows.nbytes)), *([1] * (rows.ndim - 1))))
    repeats = -(-nbytes // chunk.nbytes)
    n = repeats * len(chunk)
    header = {"descr": np.lib.format.dtype_to_descr(chunk.dtype), "fortran_order": False, "shape": (n, *rows.shape[1:])}
    data = chunk.tobytes()
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, header)
        for _ in range(repeats):
            f.write(data)
    return n


def grow_token_shards(folder: str | Path, nbytes: int, split: str = "train") -> int:
    """Token shards (training/data/tokens.py) whose ``{split}.npy`` repeats its rows to at least
    ``nbytes`` (and ``{split}_labels.npy`` their classes), their manifest and sizes updated to
    match; returns the split's rows."""
    from training.data.tokens import MANIFEST, STATS
    from training.util import sha256_file

    folder = Path(folder)
    n = write_repeated_npy(folder / f"{split}.npy", np.load(folder / f"{split}.npy"), nbytes)
    labels = folder / f"{split}_labels.npy"
    if labels.is_file():  # row i repeats row i % rows, as write_repeated_npy tiles them
        np.save(labels, np.resize(np.load(labels), n))
    stats = json.loads((folder / STATS).read_text())
    stats["splits"][split]["windows"] = n
    (folder / STATS).write_text(json.dumps(stats, indent=2) + "\n")
    manifest = json.loads((folder / MANIFEST).read_text())
    for entry in manifest["files"]:
        path = folder / entry["path"]
        entry.update(size=path.stat().st_size, sha256=sha256_file(path))
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return n
