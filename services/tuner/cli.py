"""``rlpipe tune [status|best|report] FILE``.

One command with an optional action word rather than a command group: ``rlpipe tune FILE`` runs the
study, which a group's positional argument could not share with its sub-commands.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

ACTIONS = ("status", "best", "report")

# The one variable a tuner reads: the study storage URL, kept out of process listings (it carries a password).
STORAGE_ENVVAR = "RLPIPE_TUNE_STORAGE"


def register(app: typer.Typer) -> None:
    @app.command(no_args_is_help=True)
    def tune(
        args: list[str] = typer.Argument(
            ...,
            metavar="[status|best|report] FILE [KEY=VALUE]...",
            help="the tune file, then dotted settings over its base config (each value read as YAML), kept fixed "
            "in every trial",
        ),
        worker: bool = typer.Option(
            False,
            "--worker",
            help="join the study as one more worker (the tune file's storage shared by several tuners); "
            "no table, report or best config at the end, the last worker to finish or `rlpipe tune best` does that",
        ),
        storage: str | None = typer.Option(
            None,
            "--storage",
            envvar=STORAGE_ENVVAR,
            help="the study's storage URL, in place of the tune file's (postgresql://USER:PASSWORD@HOST/DB for "
            "workers on several machines); from the environment, it stays out of process listings",
        ),
        out: Path | None = typer.Option(
            None, "--out", help="best: the YAML to write (default <workdir>/best.yaml); report: its folder"
        ),
    ) -> None:
        """Search hyperparameters: each trial an isolated `rlpipe run`, scored, limited and recorded in an Optuna study.

        `rlpipe tune FILE` runs the study to its budget (a restarted tuner continues it), then prints the table
        and writes the report and the best config. `status` prints the table, `best` writes the best trial's
        config as a YAML for `rlpipe run`, `report` renders PNG plots and an HTML page.
        """
        from rich.console import Console

        from services.cli.output import console_for
        from services.common.config import ConfigError, load_config_with, parse_overrides
        from services.tuner import records
        from services.tuner.spec import TuneFileError
        from services.tuner.study import open_storage, open_study
        from services.tuner.tune_file import load_tune_file

        words = [arg for arg in args if "=" not in arg]
        settings = [arg for arg in args if "=" in arg]
        if not 1 <= len(words) <= 2 or (len(words) == 2 and words[0] not in ACTIONS):
            typer.echo(
                f"rlpipe tune: expected [{'|'.join(ACTIONS)}] FILE [KEY=VALUE]..., got {' '.join(args)}", err=True
            )
            raise typer.Exit(2)
        action, path = (words[0], words[1]) if len(words) == 2 else ("run", words[0])
        try:
            spec, base = load_tune_file(path, storage)
            overrides = parse_overrides(settings)
            searched = sorted(set(overrides) & set(spec.space))
            if searched:
                raise ConfigError(f"override {searched[0]}: the tune file searches it; a key is either set or searched")
            if overrides:  # the base config with them, and every trial's config through the study's fixed keys
                base, _ = load_config_with(spec.base_config, overrides)
                spec = spec.model_copy(update={"fixed": {**spec.fixed, **overrides}})
        except (TuneFileError, ConfigError) as error:
            typer.echo(f"rlpipe tune: {error}", err=True)
            raise typer.Exit(2) from None
        console = console_for(sys.stdout)
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        if action == "run":
            from services.tuner.study import Tuner

            tuner = Tuner(spec, base, Console(stderr=True), worker=worker)
            tuner.run()
            if worker:
                return
            study = tuner.study
        else:
            study = open_study(spec, open_storage(spec))
        all_records = records.records(study)
        if action in ("run", "status"):
            console.print(records.status_table(spec, all_records))
        if action in ("run", "report"):
            console.print(f"report: {records.render_report(spec, study, out or spec.work_dir / 'report')}")
        if action in ("run", "best"):
            best = records.ranked(spec, all_records)
            if not best:
                typer.echo(f"rlpipe tune: no completed, feasible trial in study {spec.study} yet", err=True)
                # A study that ran to its budget did its job even if every trial failed; `best` alone has none.
                raise typer.Exit(1 if action == "best" else 0)
            written = records.best_config(spec, best[0], out or spec.work_dir / "best.yaml")
            console.print(f"best: trial {best[0].number} ({best[0].objective:.4g}) -> {written}")
