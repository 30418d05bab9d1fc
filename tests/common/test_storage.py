"""The file store keeps every key inside its root and reads no more than it is asked to."""

from __future__ import annotations

import pytest

from services.common.config import CheckpointConfig, S3Credentials
from services.common.transport.storage import FileStore, S3Store

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("key", ["", "/etc/hostname", "../outside", "run/claims/../../../outside"])
def test_a_key_naming_the_root_or_anything_outside_it_is_refused_by_every_operation(tmp_path, key):
    store = FileStore(tmp_path / "store")
    (tmp_path / "store" / "run" / "claims").mkdir(parents=True)
    (tmp_path / "outside").write_bytes(b"not the store's")
    with pytest.raises(ValueError, match="is not a relative path inside the store"):
        store.get(key)
    with pytest.raises(ValueError, match="is not a relative path inside the store"):
        store.put(key, b"x")
    with pytest.raises(ValueError, match="is not a relative path inside the store"):
        store.delete([key])
    assert (tmp_path / "outside").read_bytes() == b"not the store's"


@pytest.mark.parametrize("prefix", ["/etc/", "../outside", "run/../../outside/"])
def test_a_prefix_reaching_outside_the_root_is_refused_by_listing_and_deleting(tmp_path, prefix):
    store = FileStore(tmp_path / "store")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "kept").write_bytes(b"not the store's")
    with pytest.raises(ValueError, match="is not a relative path inside the store"):
        store.list(prefix)
    with pytest.raises(ValueError, match="is not a relative path inside the store"):
        store.delete_prefix(prefix)
    assert (tmp_path / "outside" / "kept").read_bytes() == b"not the store's"


@pytest.mark.parametrize("prefix", ["", "/"])
def test_deleting_the_empty_prefix_is_refused_and_the_store_is_kept(tmp_path, prefix):
    store = FileStore(tmp_path / "store")
    store.put("run/step-1/weights", b"w")
    with pytest.raises(ValueError, match="names the whole store"):
        store.delete_prefix(prefix)
    assert store.list("run/") == ["run/step-1/weights"]


def test_a_key_naming_a_folder_is_a_missing_object_not_a_store_failure(tmp_path):
    store = FileStore(tmp_path)
    store.put("run/claims/rollouts/g1", b"body")
    with pytest.raises(FileNotFoundError, match="it is a folder"):
        store.get("run/claims/rollouts")


def test_a_limited_get_reads_at_most_the_limit(tmp_path):
    store = FileStore(tmp_path)
    store.put("run/claims/rollouts/g1", b"0123456789")
    assert store.get("run/claims/rollouts/g1", limit=4) == b"0123"
    assert store.get("run/claims/rollouts/g1", limit=11) == b"0123456789"
    assert store.get("run/claims/rollouts/g1") == b"0123456789"


class _RefusingDeletes:
    """An S3 client whose multi-object delete refuses every key, as S3 answers a delete it does not allow."""

    def remove_objects(self, bucket, objects):
        from minio.deleteobjects import DeleteError

        return [DeleteError("AccessDenied", "Access Denied", obj.name, None) for obj in objects]


def test_an_s3_delete_the_store_refuses_is_an_oserror_naming_the_key():
    store = S3Store("bucket", "run", CheckpointConfig(s3_endpoint="127.0.0.1:9"), S3Credentials())
    store.client = _RefusingDeletes()
    with pytest.raises(OSError, match=r"could not delete run/claims/a: AccessDenied Access Denied"):
        store.delete(["claims/a"])
