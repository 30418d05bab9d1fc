"""``rlpipe status|pause|resume|scale|config|checkpoint|checkpoints|rollback|mark-stable|stop|metrics|logs``.

Each command is one Admin call to the trainer with a deadline. The address defaults to
the one recorded in the newest ``runs/*/run.json`` and the token to
``RLPIPE_ADMIN_TOKEN``, else the run directory's ``admin.token``, so next to a local
``rlpipe run`` the commands just work.

Exit codes a script can rely on: 0 done; 1 refused (invalid value, unknown step);
2 bad usage or no run found; 3 trainer unreachable or out of time; 4 token refused.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import grpc
import typer
from rich.console import Console
from rich.table import Table

from services.cli.output import console_for
from services.common.config import AdminCredentials, RunsLocation
from services.common.observe.logs import JsonlFollower
from services.common.observe.metrics import EVAL_ACCURACY, Metric, find
from services.common.observe.records import MetricsRow
from services.common.pb import admin_pb2, admin_pb2_grpc

# Piped output (scripts, logs) gets room for the wide tables instead of rich's 80 columns.
console = console_for(sys.stdout)
REFUSED, USAGE, UNREACHABLE, UNAUTHENTICATED = 1, 2, 3, 4
_EXIT_OF = {
    grpc.StatusCode.UNAUTHENTICATED: UNAUTHENTICATED,
    grpc.StatusCode.UNAVAILABLE: UNREACHABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: UNREACHABLE,
}


READ_DEADLINE_S = 10.0
SCALE_POLL_S = 1.0  # how often `rlpipe scale --wait` reads the status
# Commands the training loop runs between steps: they wait for the step in progress, and a checkpoint
# or rollback moves the whole model through the store. A deadline that expires first leaves the
# command undone (the trainer skips commands whose caller has gone), never done behind the caller's back.
LOOP_DEADLINE_S = 600.0
RUN_BY_THE_LOOP = {"Pause", "Resume", "Stop", "Checkpoint", "Rollback", "MarkStable"}


class Target:
    """Where and how to reach the Admin service, from the options or the newest local run."""

    def __init__(
        self,
        address: str,
        token: str,
        timeout: float,
        run_dir: Path | None,
        tls_ca: Path | None,
        runs_dir: Path | None = None,
    ):
        self.runs_dir = runs_dir or RunsLocation().runs_dir
        self.run_dir = run_dir or newest_run_dir(self.runs_dir)
        self.given_address = address
        self.given_token = token
        self.timeout = timeout
        self.tls_ca = tls_ca

    def _recorded(self, key: str) -> str:
        if self.run_dir is None or not (self.run_dir / "run.json").is_file():
            fail(
                USAGE,
                f"no --address given and no {self.runs_dir}/*/run.json found (start a run with `rlpipe run CONFIG`; "
                "a run elsewhere: --runs-dir or RLPIPE_RUNS_DIR, its config's runs_dir, or --run-dir)",
            )
        value = json.loads((self.run_dir / "run.json").read_text()).get(key)
        if not value:
            fail(USAGE, f"{self.run_dir / 'run.json'} has no {key!r} yet (is the trainer up?)")
        return value

    def _token_file(self) -> str:
        path = self.run_dir / "admin.token" if self.run_dir else None
        return path.read_text().strip() if path and path.is_file() else ""

    def call(self, method: str, request: Any) -> Any:
        address = self.given_address or self._recorded("admin")
        token = self.given_token or AdminCredentials().token or self._token_file()
        channel = (
            grpc.secure_channel(address, grpc.ssl_channel_credentials(self.tls_ca.read_bytes()))
            if self.tls_ca
            else grpc.insecure_channel(address)
        )
        with channel:
            stub = admin_pb2_grpc.AdminStub(channel)
            try:
                timeout = self.timeout or (LOOP_DEADLINE_S if method in RUN_BY_THE_LOOP else READ_DEADLINE_S)
                return getattr(stub, method)(request, timeout=timeout, metadata=[("authorization", f"Bearer {token}")])
            except grpc.RpcError as error:
                fail(_EXIT_OF.get(error.code(), REFUSED), f"{method}: {error.code().name}: {error.details()}")


def newest_run_dir(runs: Path) -> Path | None:
    found = sorted(runs.glob("*/run.json"), key=lambda p: p.stat().st_mtime)
    return found[-1].parent if found else None


def fail(code: int, message: str) -> NoReturn:
    # Unwrapped: a path or an address in the message must stay greppable at any terminal width.
    Console(stderr=True).print(f"[red]rlpipe:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def plain(message: Any) -> dict[str, Any]:
    """A message as plain JSON types, every field present (proto3's JSON mapping would quote 64-bit integers)."""
    out = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        repeated = field.is_repeated
        if field.message_type is not None:
            out[field.name] = [plain(item) for item in value] if repeated else plain(value)
        else:
            out[field.name] = list(value) if repeated else value
    return out


def _print_json(message: Any) -> None:
    typer.echo(json.dumps(plain(message), indent=2))


def show_status(status: admin_pb2.Status, as_json: bool) -> None:
    if as_json:
        return _print_json(status)
    state = f"[bold]{status.state}[/]" + (f" ({status.paused_reason})" if status.paused_reason else "")
    unreadable = f"[red]unknown: store unreadable ({status.checkpoint_store_error})[/]"
    summary = Table(title=f"run {status.run_id}", show_header=False)
    for name, value in (
        ("state", state),
        ("step", f"{status.step} / {status.total_steps}"),
        ("policy version", str(status.policy_version)),
        ("config version", str(status.config_version)),
        (
            "last checkpoint",
            unreadable
            if status.checkpoint_store_error
            else str(status.last_checkpoint_step)
            if status.last_checkpoint_step >= 0
            else "none",
        ),
        (
            "last stable",
            unreadable
            if status.checkpoint_store_error
            else str(status.last_stable_step)
            if status.last_stable_step >= 0
            else "none",
        ),
        ("eval accuracy", f"{status.last_eval_accuracy:.3f}" if status.last_eval_accuracy >= 0 else "-"),
        ("groups in flight", str(status.in_flight_groups)),
        ("build", f"{status.build_version} ({status.build_revision})"),
        ("environment", status.environment or "-"),
    ):
        summary.add_row(name, value)
    console.print(summary)
    services = Table(title="services")
    for column in ("instance", "role", "up", "restarts", "lag", "policy v", "config v", "GPU GiB alloc/resv/used"):
        services.add_column(column)
    for column in ("grpc", "metrics", "seen"):
        services.add_column(column)
    for s in status.services:
        services.add_row(
            s.instance,
            s.role,
            "[green]up[/]" if s.up else "[red]down[/]",
            str(s.restarts),
            str(s.consumer_lag),
            str(s.policy_version) if s.role in ("trainer", "rollout") else "-",  # the others hold no policy
            str(s.config_version),
            gpu_memory_cell(s),
            s.grpc_address,
            s.metrics_url,
            f"{s.last_seen_s:.0f}s ago",
        )
    console.print(services)
    if status.alerts:
        alerts = Table(title="active alerts")
        for column in ("rule", "severity", "metric", "value", "threshold", "window", "step", "actions"):
            alerts.add_column(column)
        for a in status.alerts:
            alerts.add_row(
                a.rule,
                a.severity,
                a.metric,
                f"{a.value:.4g}",
                f"{a.threshold:.4g}",
                a.window,
                str(a.step),
                ",".join(a.actions),
            )
        console.print(alerts)


def gpu_memory_cell(service: admin_pb2.ServiceStatus) -> str:
    """A replica's GPU memory as ``allocated / reserved / used`` GiB, "-" for a figure it does not report (no
    CUDA in the process, no NVML), "-" alone for a replica on a CPU."""
    figures = (service.gpu_allocated_gib, service.gpu_reserved_gib, service.gpu_used_gib)
    if not any(figures):
        return "-"
    return " / ".join(f"{gib:.2f}" if gib else "-" for gib in figures)


def register(app: typer.Typer) -> typer.Typer:
    """Add the operator commands to the ``rlpipe`` app; returns the ``checkpoints`` group, for more subcommands."""

    @app.callback()
    def connect(
        ctx: typer.Context,
        address: str = typer.Option("", help="trainer admin host:port (default: the newest local run's)"),
        token: str = typer.Option("", help="admin token (default: RLPIPE_ADMIN_TOKEN, else the run's admin.token)"),
        timeout: float = typer.Option(
            0.0,
            help=f"deadline of each call, seconds (default: {READ_DEADLINE_S:g} for reads, "
            f"{LOOP_DEADLINE_S:g} for commands the training loop runs)",
        ),
        run_dir: Path | None = typer.Option(None, help="run directory whose run.json and admin.token to use"),
        runs_dir: Path | None = typer.Option(
            None, help="where to find the newest local run without --run-dir (default: RLPIPE_RUNS_DIR, else runs)"
        ),
        tls_ca: Path | None = typer.Option(None, help="CA certificate when the admin port speaks TLS"),
    ) -> None:
        ctx.obj = Target(address, token, timeout, run_dir, tls_ca, runs_dir)

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
            return _print_json(listing)
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
            return _print_json(history)
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
        run_dir = _run_dir(ctx)
        columns = [_declared(key.strip()) for key in keys.split(",") if key.strip()]
        _tail(run_dir / "metrics.jsonl", follow, lambda line: _metric_line(line, columns))

    @app.command()
    def logs(
        ctx: typer.Context,
        service: str = typer.Argument("trainer", help="trainer, rollout-0, reward-0, reference-0, nats ..."),
        follow: bool = typer.Option(False, "--follow", "-f"),
    ) -> None:
        """Print a service's log of a local run (runs/<run>/logs/<service>.log)."""
        _tail(_run_dir(ctx) / "logs" / f"{service}.log", follow, lambda line: line)

    return checkpoints_app


def wait_for_replicas(where: Target, role: str, replicas: int) -> int:
    """Read the status until it lists exactly ``replicas`` replicas of ``role``, all up (a replica scaled away is
    gone from it once it has drained); fails with UNREACHABLE (3) past the deadline (``--timeout``, else the one
    of commands the training loop runs)."""
    deadline = time.monotonic() + (where.timeout or LOOP_DEADLINE_S)
    while True:
        status = where.call("GetStatus", admin_pb2.GetStatusRequest())
        mine = [s for s in status.services if s.role == role]
        if len(mine) == replicas and all(s.up for s in mine):
            return replicas
        if time.monotonic() > deadline:
            listed = ", ".join(f"{s.instance} {'up' if s.up else 'down'}" for s in mine) or "none"
            fail(UNREACHABLE, f"{role} did not reach {replicas} replicas up in time; the status lists: {listed}")
        time.sleep(SCALE_POLL_S)


def _run_dir(ctx: typer.Context) -> Path:
    run_dir = ctx.obj.run_dir
    if run_dir is None:
        fail(USAGE, "no run directory found (give --run-dir)")
    return run_dir


def _declared(key: str) -> Metric:
    metric = find(key)
    if metric is None:
        fail(USAGE, f"{key!r} is not a metric the trainer writes (docs/metrics.md lists them)")
    return metric


def _metric_line(line: str, columns: list[Metric]) -> str | None:
    try:
        values = json.loads(line)
    except ValueError:
        return None
    if not isinstance(values, dict):
        return None
    row = MetricsRow(values)
    if not row.is_step and not row.is_eval:
        return None
    shown = [f"{metric.key}={_shown(row, metric)}" for metric in columns if metric in row]
    if row.is_eval:
        shown.append(f"eval_accuracy={row[EVAL_ACCURACY]:.4f}")
    return "  ".join(shown)


def _shown(row: MetricsRow, metric: Metric) -> str:
    value = row.get(metric)
    if value is None:
        return str(row.text(metric))
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _tail(path: Path, follow: bool, render: Callable[[str], str | None]) -> None:
    if not path.is_file():
        fail(USAGE, f"{path} does not exist")
    follower = JsonlFollower(path)  # through the record's rolled parts too
    while True:
        for line in follower.new_lines():
            shown = render(line.decode())
            if shown:
                typer.echo(shown)
        if not follow:
            return
        time.sleep(0.5)
