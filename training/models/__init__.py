"""Models: the spec that rebuilds one anywhere (``spec``), the built-in families (``builtin``),
building, checking and wrapping a model (``build``) and its loss (``loss``). Imports ``config`` only."""
