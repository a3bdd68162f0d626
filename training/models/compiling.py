"""``compile=blocks``: ``torch.compile`` on each block of the model (its ``fsdp_units``: the built-in
decoder's and classifier's blocks, an ``hf:`` model's ``_no_split_modules``, a factory model's
list), after activation checkpointing and before DDP or ``fully_shard``, as torchtitan does. The
block's ``forward`` is compiled on the instance (not wrapped in an ``OptimizedModule``), so the
parameter names, checkpoints and exports are the same with and without it, and FSDP2's hooks on
the block's call stay outside the compiled region. Identical blocks share one compiled graph.
``TRAINING_COMPILE_BACKEND`` (environment, default ``inductor``) names another ``torch.compile``
backend: the tests use ``aot_eager`` (the same tracing and autograd, no C++ to generate), because
inductor's C++ build of a block takes minutes on a loaded two-core machine.
"""

from __future__ import annotations

import os

import torch
from torch import nn

MODES = ("none", "blocks")
MARK = "_compiled_forward"
BACKEND_ENV = "TRAINING_COMPILE_BACKEND"


def apply(model: nn.Module, mode: str) -> list[nn.Module]:
    """Compile the blocks of ``model`` (in place); returns them."""
    from training.models.activations import blocks

    if mode not in MODES:
        raise ValueError(f"compile {mode!r} is not one of {', '.join(MODES)}")
    if mode == "none":
        return []
    chosen = blocks(model)
    if not chosen:
        from training.config.fields import ConfigError

        raise ConfigError("compile", f"the model ({type(model).__name__}) names no blocks (fsdp_units) to compile",
                          "use compile=none, or give the model an fsdp_units list of its blocks")
    backend = os.environ.get(BACKEND_ENV) or "inductor"
    for unit in chosen:
        if not getattr(unit, MARK, False):
            # The instance's forward: activation checkpointing's, when it recomputes this block.
            unit.forward = torch.compile(unit.forward, backend=backend)
            setattr(unit, MARK, True)
    return chosen


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (dynamo and inductor, forward and backward)."""
    from torch._dynamo.utils import calculate_time_spent  # private, but the figure torch itself prints

    return float(calculate_time_spent().get("total_wall_time", 0.0))

