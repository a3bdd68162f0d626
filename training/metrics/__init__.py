"""What the trainer measures: pure formulas (``formulas``), the machine's peak FLOP/s and memory
(``peak``), per-step records and windows (``steps``), the recorder that logs them (``recorder``)
and where a rank's start-up goes (``startup``). Imports ``distributed``, ``models``, ``tracking``,
``config``, ``log`` and ``util``."""
