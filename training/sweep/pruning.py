"""A sweep trial's side of early stopping, inside the trainer: at each evaluation during training
(``eval_every``) rank 0 reports the objective to the trial in the study and asks the pruner
(asynchronous successive halving) whether the trial goes on; every rank learns the answer in one
broadcast, and a pruned trial stops after that step: it exports and commits its final checkpoint
as a finished run would, so its model is kept and can be evaluated.

Switched on by the environment the sweep's lane sets (never by argv: a Postgres storage URL
holds a password): ``TRAINING_SWEEP_STORAGE``, ``TRAINING_SWEEP_STUDY``, ``TRAINING_SWEEP_TRIAL_ID``
and ``TRAINING_SWEEP_OBJECTIVE``.
"""

from __future__ import annotations

import math
import os
from typing import Any

STORAGE_ENV, STUDY_ENV, TRIAL_ENV, OBJECTIVE_ENV = ("TRAINING_SWEEP_STORAGE", "TRAINING_SWEEP_STUDY",
                                                    "TRAINING_SWEEP_TRIAL_ID", "TRAINING_SWEEP_OBJECTIVE")


class TrialPruning:
    """``on_eval`` (an ``Evaluator`` hook, on every rank) reports and decides; ``stop`` says the loop ends."""

    def __init__(self, info: Any, *, storage_url: str, study: str, trial_id: int, objective: str, steps: int) -> None:
        self.info, self.objective, self.steps = info, objective, steps
        self.stop, self.pruned_at = False, None
        self.trial = None
        if info.is_main:
            import optuna

            from training.sweep.space import Search
            from training.sweep.study import storage

            optuna.logging.set_verbosity(optuna.logging.WARNING)
            loaded = optuna.load_study(study_name=study, storage=storage(storage_url))
            # The sweep's own pruner, from the settings the study keeps (load_study's default is another).
            kept = loaded.user_attrs["search"]
            loaded.pruner = Search(**{k: v for k, v in kept.items() if k in Search.__dataclass_fields__}).pruner_object()
            self.trial = optuna.trial.Trial(loaded, trial_id)

    def on_eval(self, step: int, figures: dict[str, float]) -> None:
        import torch
        import torch.distributed as dist

        prune = 0
        if self.trial is not None:
            value = figures.get(self.objective)
            if value is not None and math.isfinite(value):
                self.trial.report(float(value), step)
                # At the last step there is nothing left to save: the trial is complete, not pruned.
                prune = int(step < self.steps and self.trial.should_prune())
            else:  # a diverged trial (NaN loss) is as good as pruned: it will not come back
                prune = 1
        if dist.is_available() and dist.is_initialized() and self.info.world_size > 1:
            flag = torch.tensor([prune], device=self.info.device)
            dist.broadcast(flag, src=0)
            prune = int(flag.item())
        if prune:
            self.stop, self.pruned_at = True, step
            if self.info.is_main:
                from training import log

                log.logger.info(f"sweep: pruned at step {step} ({self.objective} {figures.get(self.objective)}): "
                                "the trial stops here and keeps this step's checkpoint")


def install(trainer: Any) -> TrialPruning | None:
    """The trial's pruning on ``trainer`` when the sweep's environment asks for it."""
    if not os.environ.get(TRIAL_ENV):
        return None
    hook = TrialPruning(trainer.info, storage_url=os.environ[STORAGE_ENV], study=os.environ[STUDY_ENV],
                        trial_id=int(os.environ[TRIAL_ENV]), objective=os.environ[OBJECTIVE_ENV],
                        steps=trainer.cfg.steps)
    trainer.evaluator.on_eval.append(hook.on_eval)
    return hook
