"""The ``rlpipe`` command."""

from __future__ import annotations

from pathlib import Path

import typer

from services.common.config import ConfigError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="rlpipe: fault-tolerant RL training for LLMs")


@app.command()
def run(
    config: Path = typer.Argument(..., help="run config YAML"),
    resume: bool = typer.Option(False, "--resume", help="continue runs/<run id> from its streams and latest checkpoint"),
) -> None:
    """Run the whole pipeline locally: NATS, reference, trainer, rollout and reward processes."""
    from services.launcher import run as launch

    try:
        code = launch(config, resume=resume)
    except ConfigError as error:
        typer.echo(f"rlpipe run: {error}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


@app.command()
def report(run_dir: Path = typer.Argument(..., help="runs/<run id>")) -> None:
    """Render runs/<run>/metrics.jsonl to runs/<run>/report.png."""
    from services.report import render_report

    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        typer.echo(f"rlpipe report: {metrics} does not exist", err=True)
        raise typer.Exit(2)
    typer.echo(render_report(metrics, run_dir / "report.png"))


@app.command("build-tiny")
def build_tiny(
    out: Path = typer.Option(Path("models/tiny-arith"), help="model folder to write"),
    data: Path = typer.Option(Path("data/arith"), help="dataset folder to write"),
    seed: int = typer.Option(0),
) -> None:
    """Build the tiny arithmetic dataset and warm-started character-level Qwen2 model."""
    from services.common.tiny_model import main as build

    build(["--out", str(out), "--data", str(data), "--seed", str(seed)])


def main() -> None:
    app()


if __name__ == "__main__":
    main()
