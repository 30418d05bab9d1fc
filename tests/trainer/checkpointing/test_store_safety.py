"""Loading a checkpoint never unpickles an object: a part carrying one is refused before any of its code runs."""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from services.common.config import CheckpointConfig
from services.common.transport.storage import open_store
from services.trainer.checkpointing.state import CheckpointMismatch, UnsafeCheckpoint, load_untied, restore_rng
from services.trainer.checkpointing.store import CheckpointStore
from tests.support.trainer import checkpoint

pytestmark = pytest.mark.unit


class Payload:
    """What an attacker with write access to the store plants: unpickling it creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def stored(tmp_path: Path) -> tuple[CheckpointStore, str]:
    model_dir = tmp_path / "hf"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "tiny"}')
    store = CheckpointStore(open_store((tmp_path / "ckpt").as_uri(), CheckpointConfig()), "run-a", keep_last=3)
    incarnation = store.start_fresh()
    for step in (1, 2):
        store.save(checkpoint(step, incarnation), model_dir)
    return store, "run-a/step-00000002/"


def replace_part(store: CheckpointStore, prefix: str, name: str, data: bytes, drop: str | None = None) -> None:
    """Put ``data`` as part ``name`` and re-sign the manifest, as a writer of the store could."""
    manifest = json.loads(store.store.get(prefix + "manifest.json"))
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if drop:
        manifest["files"].pop(drop)
        store.store.delete([prefix + drop])
    store.store.put(prefix + name, data)
    store.store.put(prefix + "manifest.json", json.dumps(manifest).encode())


def test_checkpoint_round_trip_restores_every_rng_state_without_unpickling(tmp_path):
    store, _ = stored(tmp_path)
    saved = checkpoint(3, store.incarnation)  # captures the RNG states after its model's seeded init
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    store.save(saved, tmp_path / "hf")
    random.seed(1), np.random.seed(1), torch.manual_seed(1)

    restore_rng(store.load(3).rng)

    assert "run-a/step-00000003/rng.pt" in store.store.list("run-a/step-00000003/")
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


@pytest.mark.parametrize("part", ["optimizer.pt", "scheduler.pt", "rng.pt"])
def test_a_part_carrying_a_pickled_object_is_refused_and_its_code_never_runs(tmp_path, part):
    store, prefix = stored(tmp_path)
    marker = tmp_path / "payload-ran"
    planted = io.BytesIO()
    torch.save({"state": {}, "param_groups": [], "hook": Payload(marker)}, planted)
    replace_part(store, prefix, part, planted.getvalue())

    with pytest.raises(UnsafeCheckpoint, match=re.escape(f"step 2: {part} holds something other than tensors")):
        store.load(2)
    assert not marker.exists()
    # Resuming skips the refused step and takes the previous one.
    assert store.load_latest().step == 1
    assert not marker.exists()


def test_a_checkpoint_with_a_pickled_rng_file_from_the_old_format_is_refused(tmp_path):
    store, prefix = stored(tmp_path)
    marker = tmp_path / "payload-ran"
    replace_part(store, prefix, "rng.pkl", pickle.dumps(Payload(marker)), drop="rng.pt")

    with pytest.raises(UnsafeCheckpoint, match=r"step 2: rng\.pkl is a Python pickle"):
        store.load(2)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("spoil", "reason"),
    [
        (lambda state: state.update({"1.bias": torch.zeros(5)}), r"1.bias has shape \[5\], the model \[2\]"),
        (lambda state: state["1.weight"].__setitem__((0, 0), float("nan")), r"1.weight holds NaN or infinite"),
        (lambda state: state.update({"1.bias": state["1.bias"].double()}), r"1.bias is torch.float64"),
        (lambda state: state.pop("0.weight"), r"missing 0.weight"),
    ],
)
def test_a_state_that_does_not_fit_is_refused_before_any_tensor_is_copied(spoil, reason):
    """Before, tensors that fitted were copied and the misfit raised afterwards (or a NaN was loaded): mixed weights."""
    module = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    before = {name: tensor.clone() for name, tensor in module.state_dict().items()}
    state = {name: tensor + 1 for name, tensor in module.state_dict().items()}
    spoil(state)
    with pytest.raises(CheckpointMismatch, match=reason):
        load_untied(module, state)
    assert all(torch.equal(module.state_dict()[name], tensor) for name, tensor in before.items())
