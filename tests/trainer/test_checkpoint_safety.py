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
from services.trainer.checkpoint import CheckpointStore, UnsafeCheckpoint, restore_rng
from tests.trainer.test_checkpoint import checkpoint

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
