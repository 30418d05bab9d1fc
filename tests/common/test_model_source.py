"""model.path as an S3 prefix or a Hugging Face repository: fetched once into the cache, reused, and held to
model.sha256 / model.manifest by every role at start (services/common/transport/model_source.py)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from services.common.config import CheckpointConfig, ConfigError, load_config
from services.common.model.modeling import load_model, load_tokenizer
from services.common.refusal import StartRefused
from services.common.transport.model_source import RECORD, folder_hashes, folder_sha256, resolve_model
from services.common.transport.storage import S3Store
from tests.support.models import config_only
from tests.support.paths import ROOT
from tests.support.runs import config_file, write_config

pytestmark = pytest.mark.integration

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def config(tmp_path: Path, data_dir: Path, path: str, **model: object):
    """A run config whose model.path is ``path``, fetched into ``tmp_path / cache``."""
    fetch = {"cache_dir": str(tmp_path / "cache"), **model.pop("fetch", {})}  # type: ignore[dict-item]
    written = write_config(
        tmp_path / "c.yaml", tmp_path, data_dir, tmp_path / "runs", model={"path": path, "fetch": fetch, **model}
    )
    return load_config(written)


def upload(model_dir: Path, endpoint: str, bucket: str, prefix: str) -> S3Store:
    store = S3Store(bucket, prefix, CheckpointConfig(s3_endpoint=endpoint, s3_secure=False))
    for name in folder_hashes(model_dir):
        store.put(name, (model_dir / name).read_bytes())
    return store


def s3_config(tmp_path, data_dir, endpoint, url, **model):
    cfg = config(tmp_path, data_dir, url, fetch={"s3_endpoint": endpoint, "s3_secure": False}, **model)
    return cfg


def test_an_s3_prefix_is_fetched_once_into_the_cache_loads_as_a_model_and_is_reused(tiny_model, s3_env, tmp_path):
    model_dir, data_dir = tiny_model
    store = upload(model_dir, s3_env, "models", "tiny/v1")
    pinned = folder_sha256(model_dir)
    cfg = s3_config(tmp_path, data_dir, s3_env, "s3://models/tiny/v1/", sha256=pinned)
    assert cfg.model.remote

    resolved = resolve_model(cfg)
    folder = Path(resolved.model.path)
    assert folder.parent == tmp_path / "cache" and folder_sha256(folder) == pinned
    assert load_model(folder).config.vocab_size == load_model(model_dir).config.vocab_size
    assert load_tokenizer(folder)("1+1=")["input_ids"] == load_tokenizer(model_dir)("1+1=")["input_ids"]
    record = json.loads((folder / RECORD).read_text())
    assert record["source"] == "s3://models/tiny/v1/" and set(record["files"]) == set(folder_hashes(model_dir))
    assert not [path for path in (tmp_path / "cache").iterdir() if path.name.startswith(".tmp-")]

    # The source is gone: a second start reads nothing from it and gets the same folder.
    store.delete(store.list(""))
    assert store.list("") == []
    again = resolve_model(cfg)
    assert Path(again.model.path) == folder and folder_sha256(folder) == pinned


def test_a_corrupted_file_in_the_cache_is_refused_naming_both_hashes(tiny_model, s3_env, tmp_path):
    model_dir, data_dir = tiny_model
    upload(model_dir, s3_env, "models", "tiny/v2")
    pinned = folder_sha256(model_dir)
    folder = Path(resolve_model(s3_config(tmp_path, data_dir, s3_env, "s3://models/tiny/v2", sha256=pinned)).model.path)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # the same size: only a hash tells
    weights.write_bytes(bytes(data))
    corrupted = folder_sha256(folder)

    with pytest.raises(StartRefused) as refused:
        resolve_model(s3_config(tmp_path, data_dir, s3_env, "s3://models/tiny/v2", sha256=pinned))
    assert f"model.sha256: the model at {folder} (from s3://models/tiny/v2)" in str(refused.value)
    assert f"hashes to {corrupted}, the config pins {pinned}" in str(refused.value)

    manifest = folder_hashes(model_dir)
    with pytest.raises(StartRefused) as refused:
        resolve_model(s3_config(tmp_path, data_dir, s3_env, "s3://models/tiny/v2", manifest=manifest))
    found = hashlib.sha256(bytes(data)).hexdigest()
    assert (
        f"model.manifest: the model at {folder} (from s3://models/tiny/v2) does not match: model.safetensors "
        f"hashes to {found}, the manifest pins {manifest['model.safetensors']}" == str(refused.value)
    )


def test_a_source_that_is_not_the_pinned_model_leaves_nothing_in_the_cache(tiny_model, s3_env, tmp_path):
    model_dir, data_dir = tiny_model
    upload(model_dir, s3_env, "models", "tiny/v3")
    wrong = "0" * 64
    with pytest.raises(StartRefused, match=f"model.sha256: .* hashes to {folder_sha256(model_dir)}, the config pins"):
        resolve_model(s3_config(tmp_path, data_dir, s3_env, "s3://models/tiny/v3/", sha256=wrong))
    assert [path.name for path in (tmp_path / "cache").iterdir() if not path.name.endswith(".lock")] == []


def test_a_manifest_fetches_exactly_its_files(tiny_model, s3_env, tmp_path):
    model_dir, data_dir = tiny_model
    store = upload(model_dir, s3_env, "models", "tiny/v4")
    store.put("notes/README.md", b"not part of the model")
    manifest = folder_hashes(model_dir)
    folder = Path(
        resolve_model(s3_config(tmp_path, data_dir, s3_env, "s3://models/tiny/v4", manifest=manifest)).model.path
    )
    assert folder_hashes(folder) == manifest
    with pytest.raises(StartRefused, match=r"model.manifest: s3://models/tiny/v5 has no model.safetensors"):
        store5 = upload(model_dir, s3_env, "models", "tiny/v5")
        store5.delete(["model.safetensors"])
        resolve_model(s3_config(tmp_path, data_dir, s3_env, "s3://models/tiny/v5", manifest=manifest))


class HubMirror:
    """A Hugging Face Hub mirror in the Hub's URL layout, serving one repository's files at one commit:
    ``/api/models/{repo}/revision/{revision}`` and ``/{repo}/resolve/{commit}/{file}``. Records every path asked."""

    def __init__(self, repo: str, files: dict[str, bytes]):
        self.requests: list[str] = []
        mirror = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                mirror.requests.append(self.path)
                path = self.path.partition("?")[0]
                if path in (f"/api/models/{repo}/revision/main", f"/api/models/{repo}/revision/{COMMIT}"):
                    siblings = [{"rfilename": name, "size": len(data)} for name, data in files.items()]
                    body = json.dumps({"id": repo, "sha": COMMIT, "siblings": siblings}).encode()
                elif path.startswith(f"/{repo}/resolve/{COMMIT}/") and path.rpartition("/")[2] in files:
                    body = files[path.removeprefix(f"/{repo}/resolve/{COMMIT}/")]
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub(tiny_model) -> Iterator[HubMirror]:
    model_dir, _ = tiny_model
    mirror = HubMirror(
        "rlpipe/tiny-arith", {name: (model_dir / name).read_bytes() for name in folder_hashes(model_dir)}
    )
    yield mirror
    mirror.close()


def test_a_hub_repository_is_fetched_from_a_mirror_only_when_allowed_and_once(tiny_model, hub, tmp_path):
    model_dir, data_dir = tiny_model
    off = config(tmp_path, data_dir, "hf://rlpipe/tiny-arith", fetch={"hub_endpoint": hub.url})
    with pytest.raises(StartRefused, match=r"fetching from the Hub is off: set model\.fetch\.hub_download true"):
        resolve_model(off)
    assert hub.requests == []

    pinned = folder_sha256(model_dir)
    on = config(
        tmp_path,
        data_dir,
        "hf://rlpipe/tiny-arith",
        sha256=pinned,
        fetch={"hub_endpoint": hub.url, "hub_download": True},
    )
    folder = Path(resolve_model(on).model.path)
    assert folder_sha256(folder) == pinned
    assert load_model(folder).config.vocab_size == load_model(model_dir).config.vocab_size
    assert json.loads((folder / RECORD).read_text())["commit"] == COMMIT
    assert hub.requests[0] == "/api/models/rlpipe/tiny-arith/revision/main?blobs=true"
    assert sorted(hub.requests[1:]) == sorted(
        f"/rlpipe/tiny-arith/resolve/{COMMIT}/{name}" for name in folder_hashes(model_dir)
    )

    asked = len(hub.requests)
    assert Path(resolve_model(on).model.path) == folder
    assert len(hub.requests) == asked  # the second start asked the mirror nothing


def test_the_documented_shell_pipeline_prints_the_model_hash(tiny_model):
    model_dir, _ = tiny_model
    pipeline = r"find . -type f -not -path '*/.*' -printf '%P\n' | LC_ALL=C sort | xargs -d '\n' sha256sum | sha256sum"
    printed = subprocess.run(["bash", "-c", pipeline], cwd=model_dir, capture_output=True, text=True, check=True)
    assert printed.stdout.split()[0] == folder_sha256(model_dir)


def test_a_role_refuses_to_start_on_a_model_that_is_not_the_pinned_one(tmp_path):
    model, data = config_only(tmp_path)
    pinned = "f" * 64
    path = config_file(tmp_path, (model, data), model={"sha256": pinned})
    done = subprocess.run(
        [sys.executable, "-m", "services.reference", "--config", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert (
        f"reference: model.sha256: the model at {model} hashes to {folder_sha256(model)}, the config pins {pinned}"
        in done.stderr
    )


@pytest.mark.unit
def test_a_hub_cache_snapshot_is_used_in_place_without_a_request(tmp_path, config_only_model):
    model_dir, data_dir = config_only_model
    repo = tmp_path / "hub" / "models--org--name"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((model_dir / "config.json").read_text())
    cfg = config(tmp_path, data_dir, "hf://org/name", fetch={"hub_cache_dir": str(tmp_path / "hub")})
    assert Path(resolve_model(cfg).model.path) == snapshot
    pinned = config(
        tmp_path,
        data_dir,
        f"hf://org/name@{COMMIT}",
        sha256=folder_sha256(snapshot),
        fetch={"hub_cache_dir": str(tmp_path / "hub")},
    )
    assert Path(resolve_model(pinned).model.path) == snapshot
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


@pytest.mark.unit
@pytest.mark.parametrize(
    ("model", "error"),
    [
        ({"path": "ftp://host/model"}, "model.path"),
        ({"path": "s3://"}, "model.path"),
        ({"path": "hf://just-a-name"}, "model.path"),
        ({"sha256": "abc"}, "model.sha256"),
        ({"manifest": {"../config.json": "0" * 64}}, "model.manifest"),
        ({"manifest": {"config.json": "0" * 64}, "sha256": "0" * 64}, "give one of them"),
        ({"fetch": {"hub_endpoint": "hub.example.org"}}, "model.fetch.hub_endpoint"),
    ],
)
def test_a_bad_model_source_or_hash_fails_at_load_naming_the_field(tmp_path, config_only_model, model, error):
    model_dir, data_dir = config_only_model
    with pytest.raises(ConfigError, match=error):
        load_config(
            write_config(
                tmp_path / "c.yaml", model_dir, data_dir, tmp_path / "runs", model={"path": str(model_dir), **model}
            )
        )


@pytest.mark.unit
def test_a_source_listing_a_path_outside_the_folder_is_refused_and_dot_files_are_never_fetched():
    from services.common.config import ModelConfig
    from services.common.transport.model_source import ModelSource, wanted_files

    model = ModelConfig.model_construct(path="s3://b/p", sha256=None, manifest=None)
    source = ModelSource.parse("s3://b/p")
    listed = {"config.json": 2, "../../etc/cron.d/x": 9, ".cache/lock": 1, "sub/model.safetensors": 8}
    assert wanted_files(listed, model, source) == {"config.json": 2, "sub/model.safetensors": 8}
    with pytest.raises(StartRefused, match=r"lists '/etc/passwd', which is no file inside a model folder"):
        wanted_files({**listed, "/etc/passwd": 5}, model, source)
