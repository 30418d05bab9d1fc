"""``rlpipe build-tiny``, ``build-reward-model`` and ``import-gguf``: the commands that build models and their data
(the CLI alone builds models)."""

from __future__ import annotations

from pathlib import Path

import typer

from services.cli.build.tasks import TOOL_SHARE

# Where each task's build goes unless told otherwise: the paths its example config reads (examples/arith-grpo.yaml,
# smol-arith.yaml, tool-arith.yaml, long-tail.yaml), so that no task's build overwrites another's. word-problems
# writes no model.
BUILD_TINY_PATHS: dict[str, tuple[Path | None, Path]] = {
    "arithmetic": (Path("models/tiny-arith"), Path("data/arith")),
    "word-problems": (None, Path("data/word-problems")),
    "tool-arith": (Path("models/tiny-tool-arith"), Path("data/tool-arith")),
    "long-tail": (Path("models/tiny-long-tail"), Path("data/long-tail")),
}


def register(app: typer.Typer) -> None:
    """Add the build commands to the ``rlpipe`` app."""

    @app.command("build-tiny")
    def build_tiny(
        out: Path | None = typer.Option(
            None,
            help="model folder to write (default: models/tiny-arith, models/tiny-tool-arith for tool-arith, "
            "models/tiny-long-tail for long-tail)",
        ),
        data: Path | None = typer.Option(
            None,
            help="dataset folder to write (default: data/arith, data/word-problems, data/tool-arith or "
            "data/long-tail by task)",
        ),
        seed: int = typer.Option(0),
        task: str = typer.Option(
            "arithmetic",
            help="arithmetic: the dataset and the tiny model; word-problems: only a chat-form word-problem dataset "
            "(for a chat model such as `make model-smol`'s; the tiny model has no chat template); tool-arith: "
            "multiplications and a tiny model warm-started on calculator transcripts (examples/tool-arith.yaml); "
            "long-tail: additions of which a quarter ask for answers up to 32 characters (examples/long-tail.yaml)",
        ),
        tool_share: float = typer.Option(
            TOOL_SHARE,
            help="tool-arith: the share of warm-start transcripts that call the calculator, the others stating the "
            "product outright (1.0: a model that calls it from the start; docs/agents.md)",
        ),
        max_steps: int | None = typer.Option(
            None, help="warm-start steps (arithmetic: at most, default 1500; tool-arith: exactly, default 800)"
        ),
    ) -> None:
        """Build the tiny arithmetic dataset and warm-started character-level Qwen2 model, a word-problem dataset, or
        the calculator-tool dataset and model."""
        from services.cli.build.tiny_model import main as build

        if task not in BUILD_TINY_PATHS:
            typer.echo(
                f"rlpipe build-tiny: --task must be one of {', '.join(BUILD_TINY_PATHS)}, not {task!r}", err=True
            )
            raise typer.Exit(2)
        default_out, default_data = BUILD_TINY_PATHS[task]
        out = out or default_out
        options = [*(["--out", str(out)] if out else []), "--data", str(data or default_data), "--seed", str(seed)]
        options += ["--task", task, "--tool-share", str(tool_share)]
        build([*options, *(["--max-steps", str(max_steps)] if max_steps else [])])

    @app.command("build-reward-model")
    def build_reward_model(
        out: Path = typer.Option(Path("models/tiny-arith-rm"), help="reward model folder to write"),
        policy: Path = typer.Option(Path("models/tiny-arith"), help="the tiny policy it starts from (make model)"),
        data: Path = typer.Option(Path("data/arith"), help="the arithmetic dataset (make model)"),
        seed: int = typer.Option(0),
        steps: int = typer.Option(300, help="training steps of 32 right and 32 wrong answers"),
    ) -> None:
        """Train the tiny reward model that tells right from wrong arithmetic answers (examples/arith-rm.yaml)."""
        import json

        from services.cli.build.tiny_reward_model import build_reward_model as build

        typer.echo(json.dumps(build(out, policy, data, seed=seed, steps=steps)))

    @app.command("import-gguf")
    def import_gguf(
        gguf_file: Path = typer.Argument(..., metavar="FILE", help="a .gguf model file"),
        out_dir: Path = typer.Argument(..., metavar="OUT_DIR", help="Hugging Face model folder to write"),
        dtype: str = typer.Option("float32", help="dtype of the saved weights: float32 | bfloat16 | float16"),
        overwrite: bool = typer.Option(False, "--overwrite", help="replace OUT_DIR if it exists"),
    ) -> None:
        """Import a GGUF model (any architecture transformers reads as a causal LM) as a Hugging Face folder."""
        import json
        from dataclasses import asdict

        from services.cli.build.gguf_import import GGUFImportError
        from services.cli.build.gguf_import import import_gguf as run_import

        try:
            summary = run_import(gguf_file, out_dir, dtype=dtype, overwrite=overwrite)
        except GGUFImportError as error:
            typer.echo(f"rlpipe import-gguf: {error}", err=True)
            raise typer.Exit(2) from None
        typer.echo(json.dumps(asdict(summary)))
