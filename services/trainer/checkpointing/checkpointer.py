"""Saving: a copy of everything a step depends on, taken between steps, stored while training goes on.

``snapshot`` is taken between two steps and is the whole stall a save adds to training (reported as
``checkpoint_stall_s``): a host-memory copy of the weights, and of the optimizer state on the saves that keep it
(``checkpoint.optimizer_every``). The trainer's own state (ledger, progress, cursor: small, and changed only by the
event loop) is read on the loop; the copies (seconds for a model, tens on a loaded machine) and the copy of the
lineage are made on a worker thread, which the step waits for while the loop stays free to renew the lease and
answer calls. ``store`` encodes and uploads the copy on a worker thread and returns what became of it
(``SaveOutcome``). recovery.py runs the upload in the background and orders what follows a save (the record, the
metrics row, the purge).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, replace
from typing import Any

import torch
import yaml

from services.common.config import BuildInfo, redacted_dump
from services.common.observe.events import Event
from services.common.observe.instruments import TrainerMetrics
from services.common.observe.logs import Stopwatch, log_event
from services.trainer.checkpointing.restorable import Restorable
from services.trainer.checkpointing.retention import Purger
from services.trainer.checkpointing.state import Checkpoint, TrainerState

log = logging.getLogger(__name__)


def holds_optimizer(step: int, save_every: int, optimizer_every: int, final: bool) -> bool:
    """Whether the save of ``step`` keeps the optimizer state: every ``optimizer_every``-th periodic save, counted by
    step so that a restart keeps the rhythm, and every ``final`` one (at a stop, at the end, on request)."""
    if final or optimizer_every == 1 or not save_every:
        return True
    return (step // save_every) % optimizer_every == 0


def in_saved_dtype(
    model: dict[str, torch.Tensor], weights_dtype: str, serving: str
) -> tuple[dict[str, torch.Tensor], str]:
    """``model``'s tensors as ``checkpoint.weights_dtype`` saves them, and the dtype named in the checkpoint when it
    is not the master weights' ("" otherwise: a resume is exact)."""
    target = getattr(torch, serving)
    if weights_dtype == "master" or all(t.dtype == target for t in model.values() if t.is_floating_point()):
        return model, ""
    return {name: t.to(target) if t.is_floating_point() else t for name, t in model.items()}, serving


@dataclass(frozen=True)
class Taken:
    """A snapshot taken for a save, and how long reading the lineage for it took (``checkpoint_lineage_s``)."""

    checkpoint: Checkpoint
    lineage_s: float


@dataclass(frozen=True)
class _Copies:
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    critic: dict[str, torch.Tensor] | None
    weights_dtype: str
    lineage: str
    lineage_s: float


@dataclass(frozen=True)
class SaveOutcome:
    step: int
    seconds: float  # encoding and upload
    location: str = ""  # where it was stored; "" when it failed
    error: str = ""  # why it failed; "" when stored


class Checkpointer:
    def __init__(
        self,
        parts: Restorable,
        purger: Purger,
        telemetry: TrainerMetrics,
        build: BuildInfo,
    ):
        self.parts = parts
        self.purger = purger
        self.telemetry = telemetry
        self.build = build

    async def snapshot(self, config_version: int, final: bool) -> Taken:
        """A copy of everything to save, taken between steps so the upload can run while training goes on;
        ``final``: a save at a stop, at the end or on request, which always keeps the optimizer state."""
        cfg, progress, learner = self.parts.settings.cfg, self.parts.progress, self.parts.learner
        self.parts.ledger.advance()  # the newest watermark, so the checkpoint lists as few groups beside it as it can
        ck = cfg.checkpoint
        optimizer = holds_optimizer(progress.step, ck.save_every_steps, ck.optimizer_every, final)
        took = Stopwatch()
        lineage = self.parts.lineage.catch_up()  # only the lines appended since the last save are read
        lineage_end, version_high_water = lineage.end, max(progress.version, lineage.max_version)
        lineage_s = took()
        state = TrainerState(
            step=progress.step,
            policy_version=progress.version,
            config_version=config_version,
            data_cursor=self.parts.feeder.cursor,
            last_experience_seq=progress.applied_seq,
            in_flight=self.parts.ledger.unsettled(),
            eval_accuracy=progress.last_eval,
            baseline_accuracy=progress.baseline_eval,
            metrics=dict(progress.last_row),
            incarnation=progress.incarnation,
            settled_through=self.parts.ledger.watermark(),
            applied_ids=self.parts.ledger.exceptions(),
            dead_ids=self.parts.ledger.dead(),
            dead_seq=progress.dead_seq,
            reinjected=sorted(self.parts.ledger.reinjected),
            claim_keys=sorted((seq, key) for key, seq in self.purger.claim_keys.items()),
            version_high_water=version_high_water,
            base_model_path=learner.base_model[0],
            base_model_sha256=learner.base_model[1],
        )
        scheduler, rng = learner.scheduler.state_dict(), learner.rng_state()
        copies = await asyncio.to_thread(self._copies, optimizer, lineage_end)
        return Taken(
            Checkpoint(
                step=progress.step,
                model=copies.model,
                optimizer=copies.optimizer,
                scheduler=scheduler,
                rng=rng,
                critic=copies.critic,
                lineage=copies.lineage,
                state=replace(state, weights_dtype=copies.weights_dtype),
                extras={
                    # What produced these weights, for whoever restores or audits them.
                    "config.yaml": yaml.safe_dump(redacted_dump(cfg), sort_keys=False).encode(),
                    "build.json": json.dumps({"version": self.build.version, "revision": self.build.revision}).encode(),
                },
            ),
            lineage_s=lineage_s + copies.lineage_s,
        )

    def _copies(self, optimizer: bool, lineage_end: int) -> _Copies:
        """On a worker thread: the learner's state in host memory, in the dtype it is saved in, and the lineage's
        first ``lineage_end`` bytes (what it held when the snapshot was asked for)."""
        cfg = self.parts.settings.cfg
        state = self.parts.learner.state(optimizer=optimizer)  # host memory, one process's format, any world size
        model, weights_dtype = in_saved_dtype(state.model, cfg.checkpoint.weights_dtype, cfg.model.dtype)
        took = Stopwatch()
        lineage = self.parts.lineage.text(lineage_end)
        return _Copies(model, state.optimizer, state.critic, weights_dtype, lineage, took())

    async def store(self, ckpt: Checkpoint) -> SaveOutcome:
        """Encode and upload ``ckpt`` off the loop; a failure is logged and returned, never raised."""
        took = Stopwatch()
        try:
            location = await asyncio.to_thread(self.parts.checkpoints.save, ckpt, self.parts.settings.cfg.model.folder)
        except Exception as error:  # the store's many failure types; training must go on
            self.telemetry.record_checkpoint(took(), ok=False)
            log_event(
                log, Event.CHECKPOINT_FAILED, level=logging.ERROR, alert=True, step=ckpt.step, error=repr(error)[:500]
            )
            return SaveOutcome(ckpt.step, took(), error=repr(error)[:500])
        seconds = took()
        self.telemetry.record_checkpoint(seconds, ok=True)
        return SaveOutcome(ckpt.step, seconds, location=location)
