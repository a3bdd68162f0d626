"""The trainer's one logger, filtered by rank: rank 0 prints INFO and above, every other rank only
warnings and errors. Each record goes to stdout as the bare message, one line, flushed, so the
progress lines read the same whether one or many ranks run and tests can parse them.

    from training.log import logger
    logger.info("step 10/300 | ...")   # printed by rank 0 only, once ``init(rank)`` ran

Until ``init`` runs (a library call outside the trainer) records go wherever the process's logging
is configured. With a ``folder``, rank 0 also appends every line, with its time, to
``<folder>/train.log`` (all attempts of a run): the run's train log, which the trainer logs to MLflow.
"""

from __future__ import annotations

import logging
import sys

from pathlib import Path

logger = logging.getLogger("training")
LOG_FILE = "train.log"
_stdout: logging.Handler | None = None
_file: logging.Handler | None = None


def init(rank: int, folder: str | Path | None = None) -> None:
    """Send the ``training`` loggers' records to stdout, INFO on rank 0 and WARNING elsewhere;
    rank 0 also to ``folder/train.log`` when a folder is given."""
    global _stdout, _file
    if _stdout is None:
        _stdout = logging.StreamHandler(sys.stdout)
        _stdout.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(_stdout)
    if rank == 0 and folder and _file is None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        _file = logging.FileHandler(Path(folder) / LOG_FILE, encoding="utf-8")
        _file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(_file)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False
