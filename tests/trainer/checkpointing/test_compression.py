"""checkpoint.compression: zlib stores the weights and optimizer state shuffled and deflated (codec.py); every step
loads back bit for bit whichever way it was stored, and a compressed part that does not come back whole is corrupt."""

from __future__ import annotations

import json

import pytest
import torch

from services.common.config import CheckpointConfig
from services.common.transport.storage import open_store
from services.trainer.checkpointing import codec
from services.trainer.checkpointing.manifest import COMPRESSED_FORMAT, FULL_FORMAT, MANIFEST
from services.trainer.checkpointing.state import Checkpoint, CheckpointCorrupt, TrainerState, rng_state
from services.trainer.checkpointing.store import CheckpointStore

pytestmark = pytest.mark.unit


def weights_and_adam(seed: int, dtype: torch.dtype = torch.float32) -> tuple[dict, dict]:
    """A model's state after one AdamW step: weights of a trained layer's magnitude, and the moments."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(512, 64), torch.nn.Linear(64, 256)).to(dtype)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.02)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.arange(8)).float().square().mean().backward()
    optimizer.step()
    return {name: t.detach().clone() for name, t in model.state_dict().items()}, optimizer.state_dict()


def checkpoint(step: int, incarnation: str, dtype: torch.dtype = torch.float32) -> Checkpoint:
    model, optimizer = weights_and_adam(step, dtype)
    state = TrainerState(step=step, policy_version=step, last_experience_seq=step, incarnation=incarnation)
    return Checkpoint(step, model, optimizer, {"last_epoch": step}, rng_state(), state)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def store(tmp_path, compression: str) -> CheckpointStore:
    return CheckpointStore(
        open_store((tmp_path / "ckpt").as_uri(), CheckpointConfig()), "run", 5, compression=compression
    )


def model_dir(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "tiny"}')
    return folder


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_compressed_save_is_smaller_and_loads_back_bit_for_bit(tmp_path, dtype):
    plain, packed = store(tmp_path / "plain", "none"), store(tmp_path / "zlib", "zlib")
    ckpt = checkpoint(1, plain.start_fresh(), dtype)
    plain.save(ckpt, model_dir(tmp_path))
    packed.start_fresh(ckpt.incarnation)
    packed.save(ckpt, model_dir(tmp_path))

    manifest = json.loads(packed.store.get("run/step-00000001/" + MANIFEST))
    assert manifest["format"] == COMPRESSED_FORMAT
    files = manifest["files"]
    assert {"model.safetensors.zlib", "optimizer.pt.zlib"} <= set(files) and "model.safetensors" not in files
    lane = torch.tensor([], dtype=dtype).element_size()
    assert files["model.safetensors.zlib"]["codec"] == f"zlib/shuffle{lane}/block16M"
    assert files["optimizer.pt.zlib"]["codec"] == f"zlib/shuffle{lane}/block16M"  # AdamW's moments: the weights' dtype
    plain_files = json.loads(plain.store.get("run/step-00000001/" + MANIFEST))["files"]
    assert files["model.safetensors.zlib"]["raw_size"] == plain_files["model.safetensors"]["size"]
    assert files["model.safetensors.zlib"]["size"] < 0.9 * plain_files["model.safetensors"]["size"]
    assert "codec" not in plain_files["model.safetensors"]  # a plain part's entry is as it always was

    loaded = packed.load(1)
    assert loaded.model.keys() == ckpt.model.keys()
    assert all(same_bits(loaded.model[name], tensor) for name, tensor in ckpt.model.items())
    for index, moments in ckpt.optimizer["state"].items():
        for key, tensor in moments.items():
            assert same_bits(loaded.optimizer["state"][index][key], tensor), (index, key)


def test_steps_stored_either_way_load_in_a_store_set_either_way(tmp_path):
    old = store(tmp_path, "none")
    incarnation = old.start_fresh()
    first = checkpoint(1, incarnation)
    old.save(first, model_dir(tmp_path))  # an uncompressed step, as every rlpipe before compression wrote them
    new = store(tmp_path, "zlib")
    new.adopt_incarnation(first)
    second = checkpoint(2, incarnation)
    new.save(second, model_dir(tmp_path))
    manifests = [json.loads(old.store.get(f"run/step-0000000{step}/{MANIFEST}")) for step in (1, 2)]
    assert [m["format"] for m in manifests] == [FULL_FORMAT, COMPRESSED_FORMAT]
    for reader in (old, new):
        for ckpt in (first, second):
            loaded = reader.load(ckpt.step)
            assert all(same_bits(loaded.model[name], t) for name, t in ckpt.model.items()), (
                reader.compression,
                ckpt.step,
            )


def test_a_compressed_part_that_does_not_inflate_to_its_recorded_size_makes_its_step_corrupt(tmp_path):
    packed = store(tmp_path, "zlib")
    incarnation = packed.start_fresh()
    for step in (1, 2):
        packed.save(checkpoint(step, incarnation), model_dir(tmp_path))
    key = "run/step-00000002/" + MANIFEST
    manifest = json.loads(packed.store.get(key))
    manifest["files"]["model.safetensors.zlib"]["raw_size"] += 1
    packed.store.put(key, json.dumps(manifest).encode())
    with pytest.raises(CheckpointCorrupt, match=r"step 2: model.safetensors.zlib: inflates to \d+ bytes, its manifest"):
        packed.load(2)
    manifest["files"]["model.safetensors.zlib"]["codec"] = "zstd/shuffle4"
    packed.store.put(key, json.dumps(manifest).encode())
    with pytest.raises(CheckpointCorrupt, match="codec 'zstd/shuffle4' is not one this rlpipe reads"):
        packed.load(2)
    assert packed.load_latest().step == 1  # the step before it loads instead


@pytest.mark.parametrize("size", [0, 3, 4096, (1 << 20) + 4099])
@pytest.mark.parametrize("lane", [1, 2, 4])
def test_shuffled_and_deflated_bytes_come_back_exactly_across_blocks_and_ragged_tails(size, lane):
    data = torch.randint(0, 256, (size,), generator=torch.Generator().manual_seed(size), dtype=torch.uint8)
    raw = data.numpy().tobytes()
    how = codec.Codec(lane, block_mib=1)
    assert codec.unshuffle(codec.shuffle(raw, lane), lane) == raw
    assert codec.decompress(codec.compress(raw, how), how, len(raw)) == raw
    assert codec.Codec.parse(how.name) == how


def test_the_lane_is_the_element_size_holding_most_bytes():
    assert codec.lane_of([torch.zeros(10, dtype=torch.bfloat16), torch.zeros(3)]) == 2
    assert codec.lane_of([torch.zeros(10, dtype=torch.bfloat16), torch.zeros(6)]) == 4
    assert codec.lane_of([]) == 1
