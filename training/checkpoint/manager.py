"""The trainer's checkpoints: ``TrainState`` (what is saved) and ``Checkpointer``, which owns when
to save as well as how, with ``torch.distributed.checkpoint`` (DCP). Layout under ``checkpoint_dir``
(a folder, ``file:///folder`` or ``s3://bucket/prefix``)::

    step_00000100/__N_0.distcp, .metadata   DCP: each rank's shard, the coordinator's metadata
    step_00000100/rng_rankN.pt              each rank's RNG states (tensors and ints only)
    step_00000100/manifest.json             after every file: each file's size and sha256
    step_00000300/model.safetensors + model_config.json   (final step only, in the manifest too)
    latest                                  after the manifest: the newest committed checkpoint

Every checkpoint is committed by the ranks with the protocol of training/checkpoint/commit.py
(through training/checkpoint/dcp_io.py); one without a manifest, or with a file that does not match
it, is never resumed from. ``resume`` at start, ``maybe_save`` every ``checkpoint_every`` steps,
``finalize`` at the end (with the exported model), ``save(final=True)`` on preemption.
"""

from __future__ import annotations

import io
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element  # private, but the planner's own helper
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from training.checkpoint import commit
from training.checkpoint.commit import Candidate, CheckpointCorrupt, Location, step_dir_name
from training.checkpoint.dcp_io import METADATA, StoreWriter, VerifiedReader, describe, failures, not_committed, rng_file
from training.checkpoint.export import EXPORTED, export_model
from training.checkpoint.retention import retain, write_eval
from training.config.fields import ConfigError
from training.config.train_config import settings_hash
from training.distributed.resilience import Phase
from training.log import logger
from training.models.spec import ModelSpec
from training.store import StoreError, open_store
from training.tracking.run import NullLogger


class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP stores non-tensor values (optimizer hyper-parameters, counters) as pickled bytes and
    its default planner loads them with ``weights_only=False``. A checkpoint is input from
    storage, so we refuse arbitrary objects: only tensors and plain containers load."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class TrainState(Stateful):
    """Everything a resume needs, as DCP sees it: model, optimizer, LR scheduler, grad scaler,
    sampler position and step. (What is each rank's own is kept beside it, in ``rng_rankN.pt``: the
    RNG states, and ``rank_local``'s parts, e.g. PowerSGD's error feedback.)"""

    def __init__(self, model, optimizer, scheduler, sampler, scaler=None, rank_local: dict[str, Any] | None = None):
        self.model, self.optimizer, self.scheduler, self.sampler, self.scaler = model, optimizer, scheduler, sampler, scaler
        self.rank_local = rank_local or {}
        self.step = 0

    def local_state(self) -> dict[str, Any]:
        return {**rng_state(), "local": {name: part.state_dict() for name, part in self.rank_local.items()}}

    def load_local_state(self, saved: dict[str, Any] | None) -> None:
        """After the shared state: this rank's file, or None where the checkpoint has none for it."""
        if saved is not None:
            set_rng_state(saved)
        for name, part in self.rank_local.items():
            part.load_state_dict((saved or {}).get("local", {}).get(name), step=self.step)

    def _options(self):
        """A model with a frozen part (an adapter's base) checkpoints only what trains: the base is read
        from its folder again on resume, as at the start, so a LoRA checkpoint is the adapters' size."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        if all(p.requires_grad for p in self.model.parameters()):
            return None
        return StateDictOptions(ignore_frozen_params=True, strict=False)

    def state_dict(self) -> dict[str, Any]:
        msd, osd = get_state_dict(self.model, self.optimizer, options=self._options())
        state = {
            "model": msd,
            "optim": osd,
            "scheduler": self.scheduler.state_dict(),
            "sampler_pos": torch.tensor(self.sampler.pos, dtype=torch.int64),
            "step": torch.tensor(self.step, dtype=torch.int64),
        }
        if self.scaler is not None and self.scaler.is_enabled():
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=self._options())
        self.scheduler.load_state_dict(state["scheduler"])
        if "scaler" in state and self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.sampler.pos = int(state["sampler_pos"])
        self.step = int(state["step"])


def rng_state() -> dict[str, Any]:
    """Every RNG of this rank, in types ``torch.load(weights_only=True)`` accepts."""
    _, key, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Checkpointer:
    """Saves TrainState into ``{checkpoint_dir}/step_XXXXXXXX/`` (a folder, ``file://`` or
    ``s3://``), sync or async, with the commit protocol of training/checkpoint/commit.py: every rank stores
    its own files, the coordinator then writes the manifest (each file's size and sha256) and moves
    ``latest``, then applies retention (the last ``keep_last``, the best by eval/loss, ``latest``).
    ``resume`` loads the newest checkpoint that verifies, falling back and saying why.

    Async saves run on their own gloo process group so that the background thread's collectives
    never interleave with the training collectives on the default group.

    Cadence: ``maybe_save`` saves every ``every`` steps before ``last_step`` (0: never), says how
    long training was blocked and logs ``ckpt/blocking_s`` through ``metrics``; ``finalize``
    writes ``last_step``'s checkpoint. ``phase`` (resilience.Phase) is told what is going on, so
    that a failed save is named in the error; ``mlflow`` gets the resume tags.
    """

    def __init__(self, checkpoint_dir: str, *, world_size: int, settings: dict[str, Any], use_async: bool,
                 every: int = 0, last_step: int | None = None, keep_last: int = 0, metrics=None, mlflow=None,
                 phase=None, frozen_base: Path | None = None):
        self.loc = Location(open_store(checkpoint_dir, field="checkpoint_dir"))
        self.world_size, self.use_async = world_size, use_async
        # The run's weight settings and their config_hash, in each manifest: a resume names what changed.
        self.settings, self.config_hash = settings, settings_hash(settings)
        self.every, self.last_step, self.keep_last = every, last_step, keep_last
        self.metrics = metrics if metrics is not None else NullLogger()
        self.mlflow = mlflow if mlflow is not None else NullLogger()
        self.phase = phase if phase is not None else Phase()
        self.rank = dist.get_rank()
        self.pending: tuple[Any, StoreWriter, int] | None = None
        self.group = dist.new_group(backend="gloo") if use_async else None
        self.saved_step = -1  # the step of the newest checkpoint written or loaded
        self.rng_restored = False  # whether the loaded checkpoint had this rank's RNG file
        self.evaluated: tuple[int, dict[str, float]] | None = None  # the last eval during training
        self.supersede: frozenset[str] = frozenset()  # step folders newer than the resumed one (rank 0)
        self.on_commit: list[Callable[[int], None]] = []  # told the step of each checkpoint committed
        self.base = _identity(frozen_base) if frozen_base is not None else None

    # ------------------------------------------------------------------ resume

    def resume(self, state: TrainState) -> tuple[str | None, bool]:
        """Collective. Load the newest checkpoint whose files verify into ``state``: returns its
        URI (None: starting from scratch) and whether this rank's RNG state was restored too.

        Rank 0 walks ``commit.candidates`` (``latest`` first, then newest first) and hands each to
        every rank; each rank verifies what it reads and all agree (DCP gathers the failures), so
        they fall back together. Every skipped checkpoint is logged as ``checkpoint fallback:`` and
        the MLflow run is tagged ``checkpoint.resumed_from`` / ``checkpoint.fallback_reason``."""
        walk = commit.candidates(self.loc) if self.rank == 0 else None
        reasons: list[str] = []
        while (cand := _from_rank0(walk)) is not None:
            self._check_base(cand)
            problem = cand.problem or self._load(state, cand)
            if problem is None:
                uri = self.loc.uri(cand.step_dir)
                self._report(reasons, resumed=uri, step_dir=cand.step_dir, manifest=cand.manifest)
                self.saved_step = state.step
                return uri, self.rng_restored
            reasons.append(problem)
        if reasons:  # something was there, nothing verified: a fresh optimizer, as if never touched
            state.optimizer.state.clear()
            reasons.append("no checkpoint verified; starting from step 0")
        self._report(reasons, resumed=None, step_dir=None)
        return None, False

    def _check_base(self, cand: Candidate) -> None:
        """An adapter's checkpoint holds what trains, not the frozen base it is read with: refused (on
        every rank alike) when the base's weights are no longer those it trained on, rather than
        resumed onto other weights or dropped for an older checkpoint."""
        was = (cand.manifest or {}).get("base")
        if self.base is None or was is None or was["sha256"] == self.base["sha256"]:
            return
        raise ConfigError("model", f"checkpoint {self.loc.uri(cand.step_dir)} trained its adapter on {was['weights']} "
                          f"with sha256 {was['sha256']}, and {self.base['weights']} now has sha256 "
                          f"{self.base['sha256']}", "put the base it was trained on back at that path, or start a "
                          "new run in another checkpoint_dir")

    def _load(self, state: TrainState, cand: Candidate) -> str | None:
        """Collective: load ``cand`` if every file each rank reads verifies; else why not."""
        self.rng_restored = False
        with tempfile.TemporaryDirectory(prefix="ckpt-read-") as cache:
            reader = VerifiedReader(self.loc, cand.step_dir, cand.manifest, Path(cache))
            # .metadata first, outside DCP (DCP swallows read_metadata errors into a generic one).
            problem = _agree_on(lambda: reader.fetch(METADATA))
            if problem is not None:
                return problem
            try:
                dcp.load({"train": state}, storage_reader=reader, planner=_WeightsOnlyLoadPlanner())
            except CheckpointException as e:
                by_rank = failures(e)
                if not all(isinstance(f, CheckpointCorrupt) for f in by_rank.values()):
                    raise RuntimeError(f"loading {self.loc.uri(cand.step_dir)} failed: {describe(by_rank)}") from None
                return "; ".join(sorted({str(f) for f in by_rank.values()})) + "; falling back to an older checkpoint"
            rng = reader.verified.get(rng_file(self.rank))
            state.load_local_state(None if rng is None else torch.load(rng, weights_only=True))
            self.rng_restored = rng is not None
        return None

    def _report(self, reasons: list[str], *, resumed: str | None, step_dir: str | None,
                manifest: dict[str, Any] | None = None) -> None:
        """Rank 0: log and tag what resume chose and why, and the settings that differ from the
        checkpoint's (the run goes on, no longer the twin of an uninterrupted one); remember which
        newer folders it may overwrite."""
        if self.rank != 0:
            return
        for r in reasons:
            logger.warning(f"checkpoint fallback: {r}")
        tags = {"checkpoint.resumed_from": resumed} if resumed else {}
        if changed := commit.settings_changed(manifest or {}, self.config_hash, self.settings):
            logger.warning(f"resumed {resumed} with other settings than it was saved under: {', '.join(changed)}; "
                           "training goes on with this run's (to train with the checkpoint's, set them back)")
            tags["checkpoint.settings_changed"] = ", ".join(changed)[:5000]
        if reasons:
            tags["checkpoint.fallback_reason"] = "; ".join(reasons)[:5000]
        if tags:
            self.mlflow.set_tags(tags)
        try:
            self.supersede = frozenset(d for d in self.loc.store.list_dirs(self.loc.prefix)
                                       if d.startswith("step_") and (step_dir is None or d > step_dir))
        except StoreError as e:  # only a nicety (re-saved folders lose their old manifest first) is lost
            logger.warning(f"could not list {self.loc.uri()}: {e}")

    # ------------------------------------------------------------------ save

    def note_eval(self, step: int, metrics: dict[str, float]) -> None:
        """An evaluation during training: recorded next to the checkpoint of the same step (retention
        keeps the best one by eval/loss)."""
        self.evaluated = (step, dict(metrics))

    def maybe_save(self, state: TrainState, step: int) -> None:
        """After a step: commit a finished async save; every ``every`` steps (but not the last
        step, which ``finalize`` writes), save."""
        self.poll()
        if not self.every or step % self.every or (self.last_step is not None and step >= self.last_step):
            return
        with self.phase(f"checkpoint save at step {step}"):
            blocked = self.save(state)
        logger.info(f"checkpoint step {step}: training blocked {blocked:.4f}s ({'async' if self.use_async else 'sync'})")
        self.metrics.log_metrics({"ckpt/blocking_s": blocked}, step=step)
        self.saved_step = step

    def finalize(self, state: TrainState, model, spec: ModelSpec, tokenizer_file: Path | None = None) -> str:
        """Collective: the final checkpoint of ``state.step`` with the portable model, unless that
        step was saved already. Returns its URI."""
        self.wait()
        if self.saved_step != state.step:
            # The portable model is exported first and committed with the checkpoint, so a
            # committed final checkpoint always carries model.safetensors.
            with tempfile.TemporaryDirectory(prefix="export-") as exported:
                export_model(model, exported, spec, tokenizer_file, base_sha256=self.base and self.base["sha256"])
                self._save(state, self._writer(state, model_dir=Path(exported)), sync=True)
        return self.loc.uri(step_dir_name(state.step))

    def save(self, state: TrainState, *, final: bool = False) -> float:
        """Start (async) or do (sync) a save; returns the seconds training was blocked."""
        t0 = time.perf_counter()
        self.wait()
        self._save(state, self._writer(state), sync=final or not self.use_async)
        return time.perf_counter() - t0

    def _writer(self, state: TrainState, *, model_dir: Path | None = None) -> StoreWriter:
        step, step_dir = state.step, step_dir_name(state.step)
        rng = io.BytesIO()
        torch.save(state.local_state(), rng)
        extras: dict[str, bytes | Path] = {rng_file(self.rank): rng.getvalue()}
        if model_dir is not None and self.rank == 0:
            extras.update({name: model_dir / name for name in EXPORTED if (model_dir / name).is_file()})
        evaluated = self.evaluated[1] if self.evaluated and self.evaluated[0] == step else None
        t0 = time.perf_counter()

        def on_commit(files: list[dict[str, Any]]) -> None:  # the coordinator, once every file is stored
            manifest = commit.new_manifest(step=step, world_size=self.world_size, config_hash=self.config_hash,
                                            files=files, base=self.base, settings=self.settings)
            raw = json.dumps(manifest, indent=2).encode()
            commit.commit(self.loc, step_dir, raw, step=step, supersede=self.supersede)
            if evaluated is not None:
                write_eval(self.loc, step_dir, evaluated)
            writer.commit_s = time.perf_counter() - t0
            self._retain()

        writer = StoreWriter(self.loc, step_dir, extras=extras, on_commit=on_commit,
                             replaces=self.rank == 0 and step_dir in self.supersede)
        return writer

    def _save(self, state: TrainState, writer: StoreWriter, *, sync: bool) -> None:
        if not sync:
            future = dcp.async_save({"train": state}, storage_writer=writer, process_group=self.group)
            self.pending = (future, writer, state.step)
            return
        try:
            dcp.save({"train": state}, storage_writer=writer)
        except CheckpointException as e:
            raise not_committed(self.loc.uri(writer.step_dir), e) from None
        self._committed(writer, state.step)

    def _retain(self) -> None:
        """Coordinator, after a commit returned (so it is durable): prune to ``keep_last``."""
        if not self.keep_last:
            return
        try:
            retain(self.loc, keep_last=self.keep_last)  # logs what it deletes
        except StoreError as e:  # the checkpoint is committed; a store that cannot prune is worth a warning
            logger.warning(f"checkpoint retention skipped: {e}")

    def _committed(self, writer: StoreWriter, step: int) -> None:
        self.supersede = self.supersede - {writer.step_dir}
        for callback in self.on_commit:
            callback(step)
        if self.rank == 0:
            self.metrics.log_metrics({"ckpt/save_s": writer.commit_s}, step=step)

    def poll(self) -> None:
        """Finish a done async save (its commit ran in the background) without waiting for an unfinished one."""
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def wait(self) -> None:
        if self.pending is None:
            return
        future, writer, step = self.pending
        self.pending = None
        with self.phase(f"checkpoint save of step {step} (async)"):
            try:
                future.result()
            except CheckpointException as e:
                raise not_committed(self.loc.uri(writer.step_dir), e) from None
            self._committed(writer, step)


def _identity(weights: Path) -> dict[str, str]:
    """Collective: the file and sha256 of a frozen base's weights, hashed on rank 0 alone."""
    from training.util import sha256_file

    box = [sha256_file(weights) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return {"weights": str(weights), "sha256": box[0]}


def _from_rank0(walk: Any) -> Any:
    """Collective: rank 0's next candidate (``walk`` is None elsewhere) on every rank; a failure to
    read the store on rank 0 is raised on every rank, instead of leaving the others waiting."""
    box: list[Any] = [None]
    if walk is not None:
        try:
            box = [(next(walk, None), None)]
        except Exception as e:
            box = [(None, f"{type(e).__name__}: {e}")]
    dist.broadcast_object_list(box, src=0)
    cand, error = box[0]
    if error is not None:
        raise RuntimeError(f"reading the checkpoints failed: {error}")
    return cand


def _agree_on(check: Callable[[], Any]) -> str | None:
    """Collective: run ``check`` on every rank; the problems it found (CheckpointCorrupt) on any
    rank, or None when there were none. Any other failure is raised on every rank."""
    try:
        check()
        mine: tuple[str, str] | None = None
    except CheckpointCorrupt as e:
        mine = ("corrupt", str(e))
    except Exception as e:
        mine = ("error", f"{type(e).__name__}: {e}")
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    errors = [m for kind, m in filter(None, everyone) if kind == "error"]
    if errors:
        raise RuntimeError(f"reading a checkpoint failed: {errors[0]}")
    problems = sorted({m for _, m in filter(None, everyone)})
    return "; ".join(problems) + "; falling back to an older checkpoint" if problems else None


