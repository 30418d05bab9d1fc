"""What ``checkpoint.compression: zlib`` buys a save: bytes stored and seconds, against plain, in the same run.

Two checkpoints, each a trainer's full save (float32 master weights and AdamW's two moments):

- the tiny model's (``--tiny``, a model folder; the tests' build/test-model/model by default), its moments from one
  AdamW step on a random loss;
- SmolLM2-135M-shaped random weights (``--smol-config``, the config.json of models/smollm2-135m-instruct when it
  is there, else the shapes written below): N(0, 0.02) weights, moments of the size a few hundred steps leave.
  Random mantissas are the hard case: trained weights compress no better byte for byte.

and, with ``--serving``, SmolLM2's weights alone in bfloat16 (a ``checkpoint.weights_dtype: serving`` save between
two that hold the optimizer state, ``checkpoint.optimizer_every``).

Each is saved to and loaded from a ``file://`` store in a temporary folder (the time is the encode, the
compression and the write; the read, the hash check, the inflation and the decode), ``--repeats`` times, the
median kept. Link speed below which zlib is faster end to end: the bytes it saves over the seconds it costs.

    python -m bench.checkpoint_compression [--repeats 2] [--skip-smol] [--serving]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from services.common.config import CheckpointConfig
from services.common.transport.storage import open_store
from services.trainer.checkpointing.state import Checkpoint, TrainerState, rng_state
from services.trainer.checkpointing.store import CheckpointStore

ROOT = Path(__file__).resolve().parents[1]
SMOL_SHAPE = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
              "num_attention_heads": 9, "num_key_value_heads": 3}  # fmt: skip


def tiny_state(folder: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.arange(8)[None]).logits.square().mean().backward()
    optimizer.step()
    return {name: t.detach().clone() for name, t in model.state_dict().items()}, optimizer.state_dict()


def smol_state(config: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Random weights in SmolLM2's (Llama's) shapes, tied embeddings, and AdamW moments for each."""
    hidden, inter, heads, kv = (config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                     "num_key_value_heads"))  # fmt: skip
    head = hidden // heads
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    for layer in range(config["num_hidden_layers"]):
        at = f"model.layers.{layer}."
        shapes |= {
            at + "self_attn.q_proj.weight": (hidden, hidden),
            at + "self_attn.k_proj.weight": (kv * head, hidden),
            at + "self_attn.v_proj.weight": (kv * head, hidden),
            at + "self_attn.o_proj.weight": (hidden, hidden),
            at + "mlp.gate_proj.weight": (inter, hidden),
            at + "mlp.up_proj.weight": (inter, hidden),
            at + "mlp.down_proj.weight": (hidden, inter),
            at + "input_layernorm.weight": (hidden,),
            at + "post_attention_layernorm.weight": (hidden,),
        }
    generator = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(shape, generator=generator) * 0.02 for name, shape in shapes.items()}
    state = {
        index: {
            "step": torch.tensor(300.0),
            "exp_avg": torch.randn(shape, generator=generator) * 1e-4,
            "exp_avg_sq": (torch.randn(shape, generator=generator) * 1e-4).square(),
        }
        for index, shape in enumerate(shapes.values())
    }
    groups = [{"lr": 1e-5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": list(range(len(shapes)))}]
    return weights, {"state": state, "param_groups": groups}


def measure(name: str, weights: dict, optimizer: dict | None, repeats: int) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {}
    for compression in ("none", "zlib"):
        saves, loads, size = [], [], 0
        for _ in range(repeats):
            with tempfile.TemporaryDirectory() as folder:
                model_dir = Path(folder) / "hf"
                model_dir.mkdir()
                (model_dir / "config.json").write_text("{}")
                store = CheckpointStore(
                    open_store((Path(folder) / "ckpt").as_uri(), CheckpointConfig()),
                    "bench",
                    2,
                    compression=compression,
                )
                incarnation = store.start_fresh()
                state = TrainerState(step=1, policy_version=1, last_experience_seq=1, incarnation=incarnation)
                ckpt = Checkpoint(1, weights, optimizer, {"last_epoch": 1}, rng_state(), state)
                started = time.perf_counter()
                store.save(ckpt, model_dir)
                saves.append(time.perf_counter() - started)
                size = store.catalog()[0].bytes
                started = time.perf_counter()
                store.load(1)
                loads.append(time.perf_counter() - started)
        results[compression] = {"bytes": size, "save_s": statistics.median(saves), "load_s": statistics.median(loads)}
        print(
            f"{name:>6} {compression:>4}: {size / 2**20:8.1f} MiB  save {results[compression]['save_s']:6.2f} s  "
            f"load {results[compression]['load_s']:6.2f} s",
            flush=True,
        )
    plain, packed = results["none"], results["zlib"]
    saved = plain["bytes"] - packed["bytes"]
    extra_s = packed["save_s"] - plain["save_s"]
    print(
        f"{name:>6}: zlib stores {packed['bytes'] / plain['bytes']:.3f} of the bytes, costs {extra_s:.2f} s more per "
        f"save ({plain['bytes'] / 2**20 / max(extra_s, 1e-9):.0f} MiB/s of plain bytes): faster end to end only on a "
        f"link slower than {saved / 2**20 / max(extra_s, 1e-9):.1f} MiB/s",
        flush=True,
    )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", type=Path, default=ROOT / "build" / "test-model" / "model")
    parser.add_argument("--smol-config", type=Path, default=ROOT / "models" / "smollm2-135m-instruct" / "config.json")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-smol", action="store_true")
    parser.add_argument("--serving", action="store_true", help="also SmolLM2's weights alone, in bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(1)
    measure("tiny", *tiny_state(args.tiny), args.repeats)
    if not args.skip_smol:
        config = json.loads(args.smol_config.read_text()) if args.smol_config.is_file() else SMOL_SHAPE
        weights, optimizer = smol_state(config)
        measure("smol", weights, optimizer, args.repeats)
        if args.serving:
            del optimizer
            measure("bf16", {name: t.bfloat16() for name, t in weights.items()}, None, args.repeats)


if __name__ == "__main__":
    main()
