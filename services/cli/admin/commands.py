"""The operator commands of the ``rlpipe`` app, each one Admin call (``client``) printed by ``views``."""

from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.table import Table

from services.cli.admin.client import LOOP_DEADLINE_S, READ_DEADLINE_S, SCALE_POLL_S, UNREACHABLE, USAGE, Target, fail
from services.cli.admin.views import console, declared, metric_line, print_json, run_dir_of, show_status, tail
from services.common.pb import admin_pb2


def register(app: typer.Typer) -> typer.Typer:
    """Add the operator commands to the ``rlpipe`` app; returns the ``checkpoints`` group, for more subcommands."""

    @app.callback()
    def connect(
        ctx: typer.Context,
        address: str = typer.Option("", help="trainer admin host:port (default: the newest local run's)"),
        token: str = typer.Option(
            "",
            help="admin token (default: RLPIPE_ADMIN_TOKEN, else the run's admin.token; with --read-only "
            "RLPIPE_ADMIN_READ_TOKEN, else the run's admin-read.token)",
        ),
        read_only: bool = typer.Option(
            False,
            "--read-only",
            help="call with the read-only token: status, config show, config history and checkpoints answer; "
            "every command that changes the run is refused (PERMISSION_DENIED, exit 1)",
        ),
        timeout: float = typer.Option(
            0.0,
            help=f"deadline of each call, seconds (default: {READ_DEADLINE_S:g} for reads, "
            f"{LOOP_DEADLINE_S:g} for commands the training loop runs)",
        ),
        run_dir: Path | None = typer.Option(
            None, help="run directory whose run.json and admin.token (admin-read.token) to use"
        ),
        runs_dir: Path | None = typer.Option(
            None, help="where to find the newest local run without --run-dir (default: RLPIPE_RUNS_DIR, else runs)"
        ),
        tls_ca: Path | None = typer.Option(None, help="CA certificate when the admin port speaks TLS"),
    ) -> None:
        ctx.obj = Target(address, token, timeout, run_dir, tls_ca, runs_dir, read_only)

    def target(ctx: typer.Context) -> Target:
        return ctx.obj

    @app.command()
    def status(ctx: typer.Context, as_json: bool = typer.Option(False, "--json")) -> None:
        """The run's state, step, versions, services (lag, restarts) and active alerts."""
        show_status(target(ctx).call("GetStatus", admin_pb2.GetStatusRequest()), as_json)

    @app.command()
    def pause(ctx: typer.Context, reason: str = typer.Option("paused by operator")) -> None:
        """Stop feeding prompts and applying steps (takes effect between steps)."""
        result = target(ctx).call("Pause", admin_pb2.PauseRequest(reason=reason))
        console.print(f"{result.state} at step {result.step}")

    @app.command("resume")
    def resume_training(ctx: typer.Context) -> None:
        """Continue a paused run."""
        result = target(ctx).call("Resume", admin_pb2.ResumeRequest())
        console.print(f"{result.state} at step {result.step}")

    @app.command()
    def stop(ctx: typer.Context, reason: str = typer.Option("stopped by operator")) -> None:
        """Finish the current step, save a checkpoint and end the run."""
        result = target(ctx).call("Stop", admin_pb2.StopRequest(reason=reason))
        console.print(f"{result.state} at step {result.step}")

    @app.command()
    def scale(
        ctx: typer.Context,
        role: str = typer.Argument(..., help="rollout, reward or reference"),
        replicas: int = typer.Argument(..., help="how many replicas of ROLE the run should have; 0 stops them all"),
        author: str = typer.Option("", help="recorded with the change (default: your user name)"),
        wait: bool = typer.Option(
            False, "--wait", help="then wait until the status shows exactly REPLICAS replicas of ROLE, all up"
        ),
    ) -> None:
        """Add or remove replicas of a stage role while a local run (`rlpipe run`) goes on.

        Scaling up starts ROLE-<n> replicas; scaling down stops the highest-numbered, which finish or hand back the
        work they hold, so nothing is lost or applied twice. Each change is a `scaled` row in events.jsonl. Where
        Kubernetes (KEDA) or compose runs the replicas this is refused, naming where to scale instead.
        """
        import getpass

        where = target(ctx)
        request = admin_pb2.ScaleRequest(role=role, replicas=replicas, author=author or getpass.getuser())
        reply = where.call("Scale", request)
        console.print(
            f"{reply.role}: {reply.replicas_before} -> {reply.replicas} replicas asked ({reply.replicas_up} up now)",
            highlight=False,
        )
        if wait:
            up = wait_for_replicas(where, reply.role, reply.replicas)
            console.print(f"{reply.role}: {up} replicas up", highlight=False)

    @app.command()
    def checkpoint(ctx: typer.Context) -> None:
        """Save a checkpoint of the current step now."""
        info = target(ctx).call("Checkpoint", admin_pb2.CheckpointRequest())
        console.print(f"checkpoint of step {info.step} (policy version {info.policy_version}) at {info.location}")

    checkpoints_app = typer.Typer(help="The stored checkpoints; `checkpoints verify` checks they are whole and load.")
    app.add_typer(checkpoints_app, name="checkpoints")

    @checkpoints_app.callback(invoke_without_command=True)
    def checkpoints(ctx: typer.Context, as_json: bool = typer.Option(False, "--json")) -> None:
        """The stored checkpoints, with stable and abandoned marks."""
        if ctx.invoked_subcommand is not None:
            return
        listing = target(ctx).call("ListCheckpoints", admin_pb2.ListCheckpointsRequest())
        if as_json:
            return print_json(listing)
        table = Table(title="checkpoints")
        for column in ("step", "policy v", "saved", "MiB", "stable", "abandoned", "location"):
            table.add_column(column)
        for c in listing.checkpoints:
            saved = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c.created))
            table.add_row(
                str(c.step),
                str(c.policy_version),
                saved,
                f"{c.bytes / 2**20:.1f}",
                "yes" if c.stable else "",
                "yes" if c.abandoned else "",
                c.location,
            )
        console.print(table)

    @app.command()
    def rollback(
        ctx: typer.Context,
        step: int | None = typer.Argument(None, help="checkpoint step to go back to"),
        stable: bool = typer.Option(False, "--stable", help="the newest checkpoint marked stable"),
    ) -> None:
        """Serve an earlier checkpoint as a new policy version; later steps are recorded as abandoned."""
        if (step is None) == (not stable):
            fail(USAGE, "give either STEP or --stable")
        request = admin_pb2.RollbackRequest(stable=True) if stable else admin_pb2.RollbackRequest(step=step)
        reply = target(ctx).call("Rollback", request)
        console.print(
            f"rolled back to step {reply.step} as policy version {reply.policy_version}; "
            f"abandoned steps: {list(reply.abandoned_steps)}"
        )

    @app.command("mark-stable")
    def mark_stable(ctx: typer.Context, step: int = typer.Argument(..., help="checkpoint step")) -> None:
        """Vouch for a checkpoint: pruning keeps it and `rollback --stable` goes to the newest such."""
        info = target(ctx).call("MarkStable", admin_pb2.MarkStableRequest(step=step))
        console.print(f"step {info.step} marked stable")

    config_app = typer.Typer(no_args_is_help=True, help="Show, change and audit the live configuration.")
    app.add_typer(config_app, name="config")

    @config_app.command("show")
    def config_show(ctx: typer.Context) -> None:
        """The configuration in force, as YAML, with its version."""
        reply = target(ctx).call("GetConfig", admin_pb2.GetConfigRequest())
        typer.echo(f"# config version {reply.version}\n{reply.yaml}")

    @config_app.command("set")
    def config_set(
        ctx: typer.Context,
        settings: list[str] = typer.Argument(..., help="KEY=VALUE pairs, e.g. train.learning_rate=5e-5"),
        author: str = typer.Option("", help="recorded with the change (default: your user name)"),
        dry_run: bool = typer.Option(False, "--dry-run", help="validate and show what would change"),
    ) -> None:
        """Validate and store a new config version; says which fields apply live and which at restart."""
        import getpass

        pairs = []
        for item in settings:
            key, sep, value = item.partition("=")
            if not sep or not key:
                fail(USAGE, f"{item!r} is not KEY=VALUE")
            pairs.append(admin_pb2.Setting(key=key.strip(), value=value))
        reply = target(ctx).call(
            "UpdateConfig",
            admin_pb2.UpdateConfigRequest(settings=pairs, author=author or getpass.getuser(), dry_run=dry_run),
        )
        verb = "would be" if dry_run else "is now"
        console.print(f"config version {reply.version} {verb} in force" if reply.changes else "nothing changed")
        for change in reply.changes:
            when = "live, between steps" if change.live else "at the next restart of the services that use it"
            console.print(f"  {change.key}: {change.old_value} -> {change.new_value}  ({when})", highlight=False)

    @config_app.command("history")
    def config_history(ctx: typer.Context, as_json: bool = typer.Option(False, "--json")) -> None:
        """Every stored config version: who, when, what changed."""
        history = target(ctx).call("GetConfigHistory", admin_pb2.GetConfigHistoryRequest())
        if as_json:
            return print_json(history)
        table = Table(title="config history")
        for column in ("version", "time", "author", "changes"):
            table.add_column(column)
        for v in history.versions:
            changes = "; ".join(
                f"{c.key}: {c.old_value} -> {c.new_value}{'' if c.live else ' (restart)'}" for c in v.changes
            )
            table.add_row(str(v.version), time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(v.time)), v.author, changes)
        console.print(table)

    @app.command()
    def metrics(
        ctx: typer.Context,
        follow: bool = typer.Option(False, "--follow", "-f", help="keep printing new rows"),
        keys: str = typer.Option(
            "step,config_version,reward_mean,entropy,kl_ref,response_length_mean,termination_rate,learning_rate",
            help="comma-separated columns",
        ),
    ) -> None:
        """Print the run's metric rows (runs/<run>/metrics.jsonl) as they arrive."""
        run_dir = run_dir_of(ctx)
        columns = [declared(key.strip()) for key in keys.split(",") if key.strip()]
        tail(run_dir / "metrics.jsonl", follow, lambda line: metric_line(line, columns))

    @app.command()
    def logs(
        ctx: typer.Context,
        service: str = typer.Argument("trainer", help="trainer, rollout-0, reward-0, reference-0, nats ..."),
        follow: bool = typer.Option(False, "--follow", "-f"),
    ) -> None:
        """Print a service's log of a local run (runs/<run>/logs/<service>.log)."""
        tail(run_dir_of(ctx) / "logs" / f"{service}.log", follow, lambda line: line)

    return checkpoints_app


def wait_for_replicas(where: Target, role: str, replicas: int) -> int:
    """Read the status until it lists exactly ``replicas`` replicas of ``role``, all up (a replica scaled away is
    gone from it once it has drained); fails with UNREACHABLE (3) past the deadline (``--timeout``, else the one
    of commands the training loop runs)."""
    deadline = time.monotonic() + (where.timeout or LOOP_DEADLINE_S)
    while True:
        status = where.call("GetStatus", admin_pb2.GetStatusRequest())
        mine = [s for s in status.services if s.role == role and not s.stopped]  # a drained one may still be listed
        if len(mine) == replicas and all(s.up for s in mine):
            return replicas
        if time.monotonic() > deadline:
            listed = ", ".join(f"{s.instance} {'up' if s.up else 'down'}" for s in mine) or "none"
            fail(UNREACHABLE, f"{role} did not reach {replicas} replicas up in time; the status lists: {listed}")
        time.sleep(SCALE_POLL_S)
