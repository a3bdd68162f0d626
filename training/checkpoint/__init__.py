"""Checkpoints: the commit protocol and its errors (``commit``), retention (``retention``),
DCP's reader and writer on our stores (``dcp_io``), the trainer's checkpointer (``manager``) and the
portable model export, written one tensor at a time (``export``). Built on ``store``; also imports ``config``, ``models``,
``distributed``, ``tracking``, ``log`` and ``util``."""
