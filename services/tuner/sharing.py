"""What lets several tuners share one study: the storage, a study-wide claim lock, and heartbeats.

Several ``rlpipe tune --worker`` processes (on one machine or many) and the device slots inside one
tuner all take trials from the same study. Claiming a trial (failing dead workers' trials, checking
the budget, asking Optuna, sampling, checking for a duplicate, recording the start) runs under one
lock for the whole study, so between them the workers never start more than ``budget.max_trials``,
never overspend the device-hours, and never start the same parameters twice. The trial itself runs
outside the lock.

- PostgreSQL: a session advisory lock keyed by the study name, held on a connection of its own,
  which the server drops with the connection if the worker dies. A running trial's worker
  records Optuna's heartbeat (``RDBStorage(heartbeat_interval=...)``) every ``parallel.heartbeat_s``;
  a trial whose heartbeat is older than ``parallel.stale_after_s`` is failed by the next worker that
  claims a trial (``optuna.storages.fail_stale_trials``), on whatever machine it runs (SQLite
  beats too).
- A journal or SQLite file: ``flock`` on a file beside it (workers on one machine). On a journal,
  dead workers' trials are found by host and pid only (``Tuner.recover``), as they also are on a
  database when the dead worker ran on this host (no need to wait out the grace).
"""

from __future__ import annotations

import contextlib
import fcntl
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeGuard

import optuna
import optuna.storages.journal
import sqlalchemy.exc

from services.tuner.spec import TuneSpec

# Optuna's heartbeat is written for Study.optimize; the tuner drives ask/tell and beats itself, so these
# notes about it are not the user's to act on.
_OPTUNA_NOTES = (
    "Heartbeat of storage is supposed to be used with Study.optimize",
    ".*heartbeat.*experimental",
    ".*fail_stale_trials is experimental",
)
StaleCallback = Callable[[optuna.Study, optuna.trial.FrozenTrial], None]


def database_url(url: str) -> str:
    """The SQLAlchemy URL: a plain ``postgresql://`` gets the psycopg (3) driver, the one installed."""
    if url.startswith("postgresql://"):
        return "postgresql+psycopg://" + url.removeprefix("postgresql://")
    return url


def open_storage(spec: TuneSpec, on_stale: StaleCallback | None = None) -> optuna.storages.BaseStorage:
    """The study's storage; a database one with heartbeats when ``on_stale`` is given (a tuner, not a reader)."""
    url = spec.storage_url
    if url.startswith("journal:"):
        path = Path(url.removeprefix("journal:"))
        path.parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(path)))
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    with _one_schema_writer(database_url(url)):
        if on_stale is None:
            return optuna.storages.RDBStorage(database_url(url))
        for note in _OPTUNA_NOTES:
            warnings.filterwarnings("ignore", message=note)
        return optuna.storages.RDBStorage(
            database_url(url),
            # A connection idle through a long trial may have been dropped by a proxy or a restarted server.
            engine_kwargs={"pool_pre_ping": True},
            heartbeat_interval=spec.parallel.heartbeat_s,
            grace_period=spec.parallel.stale_after_s,
            heartbeat_stale_trial_callback=on_stale,
        )


@contextlib.contextmanager
def _one_schema_writer(url: str) -> Iterator[None]:
    """On PostgreSQL, one process at a time opens the storage: workers started together on an empty database
    would each create Optuna's tables, and all but one fail (a duplicate ``studydirection`` type)."""
    if not url.startswith("postgresql"):
        yield
        return
    engine = sqlalchemy.create_engine(url)
    try:
        with _advisory_lock(engine, "rlpipe-tune-schema"):
            yield
    finally:
        engine.dispose()


@contextlib.contextmanager
def _advisory_lock(engine: sqlalchemy.Engine, key: str) -> Iterator[None]:
    """A session lock on its own connection: the server releases it if this process dies holding it."""
    with engine.connect() as connection:
        connection.execute(sqlalchemy.text("SELECT pg_advisory_lock(hashtextextended(:key, 0))"), {"key": key})
        try:
            yield
        finally:
            connection.execute(sqlalchemy.text("SELECT pg_advisory_unlock(hashtextextended(:key, 0))"), {"key": key})
            connection.commit()


def beats(storage: optuna.storages.BaseStorage) -> TypeGuard[optuna.storages.RDBStorage]:
    return isinstance(storage, optuna.storages.RDBStorage) and storage.get_heartbeat_interval() is not None


@contextlib.contextmanager
def claim_lock(spec: TuneSpec, storage: optuna.storages.BaseStorage) -> Iterator[None]:
    """Hold the study's claim lock (see the module docstring); blocks while another worker holds it."""
    if isinstance(storage, optuna.storages.RDBStorage) and storage.engine.dialect.name == "postgresql":
        with _advisory_lock(storage.engine, f"rlpipe-tune:{spec.study}"):
            yield
        return
    url = spec.storage_url
    path = Path(url.removeprefix("journal:") if url.startswith("journal:") else url.removeprefix("sqlite:///"))
    # Not the journal's own lock file (<journal>.lock): that one guards single writes, this a whole claim.
    with open(f"{path}.claim-lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class Heartbeat:
    """Records Optuna's heartbeat of one running trial until stopped; nothing on a storage without heartbeats."""

    def __init__(self, storage: optuna.storages.BaseStorage, trial_id: int, on_error: Callable[[str], None]):
        self.storage = storage
        self.trial_id = trial_id
        self.on_error = on_error
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None
        self.beating = storage if beats(storage) else None  # a database storage with heartbeats
        if self.beating is not None:
            self.beating.record_heartbeat(trial_id)  # at once: from now on a dead worker's trial goes stale
            self.thread = threading.Thread(target=self.beat, name=f"heartbeat-{trial_id}", daemon=True)
            self.thread.start()

    def beat(self) -> None:
        storage = self.beating
        if storage is None:
            return
        interval = storage.get_heartbeat_interval()
        while not self.stopped.wait(interval):
            try:
                storage.record_heartbeat(self.trial_id)
            except sqlalchemy.exc.SQLAlchemyError as error:
                # The database briefly away: beat again next time; only an outage past the grace fails the trial.
                self.on_error(f"heartbeat of trial id {self.trial_id} not recorded ({type(error).__name__}); retrying")

    def stop(self) -> None:
        self.stopped.set()
        if self.thread is not None:
            self.thread.join()
