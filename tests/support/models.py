"""Model configs that tests write into folders without weights, for code that reads only a model's shape."""

from __future__ import annotations

import json
from pathlib import Path

SMOLLM2_CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}


def config_only(folder: Path, model_config: dict | None = None) -> tuple[Path, Path]:
    """A model folder holding only ``model_config`` as its config.json (a bare llama unless given) and a data folder
    with one row in each split, under ``folder``: what the config loader accepts, with nothing to load or build."""
    model_dir, data_dir = folder / "config-only-model", folder / "config-only-data"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(model_config or {"model_type": "llama"}))
    data_dir.mkdir()
    for split in ("train", "eval"):
        (data_dir / f"{split}.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    return model_dir, data_dir
