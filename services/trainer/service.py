"""Trainer: feeds PROMPTS, reads EXPERIENCE in stream order, updates the policy, serves its weights.

It is the only stateful role. It controls staleness by how many prompt groups it
lets be in flight (``max_inflight_batches * batch_size``); a group leaves flight
when its experience arrives or when it is dead-lettered on the way.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
from nats.errors import Error as NatsError

from services.common.bus import DEAD, EXPERIENCE, H_GROUP, PROMPTS, Bus, StreamReader, subject
from services.common.config import RunConfig
from services.common.datasets import load_jsonl
from services.common.evaluation import greedy_accuracy
from services.common.logs import Stopwatch, log_event
from services.common.messages import DecodeError, ExperienceGroup, Prompt
from services.common.pb import weights_pb2_grpc
from services.common.service import start_grpc_server
from services.common.storage import open_store
from services.common.weightsync import WeightSyncServer, snapshot_of
from services.trainer.checkpoint import Checkpoint, CheckpointStore, detached_copy
from services.trainer.lineage import Lineage
from services.trainer.learner import Learner

log = logging.getLogger(__name__)


class PromptFeeder:
    """Walks the dataset epoch by epoch in a seeded order; its cursor is (epoch, index)."""

    def __init__(self, rows: list[dict[str, Any]], seed: int, shuffle: bool):
        self.rows = rows
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.index = 0
        self._order = self._order_of(0)

    def _order_of(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))

    def next(self) -> Prompt:
        row = self.rows[self._order[self.index]]
        prompt = Prompt(
            group_id=f"e{self.epoch}-i{self.index}",
            prompt_id=str(row.get("id", self._order[self.index])),
            prompt=row["prompt"],
            answer=str(row.get("answer", "")),
        )
        self.index += 1
        if self.index == len(self.rows):
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._order_of(self.epoch)
        return prompt

    @property
    def cursor(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def seek(self, cursor: dict[str, int]) -> None:
        self.epoch, self.index = cursor["epoch"], cursor["index"]
        self._order = self._order_of(self.epoch)


class MetricsLog:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a", buffering=1)

    def write(self, row: dict[str, Any]) -> None:
        self.file.write(json.dumps({"time": round(time.time(), 3), **row}) + "\n")


class Trainer:
    def __init__(self, cfg: RunConfig, bus: Bus, learner: Learner, weights: WeightSyncServer):
        self.cfg = cfg
        self.bus = bus
        self.learner = learner
        self.weights = weights
        self.feeder = PromptFeeder(load_jsonl(cfg.data.train_path), cfg.train.seed, cfg.data.shuffle)
        self.eval_rows = load_jsonl(cfg.data.eval_path)[: cfg.data.eval_size] if cfg.data.eval_path else []
        mirror = open_store(cfg.checkpoint.mirror_url, cfg.checkpoint) if cfg.checkpoint.mirror_url else None
        self.checkpoints = CheckpointStore(open_store(cfg.checkpoint_url, cfg.checkpoint), cfg.run_id, cfg.checkpoint.keep_last, mirror=mirror)
        self.metrics = MetricsLog(cfg.metrics_file)
        self.lineage = Lineage(cfg.run_dir / "lineage.jsonl")
        self.in_flight: set[str] = set()
        self.step = 0
        self.version = 0
        self.last_experience_seq = 0  # every EXPERIENCE message up to here is applied, dropped or dead
        self.last_eval: float | None = None
        self.baseline_eval: float | None = None
        self.saved_step = 0
        self.upload: asyncio.Task | None = None

    def restore(self) -> int | None:
        """Continue from the configured or latest valid checkpoint; returns its step, or None for a fresh start."""
        wanted = self.cfg.checkpoint.resume_step
        ckpt = self.checkpoints.load(wanted) if wanted is not None else self.checkpoints.load_latest()
        if ckpt is None:
            return None
        self.learner.load(ckpt)
        state = ckpt.state
        self.step = self.saved_step = state["step"]
        self.feeder.seek(state["data_cursor"])
        self.last_experience_seq = state["last_experience_seq"]
        self.in_flight = set(state["in_flight"])
        self.last_eval, self.baseline_eval = state["eval_accuracy"], state["baseline_accuracy"]
        # Versions only grow: rollouts must see the restored weights as new, whatever they hold now.
        self.version = max(state["policy_version"], self.lineage.max_version()) + 1
        abandoned = self.lineage.restart_from(self.step, self.version, "resume", copy_if_missing=ckpt.lineage)
        log_event(log, "resumed", step=self.step, policy_version=self.version, experience_seq=self.last_experience_seq, abandoned_steps=abandoned)
        return self.step

    async def feed(self) -> None:
        limit = self.cfg.train.max_inflight_batches * self.cfg.train.batch_size
        while len(self.in_flight) < limit:
            cursor = self.feeder.cursor
            prompt = self.feeder.next()
            try:
                await self.bus.publish(PROMPTS, prompt, msg_id=f"{prompt.group_id}.prompt")
            except (NatsError, TimeoutError) as error:
                self.feeder.seek(cursor)  # publish it again later; a copy that did land is deduplicated
                log_event(log, "feed_failed", level=logging.WARNING, group_id=prompt.group_id, error=repr(error)[:300])
                return
            self.in_flight.add(prompt.group_id)

    async def on_dead_letter(self, msg: Any) -> None:
        if msg.headers and msg.headers.get(H_GROUP) in self.in_flight:
            self.in_flight.discard(msg.headers[H_GROUP])
            log_event(log, "group_lost_to_dead_letters", level=logging.WARNING, group_id=msg.headers[H_GROUP])

    async def next_batch(self, reader: StreamReader, stop: asyncio.Event) -> tuple[list[ExperienceGroup], list[str], int]:
        """The next ``batch_size`` usable groups in stream order, the ids dropped as stale, and the last sequence read."""
        batch: list[ExperienceGroup] = []
        dropped: list[str] = []
        sequence = self.last_experience_seq
        max_staleness = self.cfg.train.max_staleness
        while len(batch) < self.cfg.train.batch_size and not stop.is_set():
            await self.feed()
            msg = await reader.next(timeout=1.0)
            if msg is None:
                continue
            sequence = msg.sequence
            try:
                group = self.bus.decode(msg, ExperienceGroup)
            except DecodeError as error:
                await self.bus.dead_letter(msg, str(error), EXPERIENCE)
                continue
            self.in_flight.discard(group.group_id)
            if max_staleness is not None and self.version - group.policy_version > max_staleness:
                dropped.append(group.group_id)
                continue
            batch.append(group)
        return batch, dropped, sequence

    async def evaluate(self) -> float | None:
        if not self.eval_rows:
            return None
        took = Stopwatch()
        accuracy = await asyncio.to_thread(
            greedy_accuracy, self.learner.model, self.learner.tokenizer, self.eval_rows, self.cfg.sampling.max_new_tokens
        )
        self.last_eval = accuracy
        self.metrics.write({"step": self.step, "policy_version": self.version, "eval_accuracy": accuracy, "eval_time_s": took()})
        log_event(log, "eval", step=self.step, eval_accuracy=accuracy, eval_s=took())
        return accuracy

    def checkpoint(self) -> Checkpoint:
        """A copy of everything to save, taken between steps so the upload can run while training goes on."""
        critic = self.learner.critic
        return Checkpoint(
            step=self.step,
            model=detached_copy(self.learner.model),
            optimizer=copy.deepcopy(self.learner.optimizer.state_dict()),
            scheduler=self.learner.scheduler.state_dict(),
            rng=self.learner.rng_state(),
            critic=detached_copy(critic) if critic is not None else None,
            lineage=self.lineage.text(),
            state={
                "step": self.step,
                "policy_version": self.version,
                "data_cursor": self.feeder.cursor,
                "last_experience_seq": self.last_experience_seq,
                "in_flight": sorted(self.in_flight),
                "eval_accuracy": self.last_eval,
                "baseline_accuracy": self.baseline_eval,
            },
        )

    async def save(self, wait: bool = False) -> None:
        """Checkpoint in the background; with ``wait``, until it is stored (or has failed)."""
        if self.upload is not None and not self.upload.done():
            if not wait:
                log_event(log, "checkpoint_deferred", level=logging.WARNING, step=self.step, reason="previous upload still running")
                return
            await self.upload
        self.upload = asyncio.create_task(self._upload(self.checkpoint()))
        if wait:
            await self.upload

    async def _upload(self, ckpt: Checkpoint) -> None:
        took = Stopwatch()
        try:
            location = await asyncio.to_thread(self.checkpoints.save, ckpt, self.cfg.model.path)
        except Exception as error:  # the store's many failure types; training must go on
            self.metrics.write({"step": ckpt.step, "checkpoint_failed": 1, "error": repr(error)[:500]})
            log_event(log, "checkpoint_failed", level=logging.ERROR, alert=True, step=ckpt.step, error=repr(error)[:500])
            return
        seconds = took()
        self.saved_step = max(self.saved_step, ckpt.step)
        self.metrics.write({"step": ckpt.step, "checkpoint_saved": 1, "checkpoint_time_s": seconds})
        log_event(log, "checkpoint", step=ckpt.step, location=location, save_s=seconds)

    async def train_step(self, batch: list[ExperienceGroup], dropped: list[str], sequence: int) -> None:
        train = self.cfg.train
        metrics = await asyncio.to_thread(self.learner.step, batch, self.version)
        self.step += 1
        self.version += 1
        self.last_experience_seq = sequence
        self.lineage.record_step(self.step, self.version, [(g.group_id, g.policy_version) for g in batch], dropped, sequence)
        await self.weights.publish(snapshot_of(self.learner.model, self.version, self.step))
        row = {"step": self.step, "policy_version": self.version, "dropped_stale": len(dropped), **metrics}
        self.metrics.write(row)
        if self.step % train.log_interval == 0:
            log_event(log, "step", total_steps=train.total_steps, **row)

    async def run(self, stop: asyncio.Event) -> None:
        train, data = self.cfg.train, self.cfg.data
        resumed = self.cfg.checkpoint.resume and await asyncio.to_thread(self.restore) is not None
        if resumed:
            await self.weights.publish(snapshot_of(self.learner.model, self.version, self.step))
        reader = self.bus.read_from(EXPERIENCE, self.last_experience_seq + 1)
        dead = await self.bus.nc.subscribe(subject(self.cfg.run_id, DEAD), cb=self.on_dead_letter)
        if not resumed:
            self.baseline_eval = await self.evaluate()
        while self.step < train.total_steps and not stop.is_set():
            batch, dropped, sequence = await self.next_batch(reader, stop)
            if len(batch) < train.batch_size:
                break
            await self.train_step(batch, dropped, sequence)
            if self.cfg.checkpoint.save_every_steps and self.step % self.cfg.checkpoint.save_every_steps == 0:
                await self.save()
            if data.eval_every_steps and self.step % data.eval_every_steps == 0 and self.step < train.total_steps:
                await self.evaluate()
        await dead.unsubscribe()
        if self.step < train.total_steps:
            # Stopped by a signal: keep what was applied (a partial batch was not, and will be re-read).
            if self.step > self.saved_step:
                await self.save(wait=True)
            log_event(log, "stopped_early", step=self.step)
            return
        final = await self.evaluate()
        await self.save(wait=True)
        log_event(log, "done", steps=self.step, policy_version=self.version, baseline_accuracy=self.baseline_eval, final_accuracy=final)


async def main(cfg: RunConfig, stop: asyncio.Event) -> None:
    started = Stopwatch()
    learner = await asyncio.to_thread(Learner, cfg)
    model_s = started()
    weights = WeightSyncServer(snapshot_of(learner.model, version=0, step=0))

    def register(server: Any) -> list[str]:
        weights_pb2_grpc.add_WeightSyncServicer_to_server(weights, server)
        return ["rlpipe.v1.WeightSync"]

    server, address = await start_grpc_server(cfg, cfg.service.trainer_grpc_port, register)
    bus = await Bus(cfg, "trainer").connect()
    trainer = Trainer(cfg, bus, learner, weights)
    log_event(log, "ready", grpc=address, model=str(cfg.model.path), model_load_s=model_s, startup_s=started())
    try:
        await trainer.run(stop)
    finally:
        await server.stop(grace=1)
        await bus.close()
