"""Activation checkpointing: a block's activations are dropped after its forward and recomputed
in backward, trading compute for memory. ``full`` recomputes every block (the model's
``fsdp_units``: the built-in decoder's and classifier's blocks, an ``hf:`` model's
``_no_split_modules`` blocks, a factory model's list), ``selective`` every second one (half the
saving for half the recomputation). PyTorch's non-reentrant ``torch.utils.checkpoint`` runs
it, restoring the RNG state for the recomputation, so dropout draws the same masks and the
gradients are bit-identical to ``none``. Why per block and not per operation:
docs/architecture.md "Activation checkpointing".
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

MODES = ("none", "full", "selective")
MARK = "_activation_checkpointed"  # set on a unit whose forward recomputes in backward


def blocks(model: nn.Module) -> list[nn.Module]:
    """The units activation checkpointing applies to: the model's ``fsdp_units`` (blocks)."""
    from training.models.build import shard_units

    return shard_units(model) if getattr(model, "fsdp_units", None) is not None else []


def apply(model: nn.Module, mode: str) -> list[nn.Module]:
    """Make the chosen blocks of ``model`` recompute their activations in backward (in place, the
    parameter names unchanged, so checkpoints and exports are the same with or without it);
    returns them. Evaluation (no gradients) runs the blocks as they are."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing {mode!r} is not one of {', '.join(MODES)}")
    chosen = blocks(model) if mode != "none" else []
    if mode != "none" and not chosen:
        from training.config.fields import ConfigError

        raise ConfigError("activation_checkpointing", f"the model ({type(model).__name__}) names no blocks "
                          "(fsdp_units) whose activations could be recomputed",
                          "use activation_checkpointing=none, or give the model an fsdp_units list of its blocks")
    if mode == "selective":
        chosen = chosen[::2]
    for unit in chosen:
        if not getattr(unit, MARK, False):
            unit.forward = functools.partial(_recomputed, unit.forward)
            setattr(unit, MARK, True)
    return chosen


def _recomputed(forward, *args: Any, **kwargs: Any):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def saved_bytes(model: nn.Module, *inputs: torch.Tensor) -> int:
    """Bytes autograd keeps for backward in one forward of ``model`` on ``inputs``, parameters not
    counted (each storage once): the activation memory a training step holds at its peak."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    def held(_unit, args, kwargs):  # a recomputed block's inputs stay alive until its backward
        for t in (*args, *kwargs.values()):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                pack(t)

    hooks = [u.register_forward_pre_hook(held, with_kwargs=True) for u in model.modules() if getattr(u, MARK, False)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(*inputs)
        del out
    finally:
        for h in hooks:
            h.remove()
    return sum(seen.values())
