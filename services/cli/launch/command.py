"""``rlpipe run CONFIG``: the command's flow around the Launcher (services/cli/launch/launcher.py).

Refuses before touching anything when the run is live elsewhere on this machine, when its directory holds an
earlier run and neither ``--resume`` nor ``--overwrite`` was given, or when the machine fails the start-up checks
(exit 2). Then it starts the services, follows the run to its end, and stops them; Ctrl-C and SIGTERM get the same
orderly stop (a second one kills). At the end it writes the cost, the reports, the archive and the summary, and
records how the run ended for ``rlpipe runs``.
"""

from __future__ import annotations

import shlex
import shutil
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from services.cli.launch.archive import archive_and_describe
from services.cli.launch.children import RoleCrashLoop, RoleRefused
from services.cli.launch.credentials import inherited_env
from services.cli.launch.launcher import Launcher
from services.cli.launch.lock import RunIsLive, hold_run, previous_run
from services.cli.launch.narration import console
from services.cli.launch.placement import place_roles
from services.cli.launch.summary import run_cost, summarize, write_reports
from services.cli.runs import record_exit
from services.common.config import ConfigError, RunConfig, load_config_with, parse_overrides
from services.common.refusal import StartRefused
from services.common.service import EXIT_REFUSED
from services.common.startup_checks.roles import startup_checks
from services.common.startup_checks.rows import StartupCheckError
from services.common.transport.model_source import ModelFetchFailed, resolve_model

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # an operator's or a supervisor's stop: orderly, not a failure
PAUSED_AT_START = "started with --paused"  # the hold's reason, in status and events


class Interrupted(Exception):
    """Ctrl-C or SIGTERM: the operator (or a supervisor) ends the run; it stops in order, it did not fail."""

    def __init__(self, signum: int):
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(self.name)


def interrupt(signum: int, _frame: Any) -> None:
    raise Interrupted(signum)


def stop_or_kill(launcher: Launcher) -> list[str]:
    """Every service stopped in order (``Launcher.stop``); a second Ctrl-C or SIGTERM meanwhile kills them now."""
    try:
        return launcher.stop()
    except Interrupted as again:
        console.log(f"[red]{again.name} again: killing every service now[/]")
        return launcher.kill()


def _plain(message: str) -> None:
    """Unstyled and unwrapped, so a script or a person can grep it."""
    console.print(message, markup=False, highlight=False, soft_wrap=True)


def run(
    config_path: Path,
    resume: bool = False,
    overwrite: bool = False,
    overrides: Sequence[str] = (),
    paused: bool = False,
) -> int:
    """Run the pipeline in ``runs/<run>``; 2 without starting anything when the config or the machine is not fit.

    ``resume`` continues the run there (its streams and checkpoints); ``overwrite`` deletes it
    first. With neither, a directory holding an earlier run's checkpoints or metrics is refused,
    so re-running a config by accident cannot destroy a run. ``overrides`` are command-line
    ``KEY=VALUE`` settings over the file; the services then read ``runs/<run>/run-config.yaml``. ``paused``
    starts the run held (its roles ready, no step) until an operator resumes it.
    """
    if resume and overwrite:
        _plain("rlpipe run: --resume continues the run in its directory and --overwrite deletes it: choose one")
        return 2
    cfg, config_data = load_config_with(config_path, parse_overrides(overrides))
    try:
        hold = hold_run(cfg)  # before anything is touched: --resume and --overwrite of a live run would wreck it
    except RunIsLive as error:
        _plain(f"rlpipe run: {error}; nothing was changed. Stop it first (rlpipe stop, or Ctrl-C in its shell)")
        return 2
    with hold:
        return _run_held(cfg, config_data, config_path, resume, overwrite, overrides, paused)


def _run_held(
    cfg: RunConfig,
    config_data: dict[str, Any],
    config_path: Path,
    resume: bool,
    overwrite: bool,
    overrides: Sequence[str],
    paused: bool,
) -> int:
    """``run`` once this launcher holds the run."""
    earlier = previous_run(cfg)
    if earlier and not (resume or overwrite):
        command = shlex.join(["rlpipe", "run", str(config_path), *overrides])
        _plain(
            f"rlpipe run: {cfg.run_dir} already holds a run ({', '.join(earlier)}); nothing was changed.\n"
            f"  continue it:               {command} --resume\n"
            f"  delete it and start over:  {command} --overwrite"
        )
        return 2
    try:  # fetched here once (model.path s3:// or hf://), so the roles starting together find it in the cache
        cfg = resolve_model(cfg)
    except StartRefused as error:
        _plain(f"rlpipe run: {error}")
        return 2
    except ModelFetchFailed as error:
        _plain(f"rlpipe run: cannot fetch the model: {error}")
        return 1
    try:
        startup_checks(cfg, "run", resume=resume)
    except StartupCheckError as error:
        console.log(f"[red]rlpipe run: {error}[/] (rlpipe doctor --embedded --config {config_path} shows every check)")
        return 2
    if not resume:
        if cfg.run_dir.exists():
            console.log(f"starting afresh: removing the previous {cfg.run_dir}")
            shutil.rmtree(cfg.run_dir)
        # A metrics_path outside the run directory would otherwise carry the old run's rows into the new one's.
        cfg.metrics_file.unlink(missing_ok=True)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    # Until this run's services are ready, run.json must not point the CLI at the ports of the previous one.
    (cfg.run_dir / "run.json").unlink(missing_ok=True)
    if overrides:  # the services read a file: the one they get has the overrides written in
        config_path = cfg.run_dir / "run-config.yaml"
        config_path.write_text(yaml.safe_dump(config_data, sort_keys=False))
    try:
        placement = place_roles(cfg, inherited_env().get("CUDA_VISIBLE_DEVICES"))
    except ConfigError as error:
        _plain(f"rlpipe run: {error}")
        return 2
    _plain(f"placement: {placement.summary}")
    launcher = Launcher(cfg, config_path, resume, hold=PAUSED_AT_START if paused else "", placement=placement)
    # Ctrl-C and SIGTERM (a supervisor, `timeout`) get the same orderly shutdown.
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    for signum in STOP_SIGNALS:
        signal.signal(signum, interrupt)
    try:
        code = _supervise(cfg, config_path, launcher)
        record_exit(cfg.run_dir, code)  # how it ended, for `rlpipe runs`
        return code
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _supervise(cfg: RunConfig, config_path: Path, launcher: Launcher) -> int:
    """Start the services, follow the run to its end, stop them; the run's exit code."""
    try:
        launcher.start()
        training_started = time.perf_counter()
        done = launcher.follow()
        wall_s = time.perf_counter() - training_started
    except Interrupted as interrupted:
        console.log(f"{interrupted.name}: stopping every service; the trainer saves the step in hand")
        failed = stop_or_kill(launcher)
        run_cost(cfg, None, launcher.usage)
        write_reports(cfg)
        console.log(archive_and_describe(cfg))
        if failed:  # asked to stop, these did not within their grace: killed, which is no failure of theirs
            console.log(f"killed after their stop grace: {failed} (see their logs for what they were waiting on)")
        _plain(f"rlpipe run: stopped; continue it with {shlex.join(['rlpipe', 'run', str(config_path), '--resume'])}")
        return 128 + interrupted.signum
    except RoleRefused as refused:
        stop_or_kill(launcher)
        _plain(f"rlpipe run: {refused.name} refused to run: {refused.reason}\n  its log: {refused.log_path}")
        return EXIT_REFUSED
    except RoleCrashLoop as loop:
        stop_or_kill(launcher)
        _plain(
            f"rlpipe run: {loop.name} crashed twice with the same error and no step between, so it is not restarted "
            f"again: {loop.crash.error}\n  at {loop.crash.where}\n  its log: {loop.log_path}"
        )
        return 1
    except RuntimeError as error:
        console.log(f"[red]run failed:[/] {error}")
        stop_or_kill(launcher)
        return 1
    failed = stop_or_kill(launcher)

    cost = run_cost(cfg, done, launcher.usage)
    report = write_reports(cfg)
    console.log(archive_and_describe(cfg))
    console.print(summarize(cfg, done, launcher.startup.ready_after_s, wall_s, cost))
    console.log(f"metrics: {cfg.metrics_file}  report: {report}  logs: {cfg.run_dir / 'logs'}")
    if failed:
        console.log(f"[red]services failed:[/] {failed}")
        return 1
    return 0
