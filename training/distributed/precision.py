"""Mixed precision: autocast for the forward pass and dynamic loss scaling for fp16.

- fp32: nothing.
- bf16 with DDP: ``torch.autocast(dtype=bfloat16)``; bf16 has fp32's exponent range, so no scaling.
  With FSDP, bf16 is applied by FSDP2's MixedPrecisionPolicy instead (see parallel.py).
- fp16 (DDP only): autocast + ``torch.amp.GradScaler``: the loss is multiplied by the scale before
  backward; a step whose gradients hold inf/nan is skipped and the scale halves; after
  ``growth_interval`` good steps in a row it doubles.
"""

from __future__ import annotations

import contextlib

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, strategy: str, device: torch.device):
    if precision == "fp32" or (strategy == "fsdp" and precision == "bf16"):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


def grad_scaler(precision: str, device: torch.device, growth_interval: int = 200) -> torch.amp.GradScaler:
    """A GradScaler that is enabled only for fp16 (a disabled one is a no-op with the same API)."""
    return torch.amp.GradScaler(device.type, init_scale=2.0**16, growth_interval=growth_interval,
                                enabled=precision == "fp16")
