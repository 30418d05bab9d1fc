"""A copy of a model folder whose tokenizer names no pad token, as a GGUF import leaves it on some transformers
versions: for the tests that run each padding site and a whole pipeline over one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from transformers import AutoTokenizer

# Where a Hugging Face folder names its pad token. The tokenizer's is set to null, not removed: a tokenizer class
# with a default of its own (Qwen2Tokenizer's "<|endoftext|>") would otherwise add it as a new token.
PAD_KEYS = {
    "tokenizer_config.json": "pad_token",
    "special_tokens_map.json": "pad_token",
    "config.json": "pad_token_id",
    "generation_config.json": "pad_token_id",
}


def without_pad_token(model_dir: Path, out: Path) -> Path:
    """``model_dir`` copied to ``out`` with its pad token unset everywhere it is named; ``out``."""
    shutil.copytree(model_dir, out)
    for name, key in PAD_KEYS.items():
        path = out / name
        if path.is_file():
            settings = json.loads(path.read_text())
            settings[key] = None
            path.write_text(json.dumps(settings, indent=2))
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert tokenizer.pad_token is None and tokenizer.pad_token_id is None, "the copy still has a pad token"
    return out
