"""Models: the spec that rebuilds one anywhere (``spec``), the built-in families (``builtin``),
building, checking and wrapping a model (``build``), its loss (``loss``), and what is applied to its
blocks before sharding: activation checkpointing (``activations``) and ``torch.compile``
(``compiling``). Imports ``config`` only."""
