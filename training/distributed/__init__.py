"""Running on several ranks: the process group and parallelism (``parallel``: DDP, FSDP2),
communication timing (``comm``), mixed precision (``precision``), the torchrun command line
(``launch``), the pods' launcher (``elastic``), surviving and naming failures (``resilience``) and
fault injection for tests (``faults``). Imports ``models``, ``log`` and ``util``."""
