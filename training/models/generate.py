"""Text from a language model: ``continue_text`` continues prompts token by token, greedily or by
sampling (top-k, a fixed seed: the same samples every time for the same weights), within the
model's context of ``seq_len`` tokens."""

from __future__ import annotations

from typing import Any

import torch


@torch.no_grad()
def continue_text(model: torch.nn.Module, tokenizer: Any, prompts: list[str], *, seq_len: int, new_tokens: int = 48,
                  sample: bool = False, temperature: float = 0.8, top_k: int = 40, seed: int = 0,
                  stop_id: int | None = None) -> list[str]:
    """Each prompt's continuation (the new text only). ``tokenizer``: a ``tokenizers.Tokenizer``;
    ``stop_id``: the end-of-text token, where a continuation ends."""
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    out = []
    try:
        for prompt in prompts:
            ids = tokenizer.encode(prompt, add_special_tokens=False).ids or [stop_id or 0]
            start = len(ids)
            for _ in range(new_tokens):
                logits = model(torch.tensor([ids[-seq_len:]]))[0, -1].float()
                if sample:
                    top = torch.topk(logits / temperature, min(top_k, logits.numel()))
                    nxt = int(top.indices[torch.multinomial(torch.softmax(top.values, -1), 1, generator=gen)])
                else:
                    nxt = int(logits.argmax())
                if nxt == stop_id:
                    break
                ids.append(nxt)
            out.append(tokenizer.decode(ids[start:]))
    finally:
        model.train(was_training)
    return out
