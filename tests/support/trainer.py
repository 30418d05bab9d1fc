"""The trainer's parts for tests that drive it without its stages: experience scored by the base model, a trainer
wired as its role wires it, small checkpoints, and stand-ins for the stores and trackers it talks to."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.common.config import RunConfig
from services.common.model.modeling import load_tokenizer
from services.common.observe.trackers import TrackerEntry
from services.common.pb import admin_pb2
from services.common.transport.bus import Bus
from services.common.transport.live_config import LiveConfig
from services.common.transport.messages import Completion, ExperienceGroup, Prompt, RolloutGroup, ScoredGroup, advance
from services.common.transport.weightsync.server import WeightSyncServer
from services.reference.service import ReferenceScorer
from services.trainer.checkpointing.state import Checkpoint, TrainerState, rng_state
from services.trainer.checkpointing.store import CheckpointStore
from services.trainer.learning.learner import Learner
from services.trainer.service import Trainer
from tests.support.paths import ROOT
from tests.support.runs import run_config
from tests.support.servers import create_run_state


def experience(cfg, rows, group_size=4, observation: list[int] | None = None) -> list[ExperienceGroup]:
    """Groups whose completions are right or wrong answers, scored by the base model as the sampler would.

    With ``observation``, each completion is a two-turn episode: the answer, those tokens inserted by an
    environment (loss mask 0, sampling logprob 0), then the model's end of sequence."""
    scorer = ReferenceScorer(cfg)
    tokenizer = load_tokenizer(cfg.model.path)
    rng = np.random.default_rng(0)
    groups = []
    for row in rows:
        prompt_ids = tokenizer.encode(row["prompt"], add_special_tokens=False)
        completions, rewards = [], []
        for k in range(group_size):
            right = k % 2 == 0
            text = row["answer"] if right else str(int(row["answer"]) + int(rng.integers(1, 9)))
            answer = tokenizer.encode(text, add_special_tokens=False)
            inserted = observation or []
            ids = [*answer, *inserted, tokenizer.eos_token_id]
            completions.append(
                Completion(
                    text=text,
                    token_ids=np.asarray(ids, dtype=np.int32),
                    logprobs=np.zeros(len(ids), np.float32),
                    finish_reason="stop",
                    loss_mask=np.asarray([1] * len(answer) + [0] * len(inserted) + [1], dtype=np.int32)
                    if observation
                    else None,
                )
            )
            rewards.append(float(right))
        rollout = advance(
            Prompt(group_id=row["id"], prompt_id=row["id"], prompt=row["prompt"], answer=row["answer"]),
            RolloutGroup,
            prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
            policy_version=0,
            completions=completions,
        )
        groups.append(advance(rollout, ScoredGroup, rewards=np.asarray(rewards, dtype=np.float32)))
    scored = scorer(groups)
    # The sampler's logprobs are the base model's: use the reference's scores for them.
    return [
        advance(
            g,
            ExperienceGroup,
            completions=[
                c.model_copy(update={"logprobs": ref if c.loss_mask is None else ref * c.loss_mask})
                for c, ref in zip(g.completions, g.ref_logprobs, strict=False)
            ],
        )
        for g in scored
    ]


def with_nan(groups, group_index: int, field: str):
    """``groups`` with one group's rewards (or reference logprobs) NaN: built past the message validation that would
    refuse it, as a bug upstream of the learner or a numerical blow-up would hand it over."""
    broken = groups[group_index]
    if field == "rewards":
        update = {"rewards": np.full_like(broken.rewards, np.nan)}
    else:
        update = {"ref_logprobs": [np.full_like(ref, np.nan) for ref in broken.ref_logprobs]}
    return [*groups[:group_index], broken.model_copy(update=update), *groups[group_index + 1 :]]


async def start_trainer(cfg: RunConfig) -> Trainer:
    """A trainer as ``lead`` wires it (its run's streams and buckets created, its checkpoint adopted), not running."""
    await create_run_state(cfg)
    bus = await Bus(cfg, "trainer").connect()
    live = await LiveConfig(cfg, bus.js).start()
    learner = Learner(cfg)
    trainer = Trainer(cfg, bus, learner, WeightSyncServer(learner.snapshot(version=0, step=0)), live)
    await trainer.prepare()
    return trainer


class Holds:
    """The run's config bucket as Control sees it: where a pause or stop is kept across restarts."""

    def __init__(self) -> None:
        self.stored: dict[str, Any] = {}

    async def put_control(self, control: dict[str, Any]) -> None:
        self.stored = control

    async def get_control(self) -> dict[str, Any]:
        return self.stored


class StuckTracker:
    """A tracker whose ``log`` blocks until released, like a hung tracking server."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.steps: list[int] = []

    def log(self, entry: TrackerEntry) -> None:
        self.entered.set()
        assert self.release.wait(10)
        self.steps.append(entry.step)

    def close(self) -> None:
        pass


class StatusOnly:
    """Stands in for the trainer's status reporter: this test is about who gets through, not what they get."""

    async def status(self) -> admin_pb2.Status:
        return admin_pb2.Status(run_id="tls", state="running", step=7)


def checkpoint(step: int, incarnation: str, extra: dict[str, torch.Tensor] | None = None, **state) -> Checkpoint:
    """A small checkpoint of ``step``; ``state`` overrides TrainerState fields (the version defaults to the step)."""
    model, optimizer = tiny_state(step)
    fields = {"step": step, "policy_version": step, "last_experience_seq": 10 * step, "incarnation": incarnation}
    return Checkpoint(
        step,
        {**model.state_dict(), **(extra or {})},
        optimizer.state_dict(),
        {"last_epoch": step},
        rng_state(),
        TrainerState(**(fields | state)),
    )


def stored_objects(store: CheckpointStore) -> dict[str, bytes]:
    """Every object under the run's prefix with its bytes: what a write, prune or purge note would change."""
    return {key: store.store.get(key) for key in store.store.list(f"{store.run_id}/")}


def tiny_state(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    model[1].weight = model[0].weight  # tied, like the tiny Qwen2's embeddings
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.tensor([1, 2])).sum().backward()
    optimizer.step()
    return model, optimizer


def trainer_config(tmp_path: Path, tiny_model: tuple[Path, Path], nats_url: str) -> RunConfig:
    """A run config for a trainer started in the test's process (``start_trainer``): the broker at ``nats_url``,
    gRPC and admin ports the system picks, and no held-out evaluation."""
    return run_config(
        tmp_path,
        tiny_model,
        nats={"url": nats_url},
        service={"trainer_grpc_port": 0},
        admin={"port": 0},
        data={"eval_path": None},
    )


# How long a trainer process may take to log an event or exit: its start imports torch and loads the model.
TRAINER_START_TIMEOUT_S = 180.0


class TrainerProcess:
    """A real trainer process and the events it logs."""

    def __init__(self, config, nats_url: str, **settings: str):
        """``settings``: more of its environment (``RLPIPE_CHECKPOINT__RESUME``, the store's credentials)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RLPIPE_")}
        env |= {
            "OMP_NUM_THREADS": "1",
            "RLPIPE_NATS__URL": nats_url,
            "RLPIPE_ADMIN_TOKEN": "s3cret",
            "RLPIPE_SERVICE__TRAINER_GRPC_PORT": "0",
            "RLPIPE_ADMIN__PORT": "0",
            **settings,
        }
        self.process = subprocess.Popen(
            [sys.executable, "-m", "services.trainer", "--config", str(config)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.events: list[dict] = []
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.output.append(line)
            if line.startswith("{"):
                self.events.append(json.loads(line))

    def event(self, name: str) -> dict | None:
        return next((e for e in list(self.events) if e.get("event") == name), None)

    def wait_event(self, name: str) -> dict:
        deadline = time.monotonic() + TRAINER_START_TIMEOUT_S
        while (found := self.event(name)) is None:
            assert self.process.poll() is None, "".join(self.output)[-4000:]
            assert time.monotonic() < deadline, f"no {name} event: " + "".join(self.output)[-4000:]
            time.sleep(0.2)
        return found

    def wait_exit(self) -> int:
        code = self.process.wait(timeout=TRAINER_START_TIMEOUT_S)
        time.sleep(0.5)  # the reader thread takes the last lines
        return code
