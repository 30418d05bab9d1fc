"""The fixtures that start real processes or build models: a JetStream broker per test, an S3 endpoint, this
worker's warm-start pool, the tiny model, and a config-only model folder for the unit tier."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.models import config_only
from tests.support.paths import TEST_MODEL_DIR, one_builder
from tests.support.runs import WARM_POOL
from tests.support.servers import StoppableS3, free_port, running_warm_pool, start_moto, start_nats

# vLLM's sampler compiles two small helpers with torch.compile on its first batch (the per-token logprob ranks; the
# model itself runs eager, enforce_eager). On the CPU backend that is an inductor C++ build in every rollout process:
# about 3 CPU s and 7 to 40 s of wall time before the first group of every run on this machine, for kernels that a
# 3-layer model does not need. rlpipe itself compiles nothing, so the tests and every process they start (which
# inherits this environment) run those helpers eagerly: the same results, without the build.
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")


@pytest.fixture
def nats_url(tmp_path: Path) -> Iterator[str]:
    """A fresh JetStream server per test, so streams never leak between tests."""
    process, url = start_nats(tmp_path / "nats")
    yield url
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    port = free_port()
    process = start_moto(port)
    yield f"127.0.0.1:{port}"
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture
def s3_env(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("RLPIPE_S3_ACCESS_KEY", "testing")
    monkeypatch.setenv("RLPIPE_S3_SECRET_KEY", "testing")
    return s3_endpoint


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[StoppableS3]:
    """An S3 endpoint of this test's own, which it may stop and start again."""
    monkeypatch.setenv("RLPIPE_S3_ACCESS_KEY", "testing")
    monkeypatch.setenv("RLPIPE_S3_SECRET_KEY", "testing")
    endpoint = StoppableS3()
    yield endpoint
    endpoint.stop()


@pytest.fixture(scope="session")
def warm_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """This worker's warm-start pool: its socket, once the pool listens. ``write_config`` names it in every config
    it writes meanwhile, so the runs over the tiny model fork their roles from it."""
    from services.cli.launch.warm_start import preload_modules

    log_path = tmp_path_factory.mktemp("warm-pool") / "pool.log"
    with running_warm_pool(preload_modules(vllm_rollout=True), log_path) as (_, socket_path):
        WARM_POOL.append(socket_path)
        yield socket_path
        WARM_POOL.remove(socket_path)


@pytest.fixture(scope="session")
def tiny_model(warm_pool: Path) -> tuple[Path, Path]:
    """The project's own tiny model and data, built once (reused while its build settings match); the runs over it
    fork from this worker's warm-start pool."""
    from services.cli.build.tiny_model import main as build

    model_dir, data_dir = TEST_MODEL_DIR / "model", TEST_MODEL_DIR / "data"
    with one_builder("tiny-model"):
        build(["--out", str(model_dir), "--data", str(data_dir), "--seed", "0"])
    return model_dir, data_dir


@pytest.fixture(scope="session")
def tiny_reward_model(tiny_model) -> tuple[Path, dict]:
    """The tiny arithmetic reward model, trained once from the tiny policy (reused while its settings match)."""
    from services.cli.build.tiny_reward_model import build_reward_model

    model_dir, data_dir = tiny_model
    out = TEST_MODEL_DIR / "reward-model"
    with one_builder("reward-model"):
        return out, build_reward_model(out, model_dir, data_dir, seed=0)


@pytest.fixture
def config_only_model(tmp_path: Path) -> tuple[Path, Path]:
    """A model folder and data files the config loader accepts, for a test that only reads a config: nothing to
    load or build (the unit tier may not build the tiny model)."""
    return config_only(tmp_path)
