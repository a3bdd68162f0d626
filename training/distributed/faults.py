"""Fault injection for tests and chaos drills, installed only when a ``TRAINING_FAULT_*`` variable
is set: the environment, never the config, so a config file cannot carry a fault into production.

    TRAINING_FAULT_KILL_AT_STEP=STEP:RANK  that rank SIGKILLs itself after STEP, first attempt only
    TRAINING_FAULT_HANG_AT_STEP=STEP:RANK  that rank stops responding after STEP, first attempt only
                                           (a hung GPU, a deadlock): its peers' next collective
                                           times out
    TRAINING_FAULT_INF_GRAD_AT_STEP=STEP   one gradient of STEP is set to inf before the optimizer
                                           step (fp16: the scaler skips the step)
    TRAINING_FAULT_COMM_DELAY_MS=D         every DDP gradient collective, every FSDP all-gather and
                                           reduce-scatter completes D ms later (a slow network; see
                                           comm.CommTimer)
"""

from __future__ import annotations

import functools
import os
import signal
import time

import torch

from training.log import logger


def _env(name: str) -> str | None:
    return os.environ.get(name) or None


def _step_rank(name: str) -> tuple[int, int] | None:
    value = _env(name)
    if value is None:
        return None
    step, rank = (int(v) for v in value.split(":"))
    return step, rank


def install(trainer) -> None:
    """Attach the faults the environment asks for to ``trainer``, by wrapping what it calls anyway:
    kill and hang after its step record (``recorder.record``), an inf gradient before unscaling
    (``scaler.unscale_``), a slower network in its comm timer. With none set nothing is wrapped,
    so the training loop holds no fault code at all."""
    rank, first_attempt = trainer.info.rank, trainer.restarts == 0
    kill = _step_rank("TRAINING_FAULT_KILL_AT_STEP")
    if kill and first_attempt and kill[1] == rank:
        _after_step(trainer, functools.partial(_kill_after, kill[0], rank))
    hang = _step_rank("TRAINING_FAULT_HANG_AT_STEP")
    if hang and first_attempt and hang[1] == rank:
        _after_step(trainer, functools.partial(_hang_after, hang[0], rank))
    inf = _env("TRAINING_FAULT_INF_GRAD_AT_STEP")
    if inf:
        unscale = trainer.scaler.unscale_

        def inf_gradient_then_unscale(optimizer, at: int = int(inf)) -> None:
            _inf_gradient_at(at, trainer.model, trainer.state.step + 1)  # the step being done
            unscale(optimizer)

        trainer.scaler.unscale_ = inf_gradient_then_unscale
    delay_ms = _env("TRAINING_FAULT_COMM_DELAY_MS")
    if delay_ms:
        trainer.comm_timer.delay_s = float(delay_ms) / 1000


def _after_step(trainer, hook) -> None:
    """Call ``hook(step)`` once each step is recorded (the step's record is on disk before a kill)."""
    record = trainer.recorder.record

    def record_then(step: int, result) -> None:
        record(step, result)
        hook(step)

    trainer.recorder.record = record_then


def _kill_after(at: int, rank: int, step: int) -> None:
    if step == at:
        logger.warning(f"fault injection: rank {rank} SIGKILLs itself after step {step}")
        os.kill(os.getpid(), signal.SIGKILL)


def _hang_after(at: int, rank: int, step: int) -> None:
    if step == at:
        logger.warning(f"fault injection: rank {rank} hangs after step {step}")
        while True:
            time.sleep(3600)


def _inf_gradient_at(at: int, model: torch.nn.Module, step: int) -> None:
    if step == at:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.fill_(float("inf"))
                return
