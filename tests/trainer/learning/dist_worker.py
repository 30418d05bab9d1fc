"""One trainer run for test_distributed.py: the same steps alone or under torchrun, at any world size.

    python -m torch.distributed.run --nproc-per-node 2 tests/trainer/learning/dist_worker.py \\
        --config C --groups G --store DIR --out DIR --steps 4 [--save-at 2] [--resume 2]

Rank 0 drives the Learner as the trainer's driver does (steps, a checkpoint through the real
CheckpointStore, weight-sync snapshot, evaluation) and writes what it saw to ``--out``; the other
ranks follow it. Run alone (no torchrun environment) it is the single-process trainer.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script by torchrun: the repository root is not on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import msgpack
import torch
from safetensors.torch import save_file

from services.common.config import RunConfig, load_config
from services.common.model.datasets import load_jsonl
from services.common.transport.messages import ExperienceGroup, decode
from services.common.transport.storage import FileStore
from services.trainer.checkpointing.state import Checkpoint, TrainerState
from services.trainer.checkpointing.store import CheckpointStore
from services.trainer.learning.distributed import Mesh
from services.trainer.learning.follower import follow
from services.trainer.learning.learner import Learner

RECORDED = ("loss", "pg_loss", "kl_ref", "entropy", "grad_norm", "clipfrac", "approx_kl", "learning_rate")
RECORDED += ("value_loss", "value_mean", "explained_variance")  # PPO's critic, where the algorithm has one
EVAL_ROWS = 8


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--groups", type=Path, required=True, help="msgpack list of encoded ExperienceGroups")
    parser.add_argument("--store", type=Path, required=True, help="checkpoint folder (a file store)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-at", type=int)
    parser.add_argument("--resume", type=int, help="load this step from --store first")
    return parser.parse_args(argv)


def lead(args: argparse.Namespace, cfg: RunConfig, learner: Learner) -> None:
    groups = [decode(raw, ExperienceGroup) for raw in msgpack.unpackb(args.groups.read_bytes(), raw=False)]
    store = CheckpointStore(FileStore(args.store), "dist", keep_last=10)
    first = 1
    if args.resume is not None:
        ckpt = store.load(args.resume)
        incarnation = store.adopt_incarnation(ckpt)
        learner.load(ckpt)
        first = ckpt.step + 1
    else:
        incarnation = store.start_fresh()
    rows: dict[int, dict[str, float]] = {}
    for step in range(first, args.steps + 1):
        metrics = learner.step(groups, policy_version=step - 1)
        rows[step] = {name: metrics[name] for name in RECORDED if name in metrics}
        if step == args.save_at:
            state = learner.state()
            store.save(
                Checkpoint(
                    step=step,
                    model=state.model,
                    optimizer=state.optimizer,
                    scheduler=learner.scheduler.state_dict(),
                    rng=learner.rng_state(),
                    critic=state.critic,
                    state=TrainerState(
                        step=step,
                        policy_version=step,
                        last_experience_seq=step,
                        incarnation=incarnation,
                        base_model_path=learner.base_model[0],  # as the trainer's recovery records it
                        base_model_sha256=learner.base_model[1],
                    ),
                ),
                cfg.model.path,
            )
    snapshot = learner.snapshot(version=args.steps, step=args.steps)
    accuracy = learner.evaluate(load_jsonl(cfg.data.eval_path)[:EVAL_ROWS], cfg.sampling.max_new_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    state = learner.state()
    save_file(state.model, str(args.out / "model.safetensors"))
    # Tied names share a tensor in a snapshot; safetensors wants each name's own.
    save_file({name: t.clone() for name, t in snapshot.tensors}, str(args.out / "snapshot.safetensors"))
    (args.out / "run.json").write_text(
        json.dumps(
            {
                "steps": rows,
                "snapshot_names": [name for name, _ in snapshot.tensors],
                "eval_accuracy": accuracy,
                "steps_done": learner.steps_done,
            }
        )
    )


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    cfg = load_config(args.config)
    torch.manual_seed(0)
    mesh = Mesh.from_env()
    learner = Learner(cfg, mesh)
    try:
        if mesh.is_main:
            lead(args, cfg, learner)
        else:
            follow(mesh, learner)
    finally:
        mesh.close()


if __name__ == "__main__":
    main()
