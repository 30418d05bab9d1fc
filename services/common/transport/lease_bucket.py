"""The key-value bucket ``RLPIPE_<run>_LEASE`` where the run's one trainer holds its lease.

The bucket's name and opening live here, with the other run-state buckets, so that NATS permissions
(``nats_auth``) can grant it to the trainer alone; the lease itself is ``services/trainer/lease.py``.
"""

from __future__ import annotations

from typing import Any

from nats.js import api
from nats.js.errors import BucketNotFoundError


def bucket_name(run_id: str) -> str:
    return f"RLPIPE_{run_id}_LEASE"


async def open_bucket(js: Any, run_id: str, storage: str, replicas: int) -> Any:
    """The run's lease bucket, created when missing (only the trainer opens it)."""
    name = bucket_name(run_id)
    try:
        return await js.key_value(name)
    except BucketNotFoundError:
        kind = api.StorageType.FILE if storage == "file" else api.StorageType.MEMORY
        return await js.create_key_value(bucket=name, history=1, storage=kind, replicas=replicas)
