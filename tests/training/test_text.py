"""Text as people keep it: the gate's verdict on documents, tokenizers (a trained BPE, bytes, a
tokenizer.json), the token windows the ranks read (made once, found again, verified), the decoder
and the language model's figures. Real text: Python's own help topics (pydoc_data)."""

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from training.config.fields import ConfigError
from training.data.dataset import open_dataset
from training.data.gate import DataValidationError, gate
from training.data.options import DataOptions
from training.data.synthetic import make_text_dataset, python_help_paragraphs
from training.data.text import documents, unigram_byte_entropy
from training.data.tokenizer import resolve
from training.data.tokens import build, open_shards
from training.metrics.formulas import bits_per_byte
from training.models.builtin import Transformer
from training.store import StoreError

TEXT = DataOptions(text_column="text")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("text") / "python-help"
    make_text_dataset(root)
    return root


def _write(root, split, column):
    (root / split).mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": column}), root / split / "part-0.parquet")


def test_python_help_passes_the_gate_as_language_model_data(corpus):
    report, ds = gate(str(corpus), options=TEXT)
    assert report["success"] and ds.meta["task"] == "language_modeling" and ds.meta["kind"] == "text"
    assert report["text"]["train"]["documents"] == report["rows"]["train"] > 1000
    assert report["text"]["validation"]["bytes"] > 50_000


def test_the_gate_names_what_is_wrong_with_documents(tmp_path):
    docs = python_help_paragraphs()[:120]
    bad_train = pa.array([d.encode() for d in docs[:100]] + [b"not \xff utf-8"], type=pa.binary()).view(pa.string())
    _write(tmp_path, "train", bad_train)
    _write(tmp_path, "validation", docs[95:] + ["", "   \n ", None])
    with pytest.raises(DataValidationError) as err:
        gate(str(tmp_path), options=TEXT)
    failures = err.value.report["failures"]
    for line in ("train: 1 documents of 'text' are not valid UTF-8, e.g. row 100",
                 "validation: expect_column_values_to_not_be_null(text): 1 bad values",
                 "validation: expect_column_value_lengths_to_be_between(text): 1 bad values",
                 "validation: 1 documents of 'text' hold only white space",
                 "train/validation: 5 documents of validation are also in train (exact copies)"):
        assert any(f.startswith(line) for f in failures), (line, failures)
    assert all(len(f) < 300 for f in failures), "a verdict line quotes a document's beginning, not all of it"


def test_a_column_that_is_missing_or_not_text_is_refused_naming_text_column(corpus, tmp_path):
    with pytest.raises(DataValidationError) as err:
        gate(str(corpus), options=DataOptions(text_column="body"))
    assert "config field 'text_column': 'body' is not a column of the train split (its columns: text)" in str(err.value)
    _write(tmp_path, "train", pa.array(range(50)))
    _write(tmp_path, "validation", pa.array(range(20)))
    with pytest.raises(DataValidationError) as err:
        gate(str(tmp_path), options=TEXT)
    assert "'text' holds int64 values, not text" in str(err.value)


def test_tokenizers_bytes_bpe_and_a_file(corpus, tmp_path):
    text = "héllo ✓\n\tdone"
    raw = resolve("bytes", train_documents=lambda: [])
    assert raw.tokenizer.encode(text).ids == list(text.encode()) and raw.eot_id == 256 and raw.vocab_size == 257
    assert raw.tokenizer.decode(raw.tokenizer.encode(text).ids) == text
    docs = documents(open_dataset(corpus, TEXT).table("train"), "text")
    bpe = resolve("bpe:600", train_documents=lambda: docs)
    assert bpe.vocab_size == 600 and bpe.sha256 == resolve("bpe:600", train_documents=lambda: docs).sha256
    assert len(bpe.tokenizer.encode(docs[0]).ids) < len(docs[0].encode()) / 2  # merges pay on the text they learned
    bpe.tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert resolve(str(tmp_path / "tokenizer.json"), train_documents=lambda: []).sha256 == bpe.sha256
    (tmp_path / "broken.json").write_text('{"model": ')
    with pytest.raises(ConfigError, match="config field 'tokenizer': .*broken.json is not a tokenizer.json"):
        resolve(str(tmp_path / "broken.json"), train_documents=lambda: [])
    with pytest.raises(ConfigError, match="is not bpe:N with N >= 258"):
        resolve("bpe:100", train_documents=lambda: docs)


def test_token_windows_are_made_once_found_again_and_verified(corpus, tmp_path):
    ds = open_dataset(corpus, TEXT)
    tok = resolve("bpe:600", train_documents=lambda: documents(ds.table("train"), "text"))
    made = build(ds, text_column="text", tokenizer=tok, seq_len=32, store_uri=str(tmp_path / "store"))
    again = build(ds, text_column="text", tokenizer=tok, seq_len=32, store_uri=str(tmp_path / "store"))
    assert not made.cache_hit and again.cache_hit and again.uri == made.uri
    other = build(ds, text_column="text", tokenizer=tok, seq_len=16, store_uri=str(tmp_path / "store"))
    assert not other.cache_hit and other.uri != made.uri, "another seq_len is another key"
    val = made.stats["splits"]["validation"]
    assert val["windows"] == val["tokens"] // 33 and 0.2 < val["tokens_per_byte"] < 1
    shards = open_shards(made.uri)
    windows = shards.split("validation").features
    assert windows.shape == (val["windows"], 33) and windows.dtype == np.int64
    # The windows are the documents' ids joined by the end-of-text token, in order.
    first = documents(ds.table("validation"), "text")[0]
    ids = tok.tokenizer.encode(first, add_special_tokens=False).ids
    assert windows.reshape(-1)[: len(ids) + 1].tolist() == [*ids, tok.eot_id][: len(ids) + 1]
    assert shards.tokenizer().sha256 == tok.sha256
    # A damaged shard is never read.
    path = tmp_path / "store" / "tokens" / made.key / "train.npy"
    path.write_bytes(path.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(StoreError, match="does not match its manifest sha256"):
        open_shards(made.uri)


def test_too_little_text_for_one_window_is_refused_naming_seq_len(tmp_path):
    _write(tmp_path / "d", "train", python_help_paragraphs()[:20])
    _write(tmp_path / "d", "validation", ["tiny"])
    ds = open_dataset(tmp_path / "d", TEXT)
    with pytest.raises(ConfigError, match="config field 'seq_len': the validation split holds"):
        build(ds, text_column="text", tokenizer=resolve("bytes", train_documents=lambda: []), seq_len=64,
              store_uri=str(tmp_path / "store"))


def test_the_decoder_is_causal_and_its_state_has_no_position_buffers():
    torch.manual_seed(0)
    model = Transformer(vocab_size=40, seq_len=16, d_model=32, n_layers=2, n_heads=4)
    x = torch.randint(0, 40, (2, 16))
    y = model(x)
    changed = x.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 40
    z = model(changed)
    assert torch.allclose(z[:, :9], y[:, :9], atol=1e-6) and not torch.allclose(z[:, 9:], y[:, 9:])
    assert not list(model.buffers())
    assert {"attn_norm", "qkv", "proj", "mlp_norm", "gate_up", "down"} <= {n for n, _ in model.blocks[0].named_children()}


def test_bits_per_byte_is_bits_per_token_times_tokens_per_byte(corpus):
    assert bits_per_byte(math.log(2) * 3, 0.25) == pytest.approx(0.75)
    assert bits_per_byte(1.0, None) is None
    docs = documents(open_dataset(corpus, TEXT).table("validation"), "text")
    assert 4.0 < unigram_byte_entropy(docs) < 5.5  # English text over bytes


def test_text_fields_are_checked_before_anything_runs():
    from training.config.train_config import TrainConfig

    with pytest.raises(ConfigError, match="config field 'tokenizer': 'bytes' tokenizes text, but text_column is empty"):
        TrainConfig(dataset_uri="d", tokenizer="bytes")
    with pytest.raises(ConfigError, match="not bpe:N"):
        TrainConfig(dataset_uri="d", text_column="text", tokenizer="bpe:x")
    with pytest.raises(ConfigError, match="config field 'token_shards': text .* is trained from its token windows"):
        from training.train import prepare

        prepare(TrainConfig(dataset_uri="d", text_column="text", model="transformer"))
    assert json.loads(json.dumps(TrainConfig(dataset_uri="d", text_column="t").to_dict()))["seq_len"] == 128


def test_a_classifiers_rows_are_documents_padded_with_their_class(tmp_path):
    make_text_dataset(tmp_path / "d", labels=True)
    ds = open_dataset(tmp_path / "d", TEXT)
    assert ds.meta["task"] == "classification" and ds.meta["classes"] == [0, 1]
    tok = resolve("bytes", train_documents=lambda: [])
    built = build(ds, text_column="text", tokenizer=tok, seq_len=48, store_uri=str(tmp_path / "store"))
    shards = open_shards(built.uri)
    assert shards.meta["kind"] == "text" and shards.meta["pad_id"] == tok.vocab_size == 257
    val = shards.split("validation")
    docs = documents(ds.table("validation"), "text")
    labels = ds.table("validation").column("label").to_pylist()
    assert val.features.shape == (len(docs), 48) and val.labels.tolist() == labels
    short = min(range(len(docs)), key=lambda i: len(docs[i].encode()))
    n = len(docs[short].encode())
    assert n < 48 and val.features[short, :n].tolist() == list(docs[short].encode())
    assert set(val.features[short, n:].tolist()) == {257}, "a short document is padded, not packed with the next"


def test_a_tokenizer_bigger_than_the_hf_models_embedding_is_refused(tmp_path):
    from tests.hf_models import gpt2_folder
    from training.models.spec import ModelSpec

    folder = gpt2_folder(tmp_path / "gpt2", weights=False)
    meta = {"kind": "tokens", "task": "language_modeling", "features": ["tokens"], "vocab_size": 1000, "seq_len": 32}
    with pytest.raises(ConfigError, match=r"config field 'tokenizer': its 1000 tokens do not fit hf:.*embedding holds 512"):
        ModelSpec.for_data(f"hf:{folder}", meta, hidden=8, depth=1)
    spec = ModelSpec.for_data(f"hf:{folder}", {**meta, "vocab_size": 512}, hidden=8, depth=1)
    assert spec.is_hf and spec.arch["hf_head"] == "causal_lm" and not spec.arch["pretrained"]
    written = json.loads(json.dumps(spec.to_json()))  # model_config.json
    assert ModelSpec.from_json(written).to_json() == written
