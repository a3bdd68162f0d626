"""Supervised fine-tuning data: prompt/response rows (``prompt_column`` + ``response_column``)
or conversations (``messages_column``: lists of ``{role, content}``), rendered with a chat
template (``Renderer``), their answers found by rendering prefixes, tokenized (``encode``) and
packed whole into ``seq_len + 1`` windows with positions restarting per example (``pack``); each
window's labels are ``position * 2 + is_answer``, which ``model_batch`` turns into the model's input
(ids and positions) and the answer-only target. The gate's SFT checks are ``checks``. Why answers by
prefix and packing by positions: docs/decisions/0010-sft-answers-by-prefix-and-packing-by-positions.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from training.config.fields import ConfigError

ROLES = ("system", "user", "assistant", "tool")
NONE = "none"  # chat_template=none: prompt + response as plain text
IGNORE = -100  # a target position that counts for nothing (torch's cross_entropy default)


def columns(sft: dict[str, Any]) -> list[str]:
    """The table columns an SFT description reads."""
    return [sft["messages_column"]] if sft.get("messages_column") else [sft["prompt_column"], sft["response_column"]]


def conversations(table, sft: dict[str, Any]) -> list[list[dict[str, str]] | None]:
    """Each row as a conversation (None for a row with a missing value)."""
    if sft.get("messages_column"):
        return [None if m is None else [dict(t) for t in m] for m in table.column(sft["messages_column"]).to_pylist()]
    prompts = table.column(sft["prompt_column"]).to_pylist()
    answers = table.column(sft["response_column"]).to_pylist()
    return [None if p is None or r is None else [{"role": "user", "content": p}, {"role": "assistant", "content": r}]
            for p, r in zip(prompts, answers)]


def checks(tables: dict[str, Any], sft: dict[str, Any]) -> tuple[list[str], dict[str, dict[str, int]]]:
    """The gate's SFT checks per split: missing values, empty answers, unknown roles, conversations
    without an assistant turn or whose content is not text. (failure lines, sizes per split)."""
    failures: list[str] = []
    sizes: dict[str, dict[str, int]] = {}
    what = "conversations" if sft.get("messages_column") else "examples"
    for split, table in tables.items():
        problems: dict[str, list[int]] = {}
        n_bytes = 0
        convs = conversations(table, sft)
        for row, conv in enumerate(convs):
            def bad(kind: str) -> None:
                problems.setdefault(kind, []).append(row)
            if conv is None:
                bad("have a missing value")
                continue
            roles = [t.get("role") for t in conv]
            unknown = sorted({str(r) for r in roles if r not in ROLES})
            if unknown:
                bad(f"have a role outside {', '.join(ROLES)} ({', '.join(unknown)})")
            if any(not isinstance(t.get("content"), str) for t in conv):
                bad("have a turn whose content is not text")
                continue
            if "assistant" not in roles:
                bad("have no assistant turn")
            if any(t["role"] == "assistant" and not t["content"].strip() for t in conv):
                bad("have an empty answer")
            n_bytes += sum(len(t["content"].encode("utf-8")) for t in conv if t.get("role") == "assistant")
        for kind, rows in problems.items():
            failures.append(f"{split}: {len(rows)} {what} {kind}, e.g. row {rows[0]}")
        sizes[split] = {"examples": len(convs), "answer_bytes": n_bytes}
    return failures, sizes


# ------------------------------------------------------------------------------------ rendering


@dataclass
class Renderer:
    """How a conversation becomes text and its answers' character spans."""

    template: str | None  # a Jinja chat template; None: plain prompt + response
    source: str  # where the template came from, for the record
    tokenizer: Any = None  # transformers' PreTrainedTokenizerFast around the tokenizers.Tokenizer
    eot_text: str = ""

    def render(self, conv: list[dict[str, str]], *, generation_prompt: bool = False) -> str:
        if self.template is None:
            return conv[0]["content"] if generation_prompt or len(conv) == 1 else conv[0]["content"] + conv[1]["content"]
        return self.tokenizer.apply_chat_template(conv, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def spans(self, conv: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of its assistant turns."""
        if self.template is None:
            text = self.render(conv)
            return text, [(len(conv[0]["content"]), len(text))]
        full = self.render(conv)
        spans = []
        for i, turn in enumerate(conv):
            if turn["role"] != "assistant":
                continue
            before = self.render(conv[:i], generation_prompt=True) if i else ""
            after = self.render(conv[: i + 1])
            if not (after.startswith(before) and full.startswith(after)):
                raise ConfigError("chat_template", f"{self.source} does not render a conversation as the prefixes "
                                  "of its turns, so the answers cannot be told from the prompts",
                                  "give a template (chat_template=<file.jinja>) whose rendering of the first k turns "
                                  "begins the rendering of k + 1 turns")
            spans.append((len(before), len(after)))
        return full, spans

    def stop_id(self, tokenizer: Any, eot_id: int) -> int:
        """The token an answer ends with: the first of what the template writes after an answer's
        content (its end-of-turn marker), else the end-of-text token."""
        if self.template is None:
            return eot_id
        mark = "answer-ends-here"  # a content no template writes itself: what follows it is the template's
        conv = [{"role": "user", "content": "x"}, {"role": "assistant", "content": mark}]
        text, [(a, b)] = self.spans(conv)
        _, found, after = text[a:b].rpartition(mark)
        after = after if found else ""
        ids = tokenizer.encode(after, add_special_tokens=False).ids if after else []
        return int(ids[0]) if ids else eot_id

    def prompt(self, conv: list[dict[str, str]]) -> str:
        """What a model continues to answer: the turns before the first answer, with the template's
        generation prompt."""
        first = next(i for i, t in enumerate(conv) if t["role"] == "assistant")
        return self.render(conv[:first], generation_prompt=True)


def renderer(value: str | None, *, model: str, tokenizer: Any, eot_id: int, messages: bool,
             model_folder: Path | None = None) -> Renderer:
    """The ``chat_template`` field made into a Renderer: a file, ``none``, or empty (the hf:
    model's own template from ``model_folder``, else plain text for prompt/response). ConfigError
    names the field."""
    from transformers import PreTrainedTokenizerFast

    eot_text = tokenizer.id_to_token(eot_id) or ""
    value = (value or "").strip()
    template, source, special = None, "plain text: prompt + response + end-of-text", {}
    if value and value != NONE:
        path = Path(value)
        if not path.is_file():
            raise ConfigError("chat_template", f"{value} is not a file", "give the path of a Jinja chat template, "
                              "none (prompt + response as plain text), or leave it empty for the model's own")
        template, source = path.read_text(), f"chat template {value}"
    elif not value and model_folder is not None:
        own = _model_template(Path(model_folder))
        if own is not None:
            template, source, special = own[0], f"the chat template of {model}", own[1]
    if template is None and messages:
        raise ConfigError("chat_template", f"messages_column holds conversations, and {source.split(':')[0]} "
                          "renders only a prompt and a response", "give a chat template file (chat_template=<file>), "
                          "or a model whose tokenizer_config.json has one")
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **{"eos_token": eot_text, **special})
    if template is not None:
        try:  # a template that does not parse or render is named before any example is tokenized
            wrapped.apply_chat_template([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                                        chat_template=template, tokenize=False)
        except Exception as e:  # jinja2's TemplateError and the template's own raise_exception
            raise ConfigError("chat_template", f"{source} does not render a user and an assistant turn "
                              f"({type(e).__name__}: {e})", "fix the template, or choose another") from None
    return Renderer(template=template, source=source, tokenizer=wrapped, eot_text=eot_text)


def _model_template(folder: Path) -> tuple[str, dict[str, str]] | None:
    """An hf: folder's chat template and the special tokens it refers to, offline."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception:  # a folder without tokenizer files: no template of its own
        return None
    if not getattr(tok, "chat_template", None) or not isinstance(tok.chat_template, str):
        return None
    special = {k: getattr(tok, k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")
               if isinstance(getattr(tok, k, None), str)}
    return tok.chat_template, special


# ------------------------------------------------------------------------------------ tokens


@dataclass
class Packed:
    windows: np.ndarray  # [n, seq_len + 1] token ids
    labels: np.ndarray  # [n, seq_len + 1] int32: position * 2 + is_answer
    stats: dict[str, Any] = field(default_factory=dict)


def encode(convs: list[list[dict[str, str]]], rend: Renderer, tokenizer: Any, eot_id: int
           ) -> tuple[list[np.ndarray], list[np.ndarray], int]:
    """Each example's ids and answer mask; and the UTF-8 bytes of the answers' tokens."""
    texts, all_spans = zip(*(rend.spans(c) for c in convs)) if convs else ((), ())
    encodings = tokenizer.encode_batch(list(texts), add_special_tokens=False)
    ids, masks, answer_bytes = [], [], 0
    for text, spans, enc in zip(texts, all_spans, encodings):
        starts = np.fromiter((a for a, _ in enc.offsets), dtype=np.int64, count=len(enc.offsets))
        ends = np.fromiter((b for _, b in enc.offsets), dtype=np.int64, count=len(enc.offsets))
        mask = np.zeros(len(enc.ids), dtype=bool)
        for a, b in spans:
            mask |= (starts >= a) & (starts < b)
        answer_bytes += len("".join(text[s:e] for s, e, m in zip(starts, ends, mask) if m).encode("utf-8"))
        tok = np.asarray(enc.ids, dtype=np.int64)
        if rend.template is None:  # plain text: the answer ends with the end-of-text token
            tok, mask = np.append(tok, eot_id), np.append(mask, True)
        ids.append(tok)
        masks.append(mask)
    return ids, masks, answer_bytes


def pack(ids: list[np.ndarray], masks: list[np.ndarray], seq_len: int, pad_id: int) -> Packed:
    """Examples laid whole into windows of ``seq_len + 1`` (see the module docstring)."""
    width = seq_len + 1
    windows: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    row = np.full(width, pad_id, dtype=np.int64)
    lab = np.zeros(width, dtype=np.int32)
    fill, truncated, lost_answers, examples = 0, 0, 0, 0

    def close() -> None:
        nonlocal row, lab, fill
        if fill < width:  # the rest: padding, a run of positions of its own, never a target
            lab[fill:] = np.arange(width - fill, dtype=np.int32) * 2
        windows.append(row)
        labels.append(lab)
        row, lab, fill = np.full(width, pad_id, dtype=np.int64), np.zeros(width, dtype=np.int32), 0

    answer_tokens = placed = 0
    for tok, mask in zip(ids, masks):
        if len(tok) > width:
            truncated += 1
            lost_answers += int(not mask[:width][1:].any())
            tok, mask = tok[:width], mask[:width]
        if fill + len(tok) > width:
            close()
        n = len(tok)
        row[fill : fill + n] = tok
        lab[fill : fill + n] = np.arange(n, dtype=np.int32) * 2 + mask.astype(np.int32)
        answer_tokens += int(mask[1:].sum())  # an example's first token is never predicted
        fill += n
        placed += n
        examples += 1
    if fill:
        close()
    stats = {"examples": examples, "truncated": truncated, "truncated_share": truncated / examples if examples else 0.0,
             "without_answer_after_cut": lost_answers, "answer_tokens": answer_tokens,
             "tokens": int(sum(len(t) for t in ids)), "windows": len(windows),
             "fill": placed / (len(windows) * width) if windows else 0.0}
    return Packed(windows=np.stack(windows) if windows else np.zeros((0, width), np.int64),
                  labels=np.stack(labels) if labels else np.zeros((0, width), np.int32), stats=stats)


def model_batch(x, labels):
    """The model's input and target of a packed batch (torch tensors): ids and positions stacked
    as ``[batch, 2, seq_len]``, and the next id where it is an answer token of the same example."""
    import torch

    pos, answer = labels // 2, labels % 2 == 1
    inputs = torch.stack((x[:, :-1], pos[:, :-1].to(x.dtype)), dim=1)
    keep = answer[:, 1:] & (pos[:, 1:] > 0)  # position 0 starts an example: not predicted from the last one
    return inputs, x[:, 1:].masked_fill(~keep, IGNORE)


def segments(positions):
    """Which example each position belongs to (a new one where the positions restart at 0):
    ``[batch, seq_len]`` ids counting from 0 within each row."""
    import torch

    return torch.cumsum((positions == 0).to(torch.int64), dim=-1)
