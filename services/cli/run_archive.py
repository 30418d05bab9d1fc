"""At the end of a run, its record goes to the object store under the run's prefix: ``<run>/archive/...``.

What is archived is what a post-mortem or an audit reads once the machine is gone: every part of the metrics and
events records (``jsonl_parts``), the lineage, ``run.json``, ``usage.json``, the effective config, the report and
every service log (rotated ones too). Keys keep the file's path inside the run directory; a metrics file kept
elsewhere (``metrics_path``) goes under ``metrics/``. Checkpoints are already in the store, and the samples are
left out (they are per-step copies of groups, kept for ``rlpipe samples`` on the machine).

A ``file://`` store whose folder for the run is the run directory itself (the embedded default) already holds all
of it: nothing is copied. The archive has no lifecycle rule: keep it as long as the checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.common.config import RunConfig
from services.common.observe.logs import jsonl_parts
from services.common.transport.storage import FileStore, ObjectStore, open_store

RECORDS = ("events.jsonl", "lineage.jsonl")  # JSON-lines records beside the metrics, each with its rolled parts
SINGLE_FILES = ("run.json", "usage.json", "effective-config.yaml", "run-config.yaml", "report.png", "report.html")


def archive_prefix(run_id: str) -> str:
    return f"{run_id}/archive/"


@dataclass(frozen=True)
class Archived:
    keys: list[str]  # what was stored, under archive_prefix
    nbytes: int
    skipped: str = ""  # why nothing was copied, if so


def archived_files(run_dir: Path, metrics_file: Path) -> dict[str, Path]:
    """Archive key (under the prefix) -> file, for what ``run_dir`` holds now."""
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
    return files


def same_folder(store: ObjectStore, run_id: str, run_dir: Path) -> bool:
    """Whether ``store`` keeps ``run_id``'s keys in ``run_dir`` itself (a file store rooted at the runs folder)."""
    return isinstance(store, FileStore) and (store.root / run_id).resolve() == run_dir.resolve()


def archive_run(cfg: RunConfig, store: ObjectStore | None = None) -> Archived:
    """Copy the run's record to ``store`` (the run's checkpoint store by default). Store errors propagate."""
    store = store or open_store(cfg.checkpoint_url, cfg.checkpoint)
    if same_folder(store, cfg.run_id, cfg.run_dir):
        return Archived([], 0, skipped=f"the store keeps the run in {cfg.run_dir} already")
    keys, nbytes = [], 0
    for name, path in archived_files(cfg.run_dir, cfg.metrics_file).items():
        data = path.read_bytes()
        store.put(archive_prefix(cfg.run_id) + name, data)
        keys.append(name)
        nbytes += len(data)
    return Archived(keys, nbytes)


def archive_and_describe(cfg: RunConfig) -> str:
    """``archive_run`` once every service has stopped, as one line for the operator. A store that fails loses
    nothing (the files stay in the run directory) and fails nothing: the run itself is over."""
    try:
        archived = archive_run(cfg)
    except Exception as error:  # the store's many failure types
        return f"archive: the run's record could not be stored ({error!r}); it stays in {cfg.run_dir}"
    if archived.skipped:
        return f"archive: not copied: {archived.skipped}"
    where = f"{cfg.checkpoint_url.rstrip('/')}/{archive_prefix(cfg.run_id)}"
    return f"archive: {len(archived.keys)} files ({archived.nbytes / 2**20:.1f} MiB) in {where}"
