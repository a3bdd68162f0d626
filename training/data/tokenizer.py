"""Tokenizers, in Hugging Face's ``tokenizers`` format and loaded offline: ``resolve`` turns the
``tokenizer`` field into one. A ``tokenizer.json`` (a path or ``s3://`` URI), ``bpe:N`` (a
byte-level BPE of N tokens trained on the train split: deterministic for the same documents) or
``bytes`` (one token per byte). Every tokenizer has an end-of-text token, which the tokenize step
puts after each document; ``sha256`` (of its JSON) keys the token shards made with it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Mapping

from training.config.fields import ConfigError
from training.config.train_config import BPE_RE, check_tokenizer

EOT = "<|endoftext|>"
# End-of-text tokens of common tokenizers, tried in this order on a tokenizer.json a user brings.
EOT_CANDIDATES = (EOT, "</s>", "<eos>", "[SEP]", "<|end_of_text|>")


@dataclass
class LoadedTokenizer:
    tokenizer: Any  # tokenizers.Tokenizer
    source: str  # what the field said (or the default it took)
    eot_id: int

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        return self.tokenizer.to_str()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()


def _byte_level(model) -> Any:
    from tokenizers import Tokenizer, decoders, pre_tokenizers

    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def byte_tokenizer() -> Any:
    """One token per byte (ids 0-255 in byte order), then the end-of-text token (256)."""
    from tokenizers import models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda ch: _byte_of(ch))
    tok = _byte_level(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.add_special_tokens([EOT])
    return tok


def _byte_of(ch: str) -> int:
    """The byte a character of the byte-level alphabet stands for (GPT-2's printable mapping)."""
    code = ord(ch)
    if 33 <= code <= 126 or 161 <= code <= 172 or 174 <= code <= 255:
        return code
    return sorted(set(range(256)) - set(range(33, 127)) - set(range(161, 173)) - set(range(174, 256)))[code - 256]


def train_bpe(documents: Iterable[str], vocab_size: int) -> Any:
    """A byte-level BPE of ``vocab_size`` tokens (the end-of-text token included) trained on ``documents``."""
    from tokenizers import models, pre_tokenizers, trainers

    tok = _byte_level(models.BPE())
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents, trainer=trainer)
    return tok


def load_json(text: str, where: str) -> Any:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(text)
    except Exception as e:  # the library raises its own Exception subclasses with the parser's words
        raise ConfigError("tokenizer", f"{where} is not a tokenizer.json the tokenizers library loads "
                          f"({type(e).__name__}: {e})", "give a tokenizer.json written by Hugging Face's tokenizers "
                          "(tokenizer.save / save_pretrained), or bpe:N to train one, or bytes") from None


def _read(uri: str, env: Mapping[str, str] | None) -> str:
    """The text of a tokenizer.json at a local path or an ``s3://`` URI."""
    from pathlib import Path

    if uri.startswith("s3://"):
        from training.store import open_store

        folder, _, name = uri.rstrip("/").rpartition("/")
        raw = open_store(folder, env, field="tokenizer").get_bytes(name)
        if raw is None:
            raise ConfigError("tokenizer", f"{uri} does not exist", "upload the tokenizer.json there or fix the URI")
        return raw.decode("utf-8", errors="replace")
    path = Path(uri.removeprefix("file://"))
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ConfigError("tokenizer", f"{uri} does not exist", "give the path of a tokenizer.json, bpe:N or bytes")
    return path.read_text(errors="replace")


def resolve(value: str, *, train_documents: Callable[[], Iterable[str]], env: Mapping[str, str] | None = None,
            default: str = "bytes") -> LoadedTokenizer:
    """The tokenizer ``value`` names (empty: ``default``), with its end-of-text token (added to a
    loaded tokenizer that has none). ``train_documents``: the train split's documents, read only
    for ``bpe:N``. ConfigError names ``tokenizer``."""
    source = (value or "").strip() or default
    check_tokenizer(source)
    if source == "bytes":
        tok = byte_tokenizer()
    elif m := BPE_RE.match(source):
        tok = train_bpe(train_documents(), int(m[1]))
    else:
        tok = load_json(_read(source, env), source)
    eot = next((tok.token_to_id(t) for t in EOT_CANDIDATES if tok.token_to_id(t) is not None), None)
    if eot is None:
        tok.add_special_tokens([EOT])
        eot = tok.token_to_id(EOT)
    return LoadedTokenizer(tokenizer=tok, source=source, eot_id=int(eot))
