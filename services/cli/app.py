"""The ``rlpipe`` command."""

from __future__ import annotations

from pathlib import Path

import typer

from services.cli.admin.commands import register as register_operator_commands
from services.cli.build.commands import register as register_build_commands
from services.cli.verify.commands import register as register_verify_commands
from services.common.config import ConfigError
from services.tuner.cli import register as register_tune_command

app = typer.Typer(add_completion=False, no_args_is_help=True, help="rlpipe: fault-tolerant RL training for LLMs")


@app.command()
def run(
    config: Path = typer.Argument(..., help="run config YAML"),
    overrides: list[str] = typer.Argument(
        None,
        metavar="KEY=VALUE",
        help="dotted settings over the file, each value read as YAML (train.learning_rate=5e-5 "
        "'reward.functions={exact_match: 1}'); validated like `rlpipe config set`",
        show_default=False,
    ),
    resume: bool = typer.Option(
        False, "--resume", help="continue runs/<run id> from its streams and latest checkpoint"
    ),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="delete runs/<run id> (its checkpoints, metrics, streams and logs) and start over; "
        "without it or --resume, a run directory holding checkpoints or metrics is refused",
    ),
    paused: bool = typer.Option(
        False,
        "--paused",
        help="start held: every role loads and the first prompts are generated, but no step is applied until "
        "`rlpipe resume`",
    ),
    smoke: bool = typer.Option(
        False,
        "--smoke",
        help="a few steps at a small batch under <run id>-smoke; exits 0 only if sampling, reward, reference "
        "and the update each logged a batch",
    ),
) -> None:
    """Run the whole pipeline locally: NATS, reference, trainer, rollout and reward processes."""
    from services.cli.launch.command import run as launch

    if smoke and (overrides or paused):
        typer.echo(
            "rlpipe run: --smoke runs the config file as it is; drop the KEY=VALUE overrides and --paused", err=True
        )
        raise typer.Exit(2)
    if smoke:
        from services.cli.verify.commands import smoke_command

        raise typer.Exit(smoke_command(config))
    try:
        code = launch(config, resume=resume, overwrite=overwrite, overrides=overrides or (), paused=paused)
    except ConfigError as error:
        typer.echo(f"rlpipe run: {error}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


@app.command()
def report(run_dir: Path = typer.Argument(..., metavar="RUN", help="a run directory, or a run id under runs/")) -> None:
    """Render the run's metrics and events to report.png and a self-contained report.html in its directory."""
    from services.cli.report import write_run_report

    if not run_dir.is_dir() and (Path("runs") / run_dir).is_dir():
        run_dir = Path("runs") / run_dir
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        typer.echo(f"rlpipe report: {metrics} does not exist", err=True)
        raise typer.Exit(2)
    for written in write_run_report(run_dir):
        typer.echo(written)


@app.command()
def runs(
    root: Path | None = typer.Argument(
        None, metavar="ROOT", help="the runs root (default: runs_dir of --config, else RLPIPE_RUNS_DIR, else runs/)"
    ),
    config: Path | None = typer.Option(None, "--config", help="a run config whose runs_dir is the root"),
    as_json: bool = typer.Option(False, "--json", help="a JSON list of the runs instead of a table"),
) -> None:
    """List the local runs: each one's state (running, finished, failed, refused, stopped), step and resources."""
    from services.cli.output import console_for, print_json
    from services.cli.runs import list_runs, runs_table
    from services.common.config import RunsLocation, load_config

    if root is None:
        try:
            root = load_config(config).runs_dir if config else RunsLocation().runs_dir
        except ConfigError as error:
            typer.echo(f"rlpipe runs: {error}", err=True)
            raise typer.Exit(2) from None
    rows = list_runs(root)
    if as_json:
        print_json(rows)
        return
    if not rows:
        typer.echo(f"no runs in {root}")
        return
    console_for().print(runs_table(root, rows))


@app.command()
def export(
    run_dir: Path = typer.Argument(..., metavar="RUN", help="a run directory, or a run id under runs/"),
    out: Path = typer.Argument(..., metavar="OUT", help="the folder to write (new or empty)"),
    step: int | None = typer.Option(None, "--step", help="the checkpoint step (default: the newest live one)"),
    merge: bool = typer.Option(
        False, "--merge", help="a LoRA run: a plain Hugging Face model folder with the adapter merged into the base"
    ),
) -> None:
    """A stored checkpoint as a model: a Hugging Face model folder (full weights, or LoRA with --merge) or a LoRA
    run's adapter in peft's format. Exits 2 naming why when the step cannot be exported."""
    from services.cli.export import ExportFailed, export_step
    from services.common.config import load_config

    if not run_dir.is_dir() and (Path("runs") / run_dir).is_dir():
        run_dir = Path("runs") / run_dir
    config = run_dir / "effective-config.yaml"
    if not config.is_file():
        typer.echo(f"rlpipe export: {config} does not exist (not a run directory)", err=True)
        raise typer.Exit(2)
    try:
        typer.echo(export_step(load_config(config), step, out, merge))
    except (ConfigError, ExportFailed) as error:
        typer.echo(f"rlpipe export: {error}", err=True)
        raise typer.Exit(2) from None


@app.command("dead-letters")
def dead_letters(
    run_dir: Path = typer.Argument(..., help="runs/<run id> of a running `rlpipe run` (its run.json names the broker)"),
    nats_url: str = typer.Option("", help="broker URL, instead of the one in run.json"),
    reinject: list[int] = typer.Option([], help="DEAD sequence to send back to its origin stream (repeatable)"),
    payload: Path | None = typer.Option(None, help="a fixed message body to send instead (with one --reinject)"),
    limit: int = typer.Option(1000, help="list at most this many"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object per line instead of a table"),
) -> None:
    """List the run's dead letters with their reasons, or re-inject them where they came from."""
    import asyncio
    import json

    from nats.errors import NoServersError
    from rich.table import Table

    from services.cli.dead_letters import (
        ReinjectIncomplete,
        ReinjectRefused,
        list_dead_letters,
        nats_url_of,
        operator_options,
    )
    from services.cli.dead_letters import reinject as send_back
    from services.cli.output import console_for
    from services.cli.runs import launcher_holds, read_run

    run_id = run_dir.name
    try:
        url = nats_url or nats_url_of(run_dir)
    except FileNotFoundError as error:
        typer.echo(f"rlpipe dead-letters: {error}", err=True)
        raise typer.Exit(2) from None
    if payload is not None and len(reinject) != 1:
        typer.echo("rlpipe dead-letters: --payload goes with exactly one --reinject", err=True)
        raise typer.Exit(2)
    try:
        if reinject:
            body = payload.read_bytes() if payload else None
            for sequence in reinject:
                try:
                    done = asyncio.run(send_back(url, run_id, sequence, body, operator_options(run_dir)))
                except (ReinjectIncomplete, ReinjectRefused) as error:
                    typer.echo(f"rlpipe dead-letters: {error}", err=True)
                    raise typer.Exit(1) from None
                typer.echo(done.describe())
            return
        letters = asyncio.run(list_dead_letters(url, run_id, limit, operator_options(run_dir)))
    except NoServersError:
        # A finished run's broker ended with its launcher: say so, not a traceback.
        state = "running, but its broker does not answer" if launcher_holds(run_dir) else read_run(run_dir).state
        typer.echo(
            f"rlpipe dead-letters: no broker answers at {url}: run {run_id} is {state}. Dead letters are read from a "
            "running run's broker (`rlpipe run CONFIG --resume --paused` brings a finished one back, held)",
            err=True,
        )
        raise typer.Exit(2) from None
    if as_json:
        for letter in letters:
            typer.echo(json.dumps(vars(letter)))
        return
    table = Table(title=f"dead letters of {run_id}: {len(letters)}")
    for column in ("seq", "from", "origin seq", "service", "group", "bytes", "reason", "re-injected"):
        table.add_column(column)
    for d in letters:
        reinjected = "" if d.reinjected_at is None else f"DEAD {d.reinjected_at}"
        if d.reinjected_at is not None and not d.reinject_sent:
            reinjected += ", copy not sent: --reinject it again"
        table.add_row(
            str(d.sequence),
            d.origin_stream,
            str(d.origin_sequence),
            d.service,
            d.group_id,
            str(d.size),
            f"FORGED ({d.forged}): {d.reason}" if d.forged else d.reason,
            reinjected,
        )
    console_for().print(table)


@app.command()
def archive(
    config: Path = typer.Option(..., "--config", help="the run's config: its run directory and checkpoint store"),
    logs: Path | None = typer.Option(
        None, "--logs", help="the services' log folder (service.log_dir), archived under logs/ (default: that field)"
    ),
    every: float = typer.Option(
        0.0,
        "--every",
        min=0.0,
        help="seconds between passes, until SIGTERM or SIGINT, then one last pass; 0 (default): one pass and exit",
    ),
) -> None:
    """Copy the run's record (metrics and events parts, lineage, configs, logs) to <store>/<run>/archive/.

    What `rlpipe run` does when a run ends, for the deployments without it: beside the trainer, with --every.
    Exits 1 when a single pass could not store the record.
    """
    import signal
    import threading

    from services.cli.launch.archive import RunArchiver, archive_prefix, archive_until_stopped, not_stored, summary
    from services.common.config import load_config

    try:
        cfg = load_config(config)
    except ConfigError as error:
        typer.echo(f"rlpipe archive: {error}", err=True)
        raise typer.Exit(2) from None
    try:
        archiver = RunArchiver(cfg, logs_dir=logs or cfg.service.log_dir)
    except Exception as error:  # the store's many failure types
        typer.echo(not_stored(cfg, error), err=True)
        raise typer.Exit(1) from None
    if not every:
        try:
            archived = archiver.archive()
        except Exception as error:  # the store's many failure types
            typer.echo(not_stored(cfg, error), err=True)
            raise typer.Exit(1) from None
        typer.echo(summary(cfg, archived))
        return
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    typer.echo(f"archive: a pass every {every:g} s to {archive_prefix(cfg.run_id)}, and a last one when stopped")
    archive_until_stopped(archiver, every, stop, typer.echo)


@app.command()
def doctor(
    config: Path = typer.Option(
        Path("examples/arith-grpo.yaml"), "--config", help="run config YAML (default: the one `make demo` runs)"
    ),
    embedded: bool = typer.Option(
        False,
        "--embedded",
        help="the config is for `rlpipe run`, which starts its own broker: check nats-server instead of nats.url",
    ),
    as_json: bool = typer.Option(False, "--json", help="a JSON list of the checks (name, status, detail)"),
    network: bool = typer.Option(
        False,
        "--network",
        help="also time round trips and throughput to the broker, the S3 store and the remote services (a few "
        "requests and 8 MiB each way) against what the config's rates need of them",
    ),
) -> None:
    """Check versions, GPU, model, dataset, storage, NATS and streams, ports, admin token and disk.

    Exits 1 naming each failure.
    """
    from services.cli.doctor.checks import diagnose, print_report
    from services.cli.output import console_for, print_json

    results = diagnose(config, embedded=embedded, network=network)
    if as_json:
        print_json(results)
        raise typer.Exit(1 if any(result.failed for result in results) else 0)
    raise typer.Exit(print_report(results, console_for()))


@app.command()
def plan(
    source: Path = typer.Argument(..., metavar="MODEL_OR_CONFIG", help="a model folder or a run config YAML"),
    algorithm: str = typer.Option(None, help="ppo (adds a critic) | grpo or another critic-free estimator"),
    micro_batch_tokens: int = typer.Option(None, help="tokens one trainer forward/backward holds"),
    seq_len: int = typer.Option(None, help="most tokens of prompt plus completion"),
    group_size: int = typer.Option(None, help="completions per prompt"),
    gradient_checkpointing: bool = typer.Option(None, "--gradient-checkpointing/--no-gradient-checkpointing"),
    lora_rank: int = typer.Option(None, help="train rank-R LoRA adapters on q, k, v and o instead of every weight"),
    gpus: int = typer.Option(None, min=0, help="GPUs at hand; 0 plans for the CPU (default: the GPUs seen here)"),
    gpu_memory_gib: float = typer.Option(None, min=0.1, help="memory of each GPU in GiB (default: this machine's)"),
    as_json: bool = typer.Option(False, "--json", help="the estimate and the placements as one JSON document"),
) -> None:
    """Estimate the memory each role needs (with 25% headroom), which placement fits the GPUs, and swap risk.

    Options override what a run config says; a model folder starts from grpo, 4096 micro-batch tokens,
    sequences of 1024 and groups of 8 in bfloat16 with float32 master weights.
    """
    from services.cli.output import console_for
    from services.cli.plan import gpus_at_hand, plan_command, resolve_gpus

    try:
        code = plan_command(
            source,
            resolve_gpus(gpus, gpu_memory_gib, gpus_at_hand),
            console_for(),
            as_json=as_json,
            algorithm=algorithm,
            micro_batch_tokens=micro_batch_tokens,
            max_seq_len=seq_len,
            group_size=group_size,
            gradient_checkpointing=gradient_checkpointing,
            lora_rank=lora_rank,
        )
    except (ConfigError, ValueError) as error:
        typer.echo(f"rlpipe plan: {error}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


data_app = typer.Typer(help="Look at a run's data before training on it.")
app.add_typer(data_app, name="data")


@data_app.command("sample")
def data_sample(
    config: Path = typer.Argument(..., help="run config YAML"),
    rows: int = typer.Option(5, "--rows", "-n", help="how many rows to draw"),
    seed: int = typer.Option(0, help="the draw's seed: the same seed shows the same rows"),
    split: str = typer.Option("train", help="train (data.train_path) or eval (data.eval_path)"),
) -> None:
    """Print N random dataset rows as the model will see them: the prompt after the chat template, its token
    count and the answer the reward compares with."""
    from services.cli.data import format_sample, sample_rows
    from services.common.config import load_config
    from services.common.model.datasets import DatasetError
    from services.common.refusal import StartRefused
    from services.common.transport.model_source import ModelFetchFailed, resolve_model

    if split not in ("train", "eval"):
        typer.echo(f"rlpipe data sample: --split must be train or eval, not {split!r}", err=True)
        raise typer.Exit(2)
    try:
        typer.echo(format_sample(sample_rows(resolve_model(load_config(config)), rows, seed, split)))
    except (ConfigError, DatasetError, ValueError, StartRefused, ModelFetchFailed) as error:
        typer.echo(f"rlpipe data sample: {error}", err=True)
        raise typer.Exit(2) from None


register_build_commands(app)
register_verify_commands(app, register_operator_commands(app))
register_tune_command(app)


def main() -> None:
    app()
