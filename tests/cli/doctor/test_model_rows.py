"""`rlpipe doctor`'s model rows: the model folder's hash against what the config pins, and a model.path URL's
source before anything is fetched."""

from __future__ import annotations

import pytest

from services.cli.doctor.model import model_rows
from services.common.config import CheckpointConfig
from services.common.transport.model_source import folder_sha256
from services.common.transport.storage import S3Store
from tests.support.runs import run_config

pytestmark = pytest.mark.unit


def rows(tmp_path, model_dir, data_dir, **model):
    cfg = run_config(tmp_path, (model_dir, data_dir), model=model)
    return {row.name: row for row in model_rows(cfg)}


def test_the_model_hash_row_prints_the_folders_hash_and_checks_a_pinned_one(tmp_path, config_only_model):
    model_dir, data_dir = config_only_model
    digest = folder_sha256(model_dir)
    unpinned = rows(tmp_path, model_dir, data_dir)
    assert set(unpinned) == {"model hash"}
    assert unpinned["model hash"].status == "ok"
    assert unpinned["model hash"].detail.startswith(f"sha256 {digest} of {model_dir} (not pinned: set model.sha256")

    assert rows(tmp_path, model_dir, data_dir, sha256=digest)["model hash"].status == "ok"
    wrong = rows(tmp_path, model_dir, data_dir, sha256="e" * 64)["model hash"]
    assert wrong.status == "fail"
    assert f"hashes to {digest}, the config pins {'e' * 64}" in wrong.detail


def test_a_hub_repository_out_of_every_cache_with_fetching_off_fails_the_source_row(tmp_path, config_only_model):
    model_dir, data_dir = config_only_model
    found = rows(tmp_path, model_dir, data_dir, path="hf://org/name", fetch={"cache_dir": str(tmp_path / "cache")})
    assert found["model source"].status == "fail"
    assert "model.fetch.hub_download is off" in found["model source"].detail
    assert found["model hash"].status == "skip"


@pytest.mark.integration
def test_an_s3_model_not_fetched_yet_is_listed_at_its_source_and_nothing_is_downloaded(
    tmp_path, config_only_model, s3_env
):
    model_dir, data_dir = config_only_model
    store = S3Store("doctor-models", "m", CheckpointConfig(s3_endpoint=s3_env, s3_secure=False))
    store.put("config.json", (model_dir / "config.json").read_bytes())
    store.put("model.safetensors", b"x" * 2048)
    found = rows(
        tmp_path,
        model_dir,
        data_dir,
        path="s3://doctor-models/m/",
        fetch={"cache_dir": str(tmp_path / "cache"), "s3_endpoint": s3_env, "s3_secure": False},
    )
    assert found["model source"].status == "ok"
    assert "s3://doctor-models/m/: 2 files, 2.0 KiB" in found["model source"].detail
    assert found["model hash"].status == "skip"
    assert not (tmp_path / "cache").exists()
