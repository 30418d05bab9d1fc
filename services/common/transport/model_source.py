"""Where a run's model comes from, and whether it is the model the config pins.

``model.path`` names a local folder, an S3 prefix (``s3://bucket/prefix/``) or a Hugging Face repository
(``hf://org/name@revision``). ``resolve_model`` turns the config of any of them into one whose ``model.path`` is a
local folder, and every role calls it at start (``run_service``), as do ``rlpipe run`` before its checks and the
CLI commands that read the model:

- A local folder is used as it is.
- An S3 prefix is listed and every object under it (or, with ``model.manifest``, exactly the listed files) is
  streamed into a temporary folder inside ``model.fetch.cache_dir``, checked (sizes against the listing, hashes
  against the config), and renamed into place; a later start finds it there and fetches nothing.
- A repository is looked up first in ``model.fetch.hub_cache_dir`` (a Hugging Face hub cache, used in place), then
  in ``cache_dir``; only with ``model.fetch.hub_download`` is it fetched, from ``model.fetch.hub_endpoint`` (the Hub
  or a mirror of it) over the Hub's URL layout: ``/api/models/{repo}/revision/{revision}`` lists the files and
  their commit, ``/{repo}/resolve/{commit}/{file}`` serves each. Fetched with plain HTTP rather than
  huggingface_hub's downloader: that one obeys the process-wide ``HF_HUB_OFFLINE`` the images set (so that
  transformers never reaches out), and turning it off for one fetch would turn it off for the whole process.

One fetch per source at a time on a machine (a lock file beside the cache folder): roles that start together wait
for the first and then reuse its folder. A fetch that fails leaves nothing in the cache.

``model.sha256`` (the folder's hash: sha256 of its ``sha256sum``-style lines, ``folder_sha256``) or
``model.manifest`` ({file: sha256}) is checked on every start against the folder in use, fetched or not; a
mismatch refuses the start (``StartRefused``) naming the field and both hashes. The hash is what ``rlpipe doctor``
prints as ``model hash``, and what this shell pipeline prints in the folder::

    find . -type f -not -path '*/.*' -printf '%P\\n' | LC_ALL=C sort | xargs -d '\\n' sha256sum | sha256sum
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

import urllib3

from services.common.config import ModelConfig, ModelCredentials, RunConfig, S3Credentials
from services.common.observe.events import Event
from services.common.observe.logs import log_event
from services.common.refusal import StartRefused

if TYPE_CHECKING:
    from services.common.transport.storage import S3Store

log = logging.getLogger(__name__)
RECORD = ".rlpipe-source.json"  # in a fetched folder: where it came from and each file's size and hash
COMMIT = re.compile(r"^[0-9a-f]{40}$")


class ModelFetchFailed(RuntimeError):
    """The model's source could not be read (unreachable, refused the credentials): a restart may succeed."""


# ---------------------------------------------------------------- hashes


def folder_files(folder: Path) -> list[str]:
    """The folder's files as relative POSIX paths in byte order, following symlinks (a hub cache's snapshot is
    links to its blobs); a path with any part starting with "." is left out (this module's record, lock and
    temporary files, a downloader's own ``.cache``)."""
    found = []
    for parent, dirs, names in os.walk(folder, followlinks=True):
        dirs[:] = [name for name in dirs if not name.startswith(".")]
        for name in names:
            path = Path(parent) / name
            if not name.startswith(".") and path.is_file():
                found.append(path.relative_to(folder).as_posix())
    return sorted(found)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def folder_hashes(folder: Path) -> dict[str, str]:
    """{relative file: sha256} of every file ``folder_files`` lists."""
    return {name: file_sha256(folder / name) for name in folder_files(folder)}


def manifest_sha256(hashes: Mapping[str, str]) -> str:
    """sha256 of the lines ``"<sha256>  <file>\\n"`` in byte order of the names: ``sha256sum``'s output, hashed."""
    lines = "".join(f"{hashes[name]}  {name}\n" for name in sorted(hashes))
    return hashlib.sha256(lines.encode()).hexdigest()


def folder_sha256(folder: Path) -> str:
    """The folder's content hash, as ``model.sha256`` pins it."""
    return manifest_sha256(folder_hashes(folder))


def verify_model(folder: Path, model: ModelConfig, origin: str = "") -> None:
    """Raise StartRefused, naming the field and both hashes, unless ``folder`` is what ``model.sha256`` or
    ``model.manifest`` pins (nothing to check when neither is set). ``origin``: where the folder came from."""
    if model.sha256 is None and model.manifest is None:
        return
    where = f"the model at {folder}" + (f" (from {origin})" if origin else "")
    hashes = folder_hashes(folder)
    if model.sha256 is not None:
        found = manifest_sha256(hashes)
        if found != model.sha256:
            raise StartRefused(
                f"model.sha256: {where} hashes to {found}, the config pins {model.sha256}; the files differ from "
                "the ones pinned (a corrupted or replaced file, or another model). Fix the folder"
                + (" (delete it to fetch it again)" if origin else "")
                + ", or pin the hash `rlpipe doctor` prints once you trust it"
            )
        return
    assert model.manifest is not None
    problems = [
        f"{name} hashes to {hashes[name]}, the manifest pins {digest}"
        for name, digest in sorted(model.manifest.items())
        if name in hashes and hashes[name] != digest
    ]
    problems += [f"{name} is missing" for name in sorted(model.manifest.keys() - hashes.keys())]
    problems += [f"{name} is not in the manifest" for name in sorted(hashes.keys() - model.manifest.keys())]
    if problems:
        shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
        raise StartRefused(f"model.manifest: {where} does not match: {shown}")


# ---------------------------------------------------------------- sources


@dataclass(frozen=True)
class ModelSource:
    """A parsed ``model.path`` URL: ``s3://bucket/prefix`` or ``hf://repo@revision``."""

    url: str
    scheme: str  # s3 | hf
    location: str  # the bucket (s3) or the repository org/name (hf)
    path: str  # the prefix inside the bucket (s3) or the revision (hf)

    @classmethod
    def parse(cls, url: str) -> ModelSource:
        scheme, _, rest = url.partition("://")
        if scheme == "s3":
            bucket, _, prefix = rest.partition("/")
            return cls(url, scheme, bucket, prefix.strip("/"))
        repo, _, revision = rest.partition("@")
        return cls(url, scheme, repo, revision or "main")

    @property
    def cache_name(self) -> str:
        """This source's folder in the cache: readable, and unique by a hash of the whole URL."""
        readable = re.sub(r"[^A-Za-z0-9_.-]+", "--", f"{self.scheme}-{self.location}-{self.path}").strip("-.")
        return f"{readable[:80]}-{hashlib.sha256(self.url.encode()).hexdigest()[:12]}"


def resolve_model(cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``model.path`` a local folder holding the model (fetched into the cache if need be), checked
    against ``model.sha256`` / ``model.manifest``. StartRefused for a mismatch, for a source the config does not
    allow fetching or that lacks the model; ModelFetchFailed when the source cannot be read."""
    model = cfg.model
    if not isinstance(model.path, str):
        verify_model(model.path, model)
        return cfg
    source = ModelSource.parse(model.path)
    folder = hub_cache_snapshot(source, model.fetch.hub_cache_dir) if source.scheme == "hf" else None
    if folder is None:
        folder = cached_or_fetched(source, cfg)
    verify_model(folder, model, source.url)
    return cfg.model_copy(update={"model": model.model_copy(update={"path": folder})})


def local_model_path(cfg: RunConfig) -> Path | None:
    """The folder ``model.path`` names or was fetched to, without fetching anything: None while a URL's model is
    in neither the hub cache nor the cache folder."""
    model = cfg.model
    if not isinstance(model.path, str):
        return model.path
    source = ModelSource.parse(model.path)
    found = hub_cache_snapshot(source, model.fetch.hub_cache_dir) if source.scheme == "hf" else None
    cached = model.fetch.cache_dir / source.cache_name
    return found or (cached if cached.is_dir() else None)


def hub_cache_snapshot(source: ModelSource, hub_cache: Path | None) -> Path | None:
    """The snapshot folder of ``source``'s revision in a Hugging Face hub cache, if it holds one with a config."""
    if hub_cache is None:
        return None
    repo_folder = hub_cache / f"models--{source.location.replace('/', '--')}"
    commit = source.path
    if not COMMIT.match(commit):
        ref = repo_folder / "refs" / commit
        if not ref.is_file():
            return None
        commit = ref.read_text().strip()
    snapshot = repo_folder / "snapshots" / commit
    return snapshot if (snapshot / "config.json").is_file() else None


@contextlib.contextmanager
def _fetch_lock(cache_dir: Path, name: str) -> Iterator[None]:
    """Held while one process fetches ``name``: the others wait, then find the folder it renamed into place."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def cached_or_fetched(source: ModelSource, cfg: RunConfig) -> Path:
    """``source``'s folder in ``model.fetch.cache_dir``, fetched first when it is not there yet."""
    fetch = cfg.model.fetch
    final = fetch.cache_dir / source.cache_name
    with _fetch_lock(fetch.cache_dir, source.cache_name):
        if final.is_dir():
            check_record(final, source)
            return final
        if source.scheme == "hf" and not fetch.hub_download:
            where = f"model.fetch.hub_cache_dir ({fetch.hub_cache_dir})" if fetch.hub_cache_dir else "no hub cache"
            raise StartRefused(
                f"model.path: {source.url} is in {where} and not in model.fetch.cache_dir ({fetch.cache_dir}), and "
                "fetching from the Hub is off: set model.fetch.hub_download true (with model.fetch.hub_endpoint, "
                "the Hub or a mirror), or put the model in one of those folders"
            )
        staging = Path(tempfile.mkdtemp(prefix=f".tmp-{source.cache_name}-", dir=fetch.cache_dir))
        try:
            started = time.monotonic()
            if source.scheme == "s3":
                files, detail = fetch_s3(source, cfg, staging)
            else:
                files, detail = fetch_hub(source, cfg, staging)
            if not (staging / "config.json").is_file():
                raise StartRefused(f"model.path: {source.url} holds no config.json: it is not a Hugging Face model")
            # Checked before the rename: a folder that lands in the cache is one the config accepts.
            verify_model(staging, cfg.model, source.url)
            write_record(staging, source, files, detail)
            os.rename(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        log_event(
            log,
            Event.MODEL_FETCHED,
            source=source.url,
            folder=str(final),
            files=len(files),
            bytes=sum(files.values()),
            seconds=round(time.monotonic() - started, 2),
        )
        return final


def write_record(folder: Path, source: ModelSource, files: Mapping[str, int], detail: Mapping[str, str]) -> None:
    record = {"source": source.url, **detail, "files": dict(sorted(files.items())), "fetched": time.time()}
    (folder / RECORD).write_text(json.dumps(record, indent=1))


def check_record(folder: Path, source: ModelSource) -> None:
    """A cached folder is the one fetched from ``source`` and still holds every file at its fetched size
    (a cheap look: the hashes are ``verify_model``'s, and only where the config pins them)."""
    try:
        record = json.loads((folder / RECORD).read_text())
        files = {str(name): int(size) for name, size in record["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise StartRefused(
            f"model.path: the cached {folder} has no readable {RECORD} ({error}); delete the folder to fetch "
            f"{source.url} again"
        ) from None
    if record.get("source") != source.url:
        raise StartRefused(f"model.path: the cached {folder} came from {record.get('source')!r}, not {source.url}")
    damaged = [
        name for name, size in files.items() if not (folder / name).is_file() or (folder / name).stat().st_size != size
    ]
    if damaged:
        raise StartRefused(
            f"model.path: the cached {folder} lost or changed {', '.join(damaged[:5])} since it was fetched from "
            f"{source.url}; delete the folder to fetch it again"
        )


def wanted_files(listed: Mapping[str, int], model: ModelConfig, source: ModelSource) -> dict[str, int]:
    """Of the source's files (name -> size), the ones to fetch: the manifest's, else every one but dot-files (a
    ``..`` among them: nothing is written outside the folder). A name with an empty part (``/etc/x``, ``a//b``)
    is refused: joined to the folder it would name a place outside it."""
    strange = sorted(name for name in listed if "" in name.split("/"))
    if strange:
        raise StartRefused(f"model.path: {source.url} lists {strange[0]!r}, which is no file inside a model folder")
    if model.manifest is None:
        return {name: size for name, size in listed.items() if not any(p.startswith(".") for p in name.split("/"))}
    missing = sorted(model.manifest.keys() - listed.keys())
    if missing:
        raise StartRefused(f"model.manifest: {source.url} has no {', '.join(missing[:5])}")
    return {name: listed[name] for name in model.manifest}


def model_store(source: ModelSource, cfg: RunConfig) -> S3Store:
    """The S3 prefix ``source`` names, with model.fetch's endpoint and credentials (else the checkpoint store's)."""
    from services.common.transport.storage import S3Store

    fetch = cfg.model.fetch
    store_cfg = cfg.checkpoint.model_copy(
        update={
            "s3_endpoint": fetch.s3_endpoint or cfg.checkpoint.s3_endpoint,
            "s3_secure": cfg.checkpoint.s3_secure if fetch.s3_secure is None else fetch.s3_secure,
        }
    )
    if not store_cfg.s3_endpoint:
        raise StartRefused(
            f"model.path: {source.url} needs an S3 endpoint: set model.fetch.s3_endpoint or checkpoint.s3_endpoint"
        )
    own = ModelCredentials()
    credentials = (
        S3Credentials(access_key=own.s3_access_key, secret_key=own.s3_secret_key) if own.s3_access_key else None
    )
    return S3Store(source.location, source.path, store_cfg, credentials, read_timeout_s=fetch.timeout_s)


def s3_listing(source: ModelSource, store: S3Store) -> dict[str, int]:
    """{file: size} of every object under the prefix; StartRefused when there is none."""
    try:
        listed = {name: size for name, size in store.sizes("").items() if name and not name.endswith("/")}
    except Exception as error:  # the SDK's and urllib3's many failure types
        raise ModelFetchFailed(f"cannot list {source.url}: {error!r}"[:500]) from None
    if not listed:
        raise StartRefused(f"model.path: {source.url} holds no object")
    return listed


def fetch_s3(source: ModelSource, cfg: RunConfig, into: Path) -> tuple[dict[str, int], dict[str, str]]:
    """Every object under the prefix (or the manifest's) into ``into``; {file: size} and what to record."""
    store = model_store(source, cfg)
    files = wanted_files(s3_listing(source, store), cfg.model, source)
    for name, size in files.items():
        target = into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            got = store.download(name, target)
        except Exception as error:
            raise ModelFetchFailed(f"cannot read {source.url.rstrip('/')}/{name}: {error!r}"[:500]) from None
        if got != size:
            raise ModelFetchFailed(f"{source.url.rstrip('/')}/{name}: {got} bytes read, the listing says {size}")
    return files, {"endpoint": store.endpoint}


@dataclass(frozen=True)
class HubListing:
    """A repository at a revision as the Hub's API lists it: the commit, and each file's entry (size, lfs)."""

    commit: str
    files: dict[str, dict]
    headers: dict[str, str]  # what every request to the endpoint carries (the token)


def hub_client(cfg: RunConfig) -> urllib3.PoolManager:
    # urllib3 drops Authorization when a redirect leaves the host (the Hub sends large files to a CDN).
    return urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=10, read=cfg.model.fetch.timeout_s),
        retries=urllib3.Retry(total=3, backoff_factor=0.5, status_forcelist=[500, 502, 503, 504]),
    )


def hub_listing(source: ModelSource, cfg: RunConfig, http: urllib3.PoolManager) -> HubListing:
    """``/api/models/{repo}/revision/{revision}`` of ``model.fetch.hub_endpoint``."""
    endpoint = cfg.model.fetch.hub_endpoint
    token = ModelCredentials().hub_token
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    url = f"{endpoint}/api/models/{quote(source.location, safe='/')}/revision/{quote(source.path, safe='')}?blobs=true"
    try:
        answer = http.request("GET", url, headers=headers)
    except urllib3.exceptions.HTTPError as error:
        raise ModelFetchFailed(f"cannot reach {endpoint} for {source.url}: {error!r}"[:500]) from None
    if answer.status in (401, 403, 404):
        raise StartRefused(
            f"model.path: {endpoint} answers {answer.status} for {source.location} at {source.path} "
            "(no such repository or revision, or it needs RLPIPE_MODEL_HUB_TOKEN)"
        )
    if answer.status != 200:
        raise ModelFetchFailed(f"{url} answered {answer.status}")
    try:
        info = json.loads(answer.data)
        return HubListing(
            str(info["sha"]), {str(entry["rfilename"]): dict(entry) for entry in info["siblings"]}, headers
        )
    except (ValueError, KeyError, TypeError) as error:
        raise ModelFetchFailed(f"{url} is not a Hub repository listing: {error!r}"[:300]) from None


def fetch_hub(source: ModelSource, cfg: RunConfig, into: Path) -> tuple[dict[str, int], dict[str, str]]:
    """The repository's files at the revision's commit from ``model.fetch.hub_endpoint``, into ``into``."""
    endpoint = cfg.model.fetch.hub_endpoint
    http = hub_client(cfg)
    listing = hub_listing(source, cfg, http)
    sizes = {name: int(entry.get("size") or -1) for name, entry in listing.files.items()}
    files = wanted_files(sizes, cfg.model, source)
    got_sizes = {}
    for name in files:
        url = f"{endpoint}/{quote(source.location, safe='/')}/resolve/{listing.commit}/{quote(name)}"
        target = into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        got_sizes[name] = _download(http, url, listing.headers, target)
        lfs = listing.files[name].get("lfs") or {}
        if lfs.get("sha256") and file_sha256(target) != lfs["sha256"]:  # the Hub's own hash of a large file
            raise ModelFetchFailed(f"{url}: the file's sha256 is not the {lfs['sha256']} the listing gives")
        if files[name] >= 0 and got_sizes[name] != files[name]:
            raise ModelFetchFailed(f"{url}: {got_sizes[name]} bytes read, the listing says {files[name]}")
    return got_sizes, {"endpoint": endpoint, "commit": listing.commit}


def _download(http: urllib3.PoolManager, url: str, headers: Mapping[str, str], target: Path) -> int:
    """``url``'s body streamed into ``target``; its byte count."""
    try:
        response = http.request("GET", url, headers=dict(headers), preload_content=False)
    except urllib3.exceptions.HTTPError as error:
        raise ModelFetchFailed(f"cannot fetch {url}: {error!r}"[:500]) from None
    try:
        if response.status != 200:
            raise ModelFetchFailed(f"{url} answered {response.status}")
        written = 0
        with target.open("wb") as file:
            for chunk in response.stream(1 << 20):
                file.write(chunk)
                written += len(chunk)
        return written
    finally:
        response.release_conn()
