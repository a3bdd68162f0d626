"""Token shards: what the ranks read of a text dataset, made once by the tokenize step.

``build`` tokenizes each split. A language model's text: the end-of-text token after every
document, the stream packed into windows of ``seq_len + 1`` tokens (the model reads the first
``seq_len`` and predicts the last ``seq_len``; the tail shorter than a window is dropped). A
classifier's: one row per document, its first ``seq_len`` tokens padded with ``pad_id`` (one id
past the tokenizer's), and its class. ``train.npy``, ``validation.npy`` (and ``*_labels.npy``),
``tokenizer.json`` and ``tokens.json`` (documents, UTF-8 bytes and tokens per split, prompts) go
under ``{store}/tokens/{key}/``, ``manifest.json`` (each file's size and sha256) last. The key
hashes the data fingerprint, the tokenizer, ``seq_len`` and the columns: a second run on the same
finds them. ``open_shards`` reads them back, verified; ``TokenDataset`` serves them.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from training.config.fields import ConfigError
from training.data.dataset import Dataset, Split
from training.data.sources import cache_dir
from training.data.stream import NpyBlocks, NpyRows
from training.data.text import documents
from training.data.tokenizer import LoadedTokenizer, load_json
from training.store import StoreError, open_store
from training.util import sha256_cached, sha256_file

FORMAT = 1  # bump when the shards' layout changes: old keys then miss
SPLITS = ("train", "validation")
MANIFEST, STATS, TOKENIZER = "manifest.json", "tokens.json", "tokenizer.json"
PROMPTS = 4  # validation documents whose beginning the samples continue
PROMPT_CHARS = 80


def shard_key(fingerprint: str, tokenizer_sha256: str, seq_len: int, text_column: str, label: str | None = None,
              sft: str = "") -> str:
    parts = (str(FORMAT), fingerprint, tokenizer_sha256, str(seq_len), text_column, label or "") + ((sft,) if sft else ())
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


@dataclass
class Built:
    uri: str  # the shards' folder in the store
    key: str
    cache_hit: bool
    stats: dict[str, Any]  # tokens.json
    seconds: float


def _windows(ids: list[list[int]], eot: int, seq_len: int) -> tuple[np.ndarray, int]:
    """The documents' ids joined by the end-of-text token, cut into windows of ``seq_len + 1``;
    (windows, tokens of the stream)."""
    stream = np.fromiter((t for doc in ids for t in (*doc, eot)), dtype=np.int64)
    n = len(stream) // (seq_len + 1)
    return stream[: n * (seq_len + 1)].reshape(n, seq_len + 1), len(stream)


def classifier_rows(ids: list[list[int]], pad: int, seq_len: int) -> np.ndarray:
    """A classifier's rows: each document's first ``seq_len`` ids, padded with ``pad``."""
    out = np.full((len(ids), seq_len), pad, dtype=np.int64)
    for i, doc in enumerate(ids):
        out[i, : min(len(doc), seq_len)] = doc[:seq_len]
    return out


def encode_documents(docs: list[Any], tok: LoadedTokenizer, *, special: bool = False) -> tuple[list[list[int]], int]:
    """Token ids of each document, and the UTF-8 bytes the tokenizer could not represent (its
    unknown token's spans; 0 for byte-level tokenizers)."""
    if docs and not isinstance(docs[0], str):  # pre-tokenized (list<int>)
        return [list(d) for d in docs], 0
    encodings = tok.tokenizer.encode_batch(docs, add_special_tokens=special)
    unk = tok.tokenizer.token_to_id(getattr(tok.tokenizer.model, "unk_token", None) or "") if docs else None
    lost = 0
    if unk is not None:
        for doc, enc in zip(docs, encodings):
            lost += sum(len(doc[a:b].encode("utf-8")) for i, (a, b) in zip(enc.ids, enc.offsets) if i == unk)
    return [e.ids for e in encodings], lost


def build(dataset: Dataset, *, text_column: str, tokenizer: LoadedTokenizer, seq_len: int, store_uri: str,
          env: Mapping[str, str] | None = None, model: str = "", model_folder: Path | None = None,
          chat_template: str | None = None, max_truncated_share: float = 0.05) -> Built:
    """The token shards of ``dataset`` in ``{store_uri}/tokens/{key}``: found there, or made now.
    SFT examples (``dataset.meta["sft"]``) are rendered with ``chat_template`` (or the template in
    the hf: ``model``'s ``model_folder``) and packed (training/data/sft.py)."""
    t0 = time.perf_counter()
    meta = dataset.meta
    label = meta.get("label") if meta.get("task") == "classification" else None
    rend, sft_part = None, ""
    if meta.get("sft"):
        from training.data import sft

        rend = sft.renderer(chat_template, model=model, tokenizer=tokenizer.tokenizer, eot_id=tokenizer.eot_id,
                            messages="messages_column" in meta["sft"], model_folder=model_folder)
        text_column = ",".join(sft.columns(meta["sft"]))
        sft_part = json.dumps({"columns": meta["sft"], "template": rend.template, "cut": max_truncated_share},
                              sort_keys=True)
    key = shard_key(dataset.fingerprint, tokenizer.sha256, seq_len, text_column, label, sft_part)
    store = open_store(store_uri, env, field="store_uri")
    prefix = f"tokens/{key}"
    raw = store.get_bytes(f"{prefix}/{MANIFEST}")
    if raw is not None:
        stats = json.loads(store.get_bytes(f"{prefix}/{STATS}") or b"{}")
        return Built(uri=f"{store.uri.rstrip('/')}/{prefix}", key=key, cache_hit=True, stats=stats,
                     seconds=time.perf_counter() - t0)
    stats: dict[str, Any] = {"format": FORMAT, "key": key, "seq_len": seq_len, "text_column": text_column,
                             "tokenizer": tokenizer.source, "tokenizer_sha256": tokenizer.sha256,
                             "vocab_size": tokenizer.vocab_size, "eot_id": tokenizer.eot_id,
                             "data_fingerprint": dataset.fingerprint, "splits": {}}
    if label:  # a classifier's rows are padded: with the tokenizer's own padding token, else one id past its ids
        pad = next((tokenizer.tokenizer.token_to_id(t) for t in ("[PAD]", "<pad>", "<|pad|>")
                    if tokenizer.tokenizer.token_to_id(t) is not None), tokenizer.vocab_size)
        stats.update(label=label, classes=list(meta["classes"]), pad_id=int(pad))
    arrays: dict[str, np.ndarray] = {}
    if rend is not None:
        stats["sft"] = {"columns": meta["sft"], "rendering": rend.source,
                        "stop_id": rend.stop_id(tokenizer.tokenizer, tokenizer.eot_id)}
        _build_sft(dataset, meta["sft"], rend, tokenizer, seq_len, max_truncated_share, stats, arrays)
    for split in SPLITS if rend is None else ():
        table = dataset.table(split)
        docs = [d for d in documents(table, text_column) if d is not None]
        # A classifier's document is one sequence: the tokenizer's template ([CLS] ... [SEP]) applies.
        ids, lost = encode_documents(docs, tokenizer, special=bool(label))
        if label:  # one row per document: its first seq_len tokens, padded, and its class
            windows, tokens = classifier_rows(ids, stats["pad_id"], seq_len), sum(len(i) for i in ids)
            classes = np.asarray(meta["classes"])
            values = np.asarray(table.column(label).to_numpy(zero_copy_only=False))
            arrays[f"{split}_labels"] = np.searchsorted(classes, values).astype(np.int64)
        else:
            windows, tokens = _windows(ids, tokenizer.eot_id, seq_len)
        if not len(windows):
            raise ConfigError("seq_len", f"the {split} split holds {tokens} tokens, fewer than one window of "
                              f"seq_len + 1 = {seq_len + 1}", "use a smaller seq_len, or more text")
        nbytes = sum(len(d.encode("utf-8")) for d in docs) if docs and isinstance(docs[0], str) else 0
        stats["splits"][split] = {"documents": len(docs), "bytes": nbytes, "tokens": tokens, "windows": len(windows),
                                  "tokens_per_byte": tokens / nbytes if nbytes else None,
                                  "unrepresented_bytes": lost, "unrepresented_share": lost / nbytes if nbytes else 0.0}
        if split == "validation" and docs and isinstance(docs[0], str):
            stats["prompts"] = [d[:PROMPT_CHARS] for d in docs[:PROMPTS]]
        arrays[split] = windows.astype(np.uint16 if tokenizer.vocab_size < 65_535 else np.int32)
    return _write(store, prefix, key, arrays, tokenizer, stats, t0)


def _build_sft(dataset: Dataset, columns: dict[str, str], rend, tokenizer: LoadedTokenizer, seq_len: int,
               max_cut: float, stats: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    """SFT examples rendered, tokenized and packed per split (training/data/sft.py); refused
    (ConfigError naming ``seq_len``) when more than ``max_cut`` of a split's examples are cut."""
    from training.data import sft

    for split in SPLITS:
        convs = [c for c in sft.conversations(dataset.table(split), columns) if c is not None]
        ids, masks, answer_bytes = sft.encode(convs, rend, tokenizer.tokenizer, tokenizer.eot_id)
        packed = sft.pack(ids, masks, seq_len, tokenizer.eot_id)
        s = packed.stats
        if s["truncated_share"] > max_cut:
            longest = max(len(t) for t in ids)
            raise ConfigError("seq_len", f"{s['truncated']} of the {split} split's {s['examples']} examples "
                              f"({s['truncated_share']:.1%}) are longer than seq_len + 1 = {seq_len + 1} tokens (the "
                              f"longest: {longest}); at most {max_cut:.1%} may be cut (max_truncated_share)",
                              f"raise seq_len to {longest - 1} or more, or max_truncated_share, or shorten the examples")
        if not s["answer_tokens"]:
            raise ConfigError("seq_len", f"the {split} split has no answer token within seq_len + 1 = {seq_len + 1}",
                              "raise seq_len")
        stats["splits"][split] = {**s, "documents": s["examples"], "bytes": answer_bytes,
                                  "tokens_per_byte": s["answer_tokens"] / answer_bytes if answer_bytes else None,
                                  "unrepresented_bytes": 0, "unrepresented_share": 0.0}
        if split == "validation":
            stats["prompts"] = [rend.prompt(c) for c in convs[:PROMPTS]]
            stats["answers"] = [next(t["content"] for t in c if t["role"] == "assistant") for c in convs[:PROMPTS]]
        arrays[split] = packed.windows.astype(np.uint16 if tokenizer.vocab_size < 65_535 else np.int32)
        arrays[f"{split}_labels"] = packed.labels


def _write(store, prefix: str, key: str, arrays: dict[str, np.ndarray], tokenizer: LoadedTokenizer,
           stats: dict[str, Any], t0: float) -> Built:
    with tempfile.TemporaryDirectory(prefix="tokens-") as tmp:
        files = []
        for split, arr in arrays.items():
            np.save(Path(tmp) / f"{split}.npy", arr)
            files.append(f"{split}.npy")
        (Path(tmp) / TOKENIZER).write_text(tokenizer.to_json())
        (Path(tmp) / STATS).write_text(json.dumps(stats, indent=2) + "\n")
        files += [TOKENIZER, STATS]
        entries = []
        for name in files:
            digest = sha256_file(Path(tmp) / name)
            store.put_file(Path(tmp) / name, f"{prefix}/{name}", digest)
            entries.append({"path": name, "size": (Path(tmp) / name).stat().st_size, "sha256": digest})
        store.put_bytes(json.dumps({"key": key, "files": entries, "created_unix": time.time()}, indent=2).encode(),
                        f"{prefix}/{MANIFEST}")  # last: shards without a manifest are never read
    return Built(uri=f"{store.uri.rstrip('/')}/{prefix}", key=key, cache_hit=False, stats=stats,
                 seconds=time.perf_counter() - t0)


def build_for(cfg: Any, data: Dataset, store_uri: str, env: Mapping[str, str] | None = None, *,
              model_folder: Path | None = None) -> tuple[Built, LoadedTokenizer]:
    """``build`` as a run's fields say (a TrainConfig): its tokenizer resolved (by default the hf:
    model's own, in ``model_folder``, else bytes; ``bpe:N`` trained on the train split's documents,
    or on an SFT table's turns) and, for SFT, its chat template and cut bound."""
    from training.data.tokenizer import resolve

    def train_documents() -> list[Any]:
        if data.meta.get("sft"):
            from training.data.sft import conversations

            return [t["content"] for c in conversations(data.table("train"), data.meta["sft"]) if c for t in c]
        return documents(data.table("train"), cfg.text_column)

    default = str(model_folder) if model_folder is not None else "bytes"
    loaded = resolve(cfg.tokenizer, env=env, default=default, train_documents=train_documents)
    built = build(data, text_column=cfg.text_column or "", tokenizer=loaded, seq_len=cfg.seq_len, store_uri=store_uri,
                  env=env, model=cfg.model, model_folder=model_folder, chat_template=cfg.chat_template,
                  max_truncated_share=cfg.max_truncated_share)
    return built, loaded


class TokenDataset:
    """Token shards opened for training and scoring: a dataset of kind ``tokens`` whose splits are
    the windows (int64 ``[n, seq_len + 1]``, no labels). ``meta`` carries the vocabulary, the
    sequence length and the split sizes (tokens per byte, for bits per byte)."""

    def __init__(self, uri: str, folder: Path, manifest: dict[str, Any]):
        self.uri, self.folder = uri, folder
        self.stats = json.loads((folder / STATS).read_text())
        self.fingerprint = hashlib.sha256(json.dumps(manifest["files"], sort_keys=True).encode()).hexdigest()
        s = self.stats
        self.meta: dict[str, Any] = {
            "kind": "tokens", "task": "language_modeling", "features": ["tokens"], "feature_dtype": "int",
            "label": None, "vocab_size": s["vocab_size"], "n_classes": s["vocab_size"], "seq_len": s["seq_len"],
            "source": f"token shards {uri}", "tokens": s["splits"], "tokenizer_sha256": s["tokenizer_sha256"],
            "task_reason": f"text of {s['text_column']!r} through the tokenizer {s['tokenizer']}"}
        if s.get("sft"):  # packed examples: the labels are positions and answer marks
            self.meta.update(sft=s["sft"], task_reason=f"supervised fine-tuning ({s['sft']['rendering']}), the "
                             "loss on the answers")
        if s.get("label"):  # a classifier's rows: the padding id is one past the tokenizer's
            self.meta.update(kind="text", task="classification", label=s["label"], classes=s["classes"],
                             n_classes=len(s["classes"]), vocab_size=max(s["vocab_size"], s["pad_id"] + 1),
                             pad_id=s["pad_id"])
        self.meta["tokenizer_vocab"] = s["vocab_size"]
        self._splits: dict[str, np.ndarray] = {}

    def split(self, name: str, spec: Any = None, *, limit: int | None = None) -> Split:
        """Split ``name`` in memory (int64); ``limit``: its first rows only, read from the files."""
        labelled = self.meta["kind"] == "text" or "sft" in self.meta
        if limit is not None and name not in self._splits:  # the first rows only, not the whole shard
            rows = NpyRows(self.folder / f"{name}.npy")
            windows = rows.read(0, min(limit, rows.shape[0])).astype(np.int64)
            self._check_width(windows.shape[1], spec)
            labels = None
            if labelled:
                labels = NpyRows(self.folder / f"{name}_labels.npy").read(0, len(windows)).astype(np.int64)
            return Split(features=windows, labels=labels)
        if name not in self._splits:
            self._splits[name] = np.load(self.folder / f"{name}.npy").astype(np.int64)
        windows = self._splits[name]
        self._check_width(windows.shape[1], spec)
        labels = None
        if labelled:
            if f"{name}_labels" not in self._splits:
                self._splits[f"{name}_labels"] = np.load(self.folder / f"{name}_labels.npy")
            labels = self._splits[f"{name}_labels"]
        cut = slice(None, limit)
        return Split(features=windows[cut], labels=labels[cut] if labels is not None else None)

    def blocks(self, name: str, spec: Any = None) -> NpyBlocks:
        """Split ``name`` to stream block by block (training/data/stream.py); with ``spec``, refused
        (ConfigError naming ``seq_len``) when the model reads rows of another length."""
        source = NpyBlocks(self.folder, name)
        self._check_width(source.rows.shape[1], spec)
        return source

    def _check_width(self, width: int, spec: Any) -> None:
        reads = width - (0 if self.meta["kind"] == "text" else 1)  # SFT windows: seq_len + 1, as a language model's
        if spec is not None and spec.seq_len is not None and spec.seq_len != reads:
            raise ConfigError("seq_len", f"the model reads {spec.seq_len} tokens but the shards hold rows of "
                              f"{reads}", "score the model on shards of its own seq_len")

    def stream(self, name: str, shuffle_window: int) -> tuple[Split, NpyBlocks]:
        """Split ``name`` to stream: its first two rows (the model's check), with what a rank holds
        of it, and its blocks."""
        blocks = self.blocks(name)
        head = self.split(name, limit=2)
        head.held_bytes = blocks.held_bytes(blocks.window_for(shuffle_window))
        return head, blocks

    @property
    def tokenizer_file(self) -> Path:
        return self.folder / TOKENIZER

    def tokens_per_byte(self, split: str = "validation") -> float | None:
        return self.stats["splits"][split].get("tokens_per_byte")

    def tokenizer(self) -> LoadedTokenizer:
        text = (self.folder / TOKENIZER).read_text()
        return LoadedTokenizer(tokenizer=load_json(text, f"{self.uri}/{TOKENIZER}"), source=self.stats["tokenizer"],
                               eot_id=int(self.stats["eot_id"]))


def open_shards(uri: str, env: Mapping[str, str] | None = None) -> TokenDataset:
    """The shards at ``uri`` (a folder or ``s3://`` prefix), every file verified against the
    manifest (a file unchanged since it was last hashed on this machine is not read again:
    ``sha256_cached``): read in place from a folder, downloaded once per machine from S3."""
    store = open_store(uri, env, field="token_shards")
    raw = store.get_bytes(MANIFEST)
    if raw is None:
        raise ConfigError("token_shards", f"{uri} holds no {MANIFEST}: the tokenize step did not finish there",
                          "run the tokenize step again (a new DAG run makes them)")
    manifest = json.loads(raw)
    local = store.local_path("")
    folder = local if local is not None else cache_dir() / "tokens" / manifest["key"]
    folder.mkdir(parents=True, exist_ok=True)
    for f in manifest["files"]:
        path = folder / f["path"]
        if local is None and not (path.is_file() and sha256_cached(path) == f["sha256"]):
            tmp = path.with_name(f"{path.name}.partial-{os.getpid()}")
            store.get_file(f["path"], tmp)
            os.replace(tmp, path)
        if sha256_cached(path) != f["sha256"]:
            raise StoreError(f"{uri}/{f['path']} does not match its manifest sha256: the shards are damaged; "
                             "delete the folder and run the tokenize step again")
    return TokenDataset(uri, folder, manifest)

