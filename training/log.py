"""The trainer's one logger, filtered by rank: rank 0 prints INFO and above, every other rank only
warnings and errors (a fault-injection notice, a metrics sampler that failed). Each record goes to
stdout as the bare message, one line, flushed, so the progress lines read the same whether one or
many ranks run and tests can parse them.

    from training.log import logger
    logger.info("step 10/300 | ...")   # printed by rank 0 only, once ``init(rank)`` ran

Until ``init`` runs (a library call outside the trainer) records go wherever the process's
logging is configured, like any library's.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("training")
_stdout: logging.Handler | None = None


def init(rank: int) -> None:
    """Send the ``training`` loggers' records to stdout, INFO on rank 0 and WARNING elsewhere."""
    global _stdout
    if _stdout is None:
        _stdout = logging.StreamHandler(sys.stdout)
        _stdout.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(_stdout)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False
