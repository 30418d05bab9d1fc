"""Saving: a copy of everything a step depends on, taken between steps, stored while training goes on.

``snapshot`` runs on the loop between two steps and is the whole stall a save adds to training; ``store`` encodes
and uploads that copy (on a worker thread) and returns what became of it (``SaveOutcome``). recovery.py runs the
upload in the background and orders what follows a save (the record, the metrics row, the purge).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import yaml

from services.common.config import BuildInfo, redacted_dump
from services.common.observe.logs import Stopwatch, log_event
from services.common.observe.telemetry import TrainerMetrics
from services.trainer.checkpoint import CheckpointStore
from services.trainer.checkpoint_state import Checkpoint, TrainerState
from services.trainer.intake import GroupLedger, PromptFeeder
from services.trainer.learner import Learner
from services.trainer.lineage import Lineage
from services.trainer.progress import ConfigSource, Progress
from services.trainer.retention import Purger

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveOutcome:
    step: int
    seconds: float  # encoding and upload
    location: str = ""  # where it was stored; "" when it failed
    error: str = ""  # why it failed; "" when stored


class Checkpointer:
    def __init__(
        self,
        settings: ConfigSource,
        learner: Learner,
        checkpoints: CheckpointStore,
        lineage: Lineage,
        progress: Progress,
        ledger: GroupLedger,
        feeder: PromptFeeder,
        purger: Purger,
        telemetry: TrainerMetrics,
        build: BuildInfo,
    ):
        self.settings = settings
        self.learner = learner
        self.checkpoints = checkpoints
        self.lineage = lineage
        self.progress = progress
        self.ledger = ledger
        self.feeder = feeder
        self.purger = purger
        self.telemetry = telemetry
        self.build = build

    def snapshot(self, config_version: int) -> Checkpoint:
        """A copy of everything to save, taken between steps so the upload can run while training goes on."""
        cfg, progress, learner = self.settings.cfg, self.progress, self.learner
        self.ledger.advance()  # the newest watermark, so the checkpoint lists as few groups beside it as it can
        state = learner.state()  # in host memory and one process's format, whatever the world size
        return Checkpoint(
            step=progress.step,
            model=state.model,
            optimizer=state.optimizer,
            scheduler=learner.scheduler.state_dict(),
            rng=learner.rng_state(),
            critic=state.critic,
            lineage=self.lineage.text(),
            state=TrainerState(
                step=progress.step,
                policy_version=progress.version,
                config_version=config_version,
                data_cursor=self.feeder.cursor,
                last_experience_seq=progress.applied_seq,
                in_flight=self.ledger.unsettled(),
                eval_accuracy=progress.last_eval,
                baseline_accuracy=progress.baseline_eval,
                metrics=dict(progress.last_row),
                incarnation=progress.incarnation,
                settled_through=self.ledger.watermark(),
                applied_ids=self.ledger.exceptions(),
                dead_ids=self.ledger.dead(),
                dead_seq=progress.dead_seq,
                reinjected=sorted(self.ledger.reinjected),
                claim_keys=sorted((seq, key) for key, seq in self.purger.claim_keys.items()),
                version_high_water=max(progress.version, self.lineage.max_version()),
            ),
            extras={
                # What produced these weights, for whoever restores or audits them.
                "config.yaml": yaml.safe_dump(redacted_dump(cfg), sort_keys=False).encode(),
                "build.json": json.dumps({"version": self.build.version, "revision": self.build.revision}).encode(),
            },
        )

    async def store(self, ckpt: Checkpoint) -> SaveOutcome:
        """Encode and upload ``ckpt`` off the loop; a failure is logged and returned, never raised."""
        took = Stopwatch()
        try:
            location = await asyncio.to_thread(self.checkpoints.save, ckpt, self.settings.cfg.model.path)
        except Exception as error:  # the store's many failure types; training must go on
            self.telemetry.record_checkpoint(took(), ok=False)
            log_event(
                log, "checkpoint_failed", level=logging.ERROR, alert=True, step=ckpt.step, error=repr(error)[:500]
            )
            return SaveOutcome(ckpt.step, took(), error=repr(error)[:500])
        seconds = took()
        self.telemetry.record_checkpoint(seconds, ok=True)
        return SaveOutcome(ckpt.step, seconds, location=location)
