"""Model configs that tests write into folders without weights, for code that reads only a model's shape."""

from __future__ import annotations

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
