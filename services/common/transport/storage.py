"""Object storage behind one interface: ``file://`` folders (the embedded default) and ``s3://`` buckets.

S3 goes through the ``minio`` SDK, so MinIO or any S3 endpoint works; credentials
come from ``RLPIPE_S3_ACCESS_KEY`` / ``RLPIPE_S3_SECRET_KEY`` and are never logged.
"""

from __future__ import annotations

import io
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol
from urllib.parse import unquote, urlparse

import certifi
import urllib3

from services.common.config import CheckpointConfig, S3Credentials
from services.common.files import write_atomically


class ObjectStore(Protocol):
    url: str

    def put(self, key: str, data: bytes, tags: Mapping[str, str] | None = None) -> None:
        """Store ``data`` under ``key``; ``tags`` become S3 object tags (what a bucket's lifecycle rule can select
        on) and mean nothing to a folder."""
        ...

    def get(self, key: str, limit: int | None = None) -> bytes:
        """The object's bytes, at most ``limit`` of them when given; FileNotFoundError when there is none."""
        ...

    def list(self, prefix: str) -> list[str]: ...

    def delete_prefix(self, prefix: str) -> None: ...

    def delete(self, keys: list[str]) -> None: ...


class FileStore:
    def __init__(self, root: Path):
        self.root = root
        self.url = root.as_uri()

    def _path(self, key: str) -> Path:
        """``root / key``, refused for a key that would name the root itself or anything outside it."""
        parts = Path(key).parts
        if not parts or Path(key).is_absolute() or ".." in parts:
            raise ValueError(f"object key {key!r} is not a relative path inside the store")
        return self.root / key

    def put(self, key: str, data: bytes, tags: Mapping[str, str] | None = None) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, data)

    def get(self, key: str, limit: int | None = None) -> bytes:
        path = self._path(key)
        if path.is_dir():  # an object store has no folders: a key that names one names no object
            raise FileNotFoundError(f"no object {key!r}: it is a folder of {self.url}")
        with path.open("rb") as file:
            return file.read(-1 if limit is None else limit)

    def list(self, prefix: str) -> list[str]:
        # Walk only the prefix's folder: the root may hold unrelated run files. Folders that vanish mid-walk
        # (a concurrent prune) are skipped, where Path.rglob would raise; any other error fails the listing.
        folder = self.root / self._inside(prefix).rpartition("/")[0]
        keys = (
            (Path(parent) / name).relative_to(self.root).as_posix()
            for parent, _, names in os.walk(folder, onerror=_unless_vanished)
            for name in names
            if not name.startswith(".tmp-")
        )
        return sorted(k for k in keys if k.startswith(prefix))

    def delete_prefix(self, prefix: str) -> None:
        refuse_whole_store(prefix)
        shutil.rmtree(self.root / self._inside(prefix), ignore_errors=True)

    @staticmethod
    def _inside(prefix: str) -> str:
        """``prefix``, refused when it would reach outside the root (absolute, or climbing with ``..``)."""
        if Path(prefix).is_absolute() or ".." in Path(prefix).parts:
            raise ValueError(f"prefix {prefix!r} is not a relative path inside the store")
        return prefix

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            self._path(key).unlink(missing_ok=True)


def refuse_whole_store(prefix: str) -> None:
    """Deleting by an empty prefix would empty the store (every run's checkpoints, and on a file store whatever
    else shares its root folder): no caller means that, so it is refused rather than done."""
    if not prefix.strip("/"):
        raise ValueError("an empty prefix names the whole store; delete_prefix refuses it")


def _unless_vanished(error: OSError) -> None:
    """A folder that cannot be read fails the listing (unreadable is not empty); one that is gone holds nothing."""
    if not isinstance(error, FileNotFoundError):
        raise error


class S3Store:
    def __init__(
        self,
        bucket: str,
        prefix: str,
        cfg: CheckpointConfig,
        credentials: S3Credentials | None = None,
        read_timeout_s: float = 60.0,
    ):
        """``credentials``: RLPIPE_S3_* (``S3Credentials()``) unless given."""
        from minio import Minio

        if not cfg.s3_endpoint:
            raise ValueError("checkpoint.s3_endpoint must be set (host:port) for s3:// store URLs")
        creds = credentials or S3Credentials()
        # Fail fast (the SDK's default waits minutes on a dead endpoint); the checkpoint store retries with backoff.
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=5, read=read_timeout_s),
            retries=urllib3.Retry(total=1, backoff_factor=0.2, status_forcelist=[500, 502, 503, 504]),
            ca_certs=str(cfg.s3_ca_file) if cfg.s3_ca_file else certifi.where(),
        )
        self.client = Minio(
            cfg.s3_endpoint,
            access_key=creds.access_key,
            secret_key=creds.secret_key,
            secure=cfg.s3_secure,
            region=cfg.s3_region,
            http_client=http,
        )
        self.endpoint = cfg.s3_endpoint
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.part_size = cfg.s3_part_mib << 20
        self.parallel_uploads = cfg.s3_parallel_uploads
        self.object_tags = cfg.s3_object_tags
        self.url = f"s3://{bucket}/{self.prefix}"
        # The bucket is made by the first put (put recreates a missing one): opening a store never needs the
        # endpoint, so a trainer starts, and a resume waits for an unreachable store instead of crashing.

    def _ensure_bucket(self) -> None:
        if not self.client.bucket_exists(self.bucket):
            self.client.make_bucket(self.bucket)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, data: bytes, tags: Mapping[str, str] | None = None) -> None:
        from minio.error import S3Error

        try:
            self._upload(key, data, tags)
        except S3Error as error:
            if error.code != "NoSuchBucket":
                raise
            # An endpoint that came back empty (or a bucket removed by hand): recreate and write again.
            self._ensure_bucket()
            self._upload(key, data, tags)

    def _upload(self, key: str, data: bytes, tags: Mapping[str, str] | None) -> None:
        from minio.commonconfig import Tags

        object_tags = None
        if tags and self.object_tags:
            object_tags = Tags(for_object=True)
            object_tags.update(tags)
        # Above part_size the SDK sends a multipart upload, parallel_uploads parts at a time.
        self.client.put_object(
            self.bucket,
            self._key(key),
            io.BytesIO(data),
            len(data),
            part_size=self.part_size,
            num_parallel_uploads=self.parallel_uploads,
            tags=object_tags,
        )

    def get(self, key: str, limit: int | None = None) -> bytes:
        from minio.error import S3Error

        try:
            response = self.client.get_object(self.bucket, self._key(key))
        except S3Error as error:
            if error.code in ("NoSuchKey", "NoSuchBucket"):  # the same error a missing file gives
                raise FileNotFoundError(f"{self.url.rstrip('/')}/{key}") from error
            raise
        try:
            return response.read() if limit is None else response.read(limit)  # the rest is left unread, closed
        finally:
            response.close()
            response.release_conn()

    def download(self, key: str, path: Path) -> int:
        """Stream the object to ``path`` (never whole in memory: a model's weights can outsize it); its byte count.
        FileNotFoundError when there is none."""
        from minio.error import S3Error

        try:
            response = self.client.get_object(self.bucket, self._key(key))
        except S3Error as error:
            if error.code in ("NoSuchKey", "NoSuchBucket"):
                raise FileNotFoundError(f"{self.url.rstrip('/')}/{key}") from error
            raise
        written = 0
        try:
            with path.open("wb") as file:
                for chunk in response.stream(1 << 20):
                    file.write(chunk)
                    written += len(chunk)
        finally:
            response.close()
            response.release_conn()
        return written

    def sizes(self, prefix: str) -> dict[str, int]:
        """Each object under ``prefix`` (keys relative to the store) with its size in bytes, as one listing."""
        strip = len(self._key(""))
        objects = self.client.list_objects(self.bucket, prefix=self._key(prefix), recursive=True)
        # (a listed object always has its name)
        return {obj.object_name[strip:]: int(obj.size or 0) for obj in objects if obj.object_name is not None}

    def list(self, prefix: str) -> list[str]:
        from minio.error import S3Error

        strip = len(self._key(""))
        try:
            return sorted(
                obj.object_name[strip:]
                for obj in self.client.list_objects(self.bucket, prefix=self._key(prefix), recursive=True)
                if obj.object_name is not None  # (a listed object always has its name)
            )
        except S3Error as error:
            if error.code == "NoSuchBucket":  # an endpoint that came back empty holds nothing; put() recreates it
                return []
            raise

    def delete_prefix(self, prefix: str) -> None:
        refuse_whole_store(prefix)
        self.delete(self.list(prefix))

    def delete(self, keys: list[str]) -> None:
        from minio.deleteobjects import DeleteObject

        for error in self.client.remove_objects(self.bucket, [DeleteObject(self._key(key)) for key in keys]):
            raise OSError(f"could not delete {error.name}: {error.code} {error.message}")


def open_store(url: str, cfg: CheckpointConfig) -> ObjectStore:
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return FileStore(Path(unquote(parsed.path)))
    if parsed.scheme == "s3":
        return S3Store(parsed.netloc, parsed.path, cfg)
    raise ValueError(f"unsupported store URL {url!r}: use file:// or s3://")
