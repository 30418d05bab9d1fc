"""At the end of a run, its record goes to the object store under the run's prefix: ``<run>/archive/...``.

What is archived is what a post-mortem or an audit reads once the machine is gone: every part of the metrics and
events records (``jsonl_parts``), the lineage, ``run.json``, ``usage.json``, the effective config, the report and
every service log (rotated ones too). Keys keep the file's path inside the run directory; a metrics file kept
elsewhere (``metrics_path``) goes under ``metrics/``. Checkpoints are already in the store, and the samples are
left out (they are per-step copies of groups, kept for ``rlpipe samples`` on the machine).

A ``file://`` store whose folder for the run is the run directory itself (the embedded default) already holds all
of it: nothing is copied. Nor is anything copied to a store that lacks the checkpoints the run's own record says it
saved, or that cannot be listed (``checkpoints_missing``): that is a store a resume would wait for, one moved away
or not mounted, and the run writes nothing into it until a trainer has adopted a step there. Each archived object
is tagged ``ARCHIVE_TAG``: the bucket's lifecycle rule expires it after a year (deploy/minio/lifecycle.json).

In compose and Kubernetes no launcher outlives the run: ``rlpipe archive --every`` runs beside the trainer (a
compose service, a container in the trainer's pod), sharing its runs volume and the folder the services write
their logs to (``service.log_dir``, archived under ``logs/``), and copies the record every period and once more
when it is stopped. A pass stores only the files that changed since the one before, so a long run's rolled parts
go once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.common.config import RunConfig
from services.common.observe.logs import jsonl_parts
from services.common.transport.lifecycle_tags import ARCHIVE_TAG
from services.common.transport.storage import FileStore, ObjectStore, open_store
from services.trainer.checkpointing.resume import ResumeBlocked, SavedRecord, StoreListing, resume_candidates

RECORDS = ("events.jsonl", "lineage.jsonl")  # JSON-lines records beside the metrics, each with its rolled parts
SINGLE_FILES = ("run.json", "usage.json", "effective-config.yaml", "run-config.yaml", "report.png", "report.html")


def archive_prefix(run_id: str) -> str:
    return f"{run_id}/archive/"


@dataclass(frozen=True)
class Archived:
    keys: list[str]  # what was stored, under archive_prefix
    nbytes: int
    skipped: str = ""  # why nothing was copied, if so


def archived_files(run_dir: Path, metrics_file: Path, logs_dir: Path | None = None) -> dict[str, Path]:
    """Archive key (under the prefix) -> file, for what ``run_dir`` holds now, and the logs in ``logs_dir`` (the
    services' own, ``service.log_dir``) under ``logs/``."""
    files: dict[str, Path] = {}

    def add(path: Path) -> None:
        try:
            files[path.relative_to(run_dir).as_posix()] = path
        except ValueError:  # outside the run directory: the metrics file of metrics_path
            files[f"metrics/{path.name}"] = path

    for record in (metrics_file, *(run_dir / name for name in RECORDS)):
        for part in jsonl_parts(record):
            add(part)
    for name in SINGLE_FILES:
        if (run_dir / name).is_file():
            add(run_dir / name)
    logs = run_dir / "logs"
    if logs.is_dir():
        for path in sorted(logs.rglob("*")):
            if path.is_file():
                add(path)
    if logs_dir is not None and logs_dir.is_dir() and logs_dir.resolve() != logs.resolve():
        for path in sorted(logs_dir.rglob("*")):
            if path.is_file():
                files[f"logs/{path.relative_to(logs_dir).as_posix()}"] = path
    return files


def same_folder(store: ObjectStore, run_id: str, run_dir: Path) -> bool:
    """Whether ``store`` keeps ``run_id``'s keys in ``run_dir`` itself (a file store rooted at the runs folder)."""
    return isinstance(store, FileStore) and (store.root / run_id).resolve() == run_dir.resolve()


class RunArchiver:
    """Copies the run's record to ``store`` (the run's checkpoint store by default); each ``archive`` stores the
    files whose size or change time differ from the last pass's. Store errors propagate."""

    def __init__(self, cfg: RunConfig, store: ObjectStore | None = None, logs_dir: Path | None = None):
        self.cfg = cfg
        self.store = store or open_store(cfg.checkpoint_url, cfg.checkpoint)
        self.logs_dir = logs_dir
        self._stored: dict[str, tuple[int, int]] = {}  # key -> (size, mtime_ns) of the copy stored

    def archive(self) -> Archived:
        cfg = self.cfg
        if same_folder(self.store, cfg.run_id, cfg.run_dir):
            return Archived([], 0, skipped=f"the store keeps the run in {cfg.run_dir} already")
        if missing := checkpoints_missing(cfg, self.store):
            return Archived([], 0, skipped=f"{missing}; it stays in {cfg.run_dir}")
        keys, nbytes = [], 0
        for name, path in archived_files(cfg.run_dir, cfg.metrics_file, self.logs_dir).items():
            try:
                stat = path.stat()
                if self._stored.get(name) == (stat.st_size, stat.st_mtime_ns):
                    continue
                data = path.read_bytes()
            except FileNotFoundError:  # rotated or pruned since it was listed: the next pass has its new name
                continue
            self.store.put(archive_prefix(cfg.run_id) + name, data, dict([ARCHIVE_TAG]))
            self._stored[name] = (stat.st_size, stat.st_mtime_ns)
            keys.append(name)
            nbytes += len(data)
        return Archived(keys, nbytes)


def checkpoints_missing(cfg: RunConfig, store: ObjectStore) -> str:
    """Why the run's record must not go to ``store``: the run's own record (``SavedRecord``) says it saved a step,
    and ``store`` holds none of the run's checkpoints or cannot be listed (what would hold a resume,
    ``resume_candidates``); "" when the run never saved, or the store holds its checkpoints."""
    try:
        saved = SavedRecord.read(cfg.run_dir)
    except ValueError as error:  # damaged: nothing tells this store is the run's
        return str(error)
    if saved is None:
        return ""
    # Here, not at the top: the store's code imports torch, which a launcher pays only where it lists a store.
    from services.trainer.checkpointing.store import CheckpointStore

    try:
        listing = StoreListing(store.url, CheckpointStore(store, cfg.run_id, cfg.checkpoint.keep_last).steps())
    except Exception as error:  # the store's many failure types
        listing = StoreListing(store.url, None, repr(error)[:300])
    try:
        resume_candidates([listing], saved.step)
    except ResumeBlocked as error:
        return f"{cfg.run_id}'s checkpoints are not where its record says ({error})"
    return ""


def archive_run(cfg: RunConfig, store: ObjectStore | None = None) -> Archived:
    """Copy the run's record to ``store`` (the run's checkpoint store by default). Store errors propagate."""
    return RunArchiver(cfg, store).archive()


def archive_until_stopped(
    archiver: RunArchiver, every_s: float, stop: threading.Event, report: Callable[[str], None]
) -> None:
    """``archiver.archive`` every ``every_s`` seconds and once more when ``stop`` is set, each pass reported as
    ``describe`` does; a pass the store fails is reported and the next one tries again."""
    while True:
        stop.wait(every_s)
        stopping = stop.is_set()
        report(describe(archiver))
        if stopping:
            return


def describe(archiver: RunArchiver) -> str:
    """One ``archive`` pass as one line for the operator. A store that fails loses nothing (the files stay in the
    run directory) and fails nothing: the run itself goes on or is over."""
    cfg = archiver.cfg
    try:
        archived = archiver.archive()
    except Exception as error:  # the store's many failure types
        return not_stored(cfg, error)
    return summary(cfg, archived)


def summary(cfg: RunConfig, archived: Archived) -> str:
    if archived.skipped:
        return f"archive: not copied: {archived.skipped}"
    where = f"{cfg.checkpoint_url.rstrip('/')}/{archive_prefix(cfg.run_id)}"
    return f"archive: {len(archived.keys)} files ({archived.nbytes / 2**20:.1f} MiB) in {where}"


def archive_and_describe(cfg: RunConfig) -> str:
    """``archive_run`` once every service has stopped, as one line (``describe``); a store that cannot even be
    opened is reported the same way."""
    try:
        archiver = RunArchiver(cfg)
    except Exception as error:  # the store's many failure types
        return not_stored(cfg, error)
    return describe(archiver)


def not_stored(cfg: RunConfig, error: Exception) -> str:
    return f"archive: the run's record could not be stored ({error!r}); it stays in {cfg.run_dir}"
