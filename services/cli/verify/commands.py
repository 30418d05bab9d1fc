"""``rlpipe verify``, ``rlpipe run --smoke``, ``rlpipe alerts test``, ``rlpipe checkpoints verify``, ``rlpipe samples``.

Exit codes: 0 every check passed; 1 a check failed (each failed one is named on stderr);
2 bad usage (an invalid config, an unknown rule, no run found).
"""

from __future__ import annotations

import json
import signal
import sys
from dataclasses import asdict
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from services.cli.output import console_for
from services.cli.verify.health import FIRST_STEP_MAX_S
from services.common.config import ConfigError, load_config

DEFAULT_CONFIG = Path("examples/arith-grpo.yaml")
console = console_for(sys.stdout)


def _plain(message: str) -> None:
    """Unstyled and unwrapped on stderr: a path, a check or a step in it stays greppable."""
    Console(stderr=True).print(message, markup=False, highlight=False, soft_wrap=True)


def _load(config: Path, command: str):
    try:
        return load_config(config)
    except ConfigError as error:
        _plain(f"rlpipe {command}: {error}")
        raise typer.Exit(2) from None


def _show_checks(checks, title: str) -> None:
    table = Table(title=title)
    for column in ("check", "result", "evidence"):
        table.add_column(column, overflow="fold")
    colour = {"pass": "green", "fail": "red", "skip": "yellow"}
    for check in checks:
        table.add_row(check.name, f"[{colour[check.status]}]{check.status}[/]", check.detail)
    console.print(table)


def _orderly_sigterm() -> None:
    # SIGTERM (a supervisor, `timeout`) gets the same orderly shutdown of the services as Ctrl-C.
    signal.signal(signal.SIGTERM, signal.default_int_handler)


def smoke_command(config: Path) -> int:
    """``rlpipe run --smoke CONFIG``: exit 0 only when every role came up and every stage logged a batch."""
    from services.cli.verify.checklist import smoke_only

    _orderly_sigterm()
    try:
        checks = smoke_only(config)
    except ConfigError as error:
        _plain(f"rlpipe run --smoke: {error}")
        return 2
    _show_checks(checks, f"smoke run of {config}")
    failed = [c for c in checks if c.status != "pass"]
    for check in failed:
        _plain(f"rlpipe run --smoke: {check.name} failed: {check.detail}")
    return 1 if failed else 0


def register(app: typer.Typer, checkpoints_app: typer.Typer) -> None:
    @app.command("verify")
    def verify_command(
        ctx: typer.Context,
        overrides: list[str] = typer.Argument(
            None,
            metavar="KEY=VALUE",
            help="dotted settings over the config file, each value read as YAML, as `rlpipe run` takes them",
            show_default=False,
        ),
        config: Path = typer.Option(DEFAULT_CONFIG, "--config", help="the deployment's run config YAML"),
        first_step_max_s: float = typer.Option(
            FIRST_STEP_MAX_S,
            "--first-step-max-s",
            min=1.0,
            help="seconds from the smoke run's start to its first step row that still pass (model loads included)",
        ),
        against: Path | None = typer.Option(
            None,
            "--against",
            exists=True,
            dir_okay=False,
            help="an earlier verify.json to compare versions, config and figures with (default: the newest earlier "
            "record, kept under the run directory's verify-history/)",
        ),
    ) -> None:
        """The post-deployment checklist: roles, weight sync, a smoke run, a checkpoint written and loaded, an
        alert drill, the training curves, their ranges and jumps, the first step's time, resources, remote
        services. Starts the embedded deployment, or, with the global --address, checks the running one behind
        that trainer admin address (no smoke run). Writes verify.json and verify.md, keeps the record they replace
        under verify-history/, and prints what changed in versions, config, checks and figures since it (or since
        --against)."""
        from services.cli.verify.checklist import verify, verify_live
        from services.cli.verify.compare import newest_earlier, record_changes
        from services.common.config import AdminCredentials, parse_overrides

        _orderly_sigterm()
        target = ctx.obj
        try:
            settings = parse_overrides(overrides or ())
            if target is not None and target.given_address:
                token = target.given_token or AdminCredentials().token
                if not token and target.run_dir is not None and (target.run_dir / "admin.token").is_file():
                    token = (target.run_dir / "admin.token").read_text().strip()
                checks, cfg, (as_json, as_md) = verify_live(
                    config, target.given_address, token, target.tls_ca, settings
                )
            else:
                checks, cfg, (as_json, as_md) = verify(config, settings, first_step_max_s)
        except ConfigError as error:
            _plain(f"rlpipe verify: {error}")
            raise typer.Exit(2) from None
        _show_checks(checks, f"verification of {config} (run {cfg.run_id})")
        _plain(f"record: {as_json} {as_md}")
        baseline = against or newest_earlier(as_json)
        if baseline is not None:
            changes = record_changes(as_json, as_md, baseline)
            _plain(f"since {baseline}: " + (f"{len(changes)} change(s)" if changes else "nothing changed"))
            for change in changes:
                _plain(f"  {change.line()}")
        failed = [c for c in checks if c.status == "fail"]
        for check in failed:
            _plain(f"rlpipe verify: {check.name} failed: {check.detail}")
        raise typer.Exit(1 if failed else 0)

    alerts_app = typer.Typer(no_args_is_help=True, help="Alert rules and their delivery.")
    app.add_typer(alerts_app, name="alerts")

    @alerts_app.command("review")
    def alerts_review(
        run_dir: Path = typer.Argument(..., metavar="RUN", help="a run directory (runs/<run id>)"),
        as_json: bool = typer.Option(False, "--json", help="one JSON document instead of the table"),
    ) -> None:
        """Each alert rule of the run against what the run showed: its firings, the distribution of what it judges,
        the closest the run came to firing it, and a threshold to suggest (for a run you judge healthy)."""
        from services.cli.alert_review import review_run
        from services.cli.output import print_json
        from services.common.observe.records import read_jsonl

        config = run_dir / "effective-config.yaml"
        if not config.is_file():
            _plain(f"rlpipe alerts review: {config} does not exist (not a run directory)")
            raise typer.Exit(2)
        cfg = _load(config, "alerts review")
        rows = read_jsonl(cfg.metrics_file)  # raw rows: a rule names its metric by the string in its config
        reviews = review_run(cfg.alerts.rules, rows, read_jsonl(run_dir / "events.jsonl"))
        if as_json:
            print_json(reviews)
            return
        table = Table(title=f"alert rules of {cfg.run_id} against its {len(rows)} rows")
        for column in ("rule", "judges", "threshold", "fired", "p5 / p50 / p95", "closest", "suggested", "verdict"):
            table.add_column(column, overflow="fold")
        for review in reviews:
            rule, spread = review.rule, review.percentiles
            current = f"{rule.window_s:g} s" if rule.condition == "absent" else f"{rule.threshold:g}"
            table.add_row(
                rule.name,
                f"{rule.metric} {rule.condition} over {rule.window_steps}",
                current,
                str(len(review.firings)),
                " / ".join(f"{spread[p]:.4g}" for p in (5, 50, 95)) if spread else "-",
                "-" if review.closest is None else f"{review.closest:.4g}",
                "-" if review.suggested is None else f"{review.suggested:.4g}",
                review.verdict,
            )
        console_for().print(table)

    @alerts_app.command("test")
    def alerts_test(
        rule: str | None = typer.Argument(None, help="the rule to fire (default: every configured rule)"),
        config: Path = typer.Option(DEFAULT_CONFIG, "--config", help="run config YAML whose alerts section to use"),
    ) -> None:
        """Fire a rule (or every rule) once, as a drill, through every sink: log, events, metrics, Prometheus,
        webhook. Only notifies. Exits 1 naming each sink that did not get it."""
        from services.cli.verify.alert_drill import run_drill, select_rules

        cfg = _load(config, "alerts test")
        try:
            rules = select_rules(cfg, rule)
        except KeyError as error:
            _plain(f"rlpipe alerts test: {error.args[0]}")
            raise typer.Exit(2) from None
        sinks = run_drill(cfg, rules)
        table = Table(title=f"alert drill: {', '.join(r.name for r in rules)}")
        for column in ("sink", "result", "detail"):
            table.add_column(column, overflow="fold")
        for sink in sinks:
            table.add_row(sink.sink, "[green]ok[/]" if sink.ok else "[red]failed[/]", sink.detail)
        console.print(table)
        failed = [s for s in sinks if not s.ok]
        for sink in failed:
            _plain(f"rlpipe alerts test: sink {sink.sink} failed: {sink.detail}")
        raise typer.Exit(1 if failed else 0)

    @checkpoints_app.command("verify")
    def checkpoints_verify(
        ctx: typer.Context,
        step: int | None = typer.Argument(None, help="the step to check (default: the newest)"),
        every: bool = typer.Option(False, "--all", help="every live step"),
        config: Path | None = typer.Option(
            None, "--config", help="run config YAML (default: the effective config of the run (--run-dir, newest))"
        ),
        as_json: bool = typer.Option(False, "--json"),
    ) -> None:
        """Integrity (manifest, hashes) and loadability (weights into the model) of stored checkpoints, on the
        store and its mirror. Exits 1 naming each bad step and file."""
        from services.cli.verify.checkpoints import verify_checkpoints

        if step is not None and every:
            _plain("rlpipe checkpoints verify: give STEP or --all, not both")
            raise typer.Exit(2)
        if config is None:
            run_dir: Path | None = ctx.obj.run_dir if ctx.obj is not None else None
            if run_dir is None or not (run_dir / "effective-config.yaml").is_file():
                _plain("rlpipe checkpoints verify: no --config given and no runs/*/effective-config.yaml found")
                raise typer.Exit(2)
            config = run_dir / "effective-config.yaml"
        results = verify_checkpoints(_load(config, "checkpoints verify"), step, every)
        if as_json:
            for result in results:
                typer.echo(json.dumps(asdict(result)))
        else:
            table = Table(title="checkpoint verification")
            for column in ("store", "step", "result", "detail"):
                table.add_column(column, overflow="fold")
            for r in results:
                table.add_row(r.store, str(r.step), "[green]ok[/]" if r.ok else "[red]failed[/]", r.detail)
            console.print(table)
        for result in results:
            if not result.ok:
                _plain(f"rlpipe checkpoints verify: {result.store}: {result.detail}")
        raise typer.Exit(0 if results and all(r.ok for r in results) else 1)

    @app.command("samples")
    def samples(
        ctx: typer.Context,
        run: str = typer.Option("", "--run", help="run id under runs/, or a run directory (default: the newest run)"),
        step: int | None = typer.Option(None, "--step", help="the step (default: the newest archived)"),
        n: int = typer.Option(4, "--n", min=1, help="groups to show"),
        as_json: bool = typer.Option(False, "--json", help="one group per line, as archived"),
    ) -> None:
        """Sampled prompts, completions, rewards and per-token logprob/KL summaries of what a step trained on."""
        from services.trainer.intake.samples import SampleArchive

        run_dir = (Path(run) if Path(run).is_dir() else Path("runs") / run) if run else ctx.obj.run_dir
        if run_dir is None or not run_dir.is_dir():
            _plain(f"rlpipe samples: no run directory {run_dir or 'found'} (give --run ID)")
            raise typer.Exit(2)
        archive = SampleArchive(run_dir / "samples", keep_steps=0)  # read only: nothing is written or pruned
        archived = archive.steps()
        if not archived:
            _plain(f"rlpipe samples: {archive.folder} holds no step (telemetry.samples_keep_steps: 0, or no step yet)")
            raise typer.Exit(2)
        chosen = archived[-1] if step is None else step
        if chosen not in archived:
            _plain(f"rlpipe samples: step {chosen} is not archived (kept: {archived[0]} to {archived[-1]})")
            raise typer.Exit(2)
        groups = archive.read(chosen)[:n]
        if as_json:
            for group in groups:
                typer.echo(group.to_json())
            return
        for group in groups:
            episodes = any(c.mask for c in group.completions)
            table = Table(
                title=f"step {group.step}  group {group.group_id}  (version {group.policy_version})  "
                f"prompt {group.prompt!r}  answer {group.answer!r}",
                title_justify="left",
                caption="tokens, logprobs and KL over the model's own tokens; an episode's observations are "
                "in the text and the mask (M model, O observation), in no statistic"
                if episodes
                else None,
            )
            columns = ["completion", "reward", "finish", "tokens", "logprob mean", "logprob min", "KL mean", "KL max"]
            for column in [*columns, *(["observation tokens", "mask"] if episodes else [])]:
                table.add_column(column, overflow="fold")
            for c in group.completions:
                cells = [
                    repr(c.text),
                    f"{c.reward:g}",
                    c.finish_reason,
                    str(c.tokens),
                    f"{c.logprob_mean:.3f}",
                    f"{c.logprob_min:.3f}",
                    f"{c.kl_mean:.4f}",
                    f"{c.kl_max:.4f}",
                ]
                table.add_row(*cells, *([str(c.observation_tokens), c.mask or "all model"] if episodes else []))
            console.print(table)
