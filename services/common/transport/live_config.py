"""Live configuration: versioned overrides in a JetStream key-value bucket.

The bucket ``RLPIPE_<run>_CONFIG`` keeps every version of the key ``current`` (up to
the server's limit of 64 revisions). A version holds the cumulative dotted overrides
on top of the file+environment config, with who changed what and when:

    {"version": 3, "author": "alice", "time": ..., "overrides": {"train.learning_rate": 5e-5},
     "changes": [{"key": "train.learning_rate", "old": 1e-4, "new": 5e-5, "live": true}]}

Every service reads the newest version at start (so restart-only fields take effect
then) and polls it between batches or steps, applying the live fields (``Live[...]`` in the
config models; ``services.common.config.is_live``).
Polling with a direct get, rather than a push watcher, survives broker restarts
without any subscription to re-create. Only the trainer creates the bucket and writes
it (through its admin API); every other role waits for it and reads.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import nats
from nats.js import api
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError, NoKeysError

from services.common.config import (
    ConfigError,
    RunConfig,
    apply_overrides,
    is_live,
    redact,
    refuse_fixed_changes,
    refuse_unsafe_live_change,
)
from services.common.config import parse_value as parse_value  # the admin's and the command line's one reading
from services.common.observe.events import Event
from services.common.observe.logs import log_event
from services.common.transport.nats_connect import await_run_state, connect_options, creates_run_state

log = logging.getLogger(__name__)
KEY = "current"
CONTROL_KEY = "control"
HISTORY = 64  # the most revisions JetStream keeps per key


class HoldSource(StrEnum):
    """Who held a run (paused or stopped it): what ``rlpipe run --resume`` does with the hold depends on it."""

    OPERATOR = "operator"  # rlpipe pause or stop: a restart the operator asks for clears it
    START = "start"  # started held (rlpipe run --paused, rlpipe verify's smoke run): cleared likewise
    ALERT = "alert"  # an alert rule's pause or stop, or the trainer holding itself for a failure: it stays


@dataclass(frozen=True)
class Hold:
    """The run's operator state under ``CONTROL_KEY``: paused (a stop is a hold too), why, and by whom."""

    paused: bool = False
    reason: str = ""
    by: HoldSource | None = None  # None: a record written before holds named their source

    @property
    def outlives_resume(self) -> bool:
        """Only an operator who looked may lift a hold the run's own watch set: ``--resume`` leaves it."""
        return self.paused and self.by == HoldSource.ALERT

    def record(self) -> dict[str, Any]:
        return {"paused": self.paused, "reason": self.reason, **({"by": str(self.by)} if self.by else {})}

    @classmethod
    def of_record(cls, record: dict[str, Any]) -> Hold:
        by = record.get("by")
        known = by in {source.value for source in HoldSource}
        return cls(bool(record.get("paused")), str(record.get("reason", "")), HoldSource(by) if known else None)


def bucket_name(run_id: str) -> str:
    return f"RLPIPE_{run_id}_CONFIG"


@dataclass
class ConfigChange:
    key: str
    old: Any
    new: Any
    live: bool


@dataclass
class ConfigVersion:
    version: int = 0
    author: str = ""
    time: float = 0.0
    overrides: dict[str, Any] = field(default_factory=dict)
    changes: list[ConfigChange] = field(default_factory=list)

    def encode(self) -> bytes:
        return json.dumps(
            {
                "version": self.version,
                "author": self.author,
                "time": self.time,
                "overrides": self.overrides,
                "changes": [vars(change) for change in self.changes],
            }
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> ConfigVersion:
        raw = json.loads(data)
        return cls(
            raw["version"], raw["author"], raw["time"], raw["overrides"], [ConfigChange(**c) for c in raw["changes"]]
        )


def _value_at(cfg: RunConfig, key: str) -> Any:
    node: Any = cfg.model_dump(mode="json", by_alias=True)
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            # Names and aliases differ only for train.kl.in/placement.
            part = {"placement": "in"}.get(part, part)
            if not isinstance(node, dict) or part not in node:
                return None
        node = node[part]
    return node


class LiveConfig:
    """The config in force for one service: base (file + environment) plus the newest stored overrides."""

    def __init__(self, base: RunConfig, js: Any, poll_s: float = 1.0, creates_bucket: bool = True):
        self.base = base
        self.creates_bucket = creates_bucket  # the trainer's; any other role waits for it
        self.cfg = base
        self.js = js
        self.poll_s = poll_s
        self.current = ConfigVersion()
        self.started: RunConfig | None = (
            None  # base + every change stored before start(): what restart-only fields stay at
        )
        self.kv: Any = None
        self._polled = 0.0

    @property
    def version(self) -> int:
        return self.current.version

    async def start(self) -> LiveConfig:
        """Open (or create, or wait for) the bucket and take the newest version; a bad stored version is refused
        loudly."""
        name = bucket_name(self.base.run_id)
        if not self.creates_bucket:
            self.kv = await await_run_state(f"bucket {name}", lambda: self.js.key_value(name), BucketNotFoundError)
        else:
            self.kv = await self._open_or_create(name)
        await self.refresh(force=True)
        self.started = self.cfg
        return self

    async def _open_or_create(self, name: str) -> Any:
        try:
            return await self.js.key_value(name)
        except BucketNotFoundError:
            storage = api.StorageType.FILE if self.base.nats.storage == "file" else api.StorageType.MEMORY
            return await self.js.create_key_value(
                bucket=name, history=HISTORY, storage=storage, replicas=self.base.nats.stream_replicas
            )

    async def _latest_entry(self) -> tuple[ConfigVersion, int | None]:
        try:
            entry = await self.kv.get(KEY)
        except KeyNotFoundError:
            return ConfigVersion(), None
        return ConfigVersion.decode(entry.value), entry.revision

    async def refresh(self, force: bool = False) -> list[str]:
        """Take a newer stored version if there is one; returns the fields that changed (empty if none).

        Once started, only live fields change; a restart field keeps its start value in ``cfg``.

        Rate-limited to one read per ``poll_s`` unless ``force``; a read that fails leaves the config as it is.
        """
        now = time.monotonic()
        if not force and now - self._polled < self.poll_s:
            return []
        self._polled = now
        try:
            latest, _ = await self._latest_entry()
        except Exception as error:  # broker away: keep what is in force, try again later
            log_event(log, Event.CONFIG_POLL_FAILED, level=logging.WARNING, error=repr(error)[:200])
            return []
        if latest.version == self.current.version:
            return []
        # At start every stored change applies; once running, only the live fields do.
        overrides = (
            latest.overrides if self.started is None else {k: v for k, v in latest.overrides.items() if is_live(k)}
        )
        try:
            cfg = apply_overrides(self.started or self.base, overrides)
        except ConfigError as error:
            log_event(log, Event.CONFIG_REJECTED, level=logging.ERROR, config_version=latest.version, error=str(error))
            return []
        changed = [key for key in overrides if _value_at(cfg, key) != _value_at(self.cfg, key)]
        self.cfg, self.current = cfg, latest
        log_event(log, Event.CONFIG_APPLIED, config_version=latest.version, author=latest.author, changed=changed)
        return changed

    async def propose(self, settings: dict[str, Any], author: str, dry_run: bool = False) -> ConfigVersion:
        """Validate ``settings`` on top of the newest version and store them as the next one.

        Raises ConfigError naming the field and reason; nothing is stored then.
        """
        latest, revision = await self._latest_entry()
        current = apply_overrides(self.base, latest.overrides)
        refuse_unsafe_live_change(self.base, current, settings)  # before validating them: that imports plugins
        proposed = apply_overrides(self.base, latest.overrides | settings)
        refuse_fixed_changes(current, proposed)  # what the raw settings hid: a section given with its defaults
        changes = [  # kept for history, logs and events, so secrets are hidden; the overrides hold the values
            ConfigChange(key, redact(key, _value_at(current, key)), redact(key, _value_at(proposed, key)), is_live(key))
            for key in settings
            if _value_at(current, key) != _value_at(proposed, key)
        ]
        version = ConfigVersion(
            latest.version + 1, author or "unknown", time.time(), latest.overrides | settings, changes
        )
        if dry_run or not changes:
            return version if changes else latest
        # Compare-and-set on the revision: two operators cannot both write version N.
        try:
            if revision is None:
                await self.kv.create(KEY, version.encode())
            else:
                await self.kv.update(KEY, version.encode(), last=revision)
        except KeyWrongLastSequenceError:
            raise ConfigError(
                f"config version {latest.version + 1} was stored by someone else meanwhile; look and retry"
            ) from None
        return version

    async def put_control(self, control: dict[str, Any]) -> None:
        """The run's operator state (paused or not), beside its config so it survives any restart."""
        await self.kv.put(CONTROL_KEY, json.dumps(control).encode())

    async def get_control(self) -> dict[str, Any]:
        try:
            return json.loads((await self.kv.get(CONTROL_KEY)).value)
        except KeyNotFoundError:
            return {}

    async def history(self) -> list[ConfigVersion]:
        try:
            entries = await self.kv.history(KEY)
        except (KeyNotFoundError, NoKeysError):  # no version stored yet (nats-py says so with either)
            return []
        return [ConfigVersion.decode(entry.value) for entry in entries if entry.value]


async def stored_config(cfg: RunConfig, role: str = "operator") -> RunConfig:
    """``cfg`` with every change stored through the admin, restart-only ones included.

    That is what a starting service runs with; a stage started before the trainer waits here for the bucket.
    """
    nc = await nats.connect(cfg.nats.url, connect_timeout=5, **connect_options(cfg.nats, role))
    try:
        return (await LiveConfig(cfg, nc.jetstream(), creates_bucket=creates_run_state(role)).start()).cfg
    finally:
        await nc.close()
