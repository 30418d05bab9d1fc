"""Models and their data: loading and scoring (modeling), chat rendering, datasets, held-out evaluation and answer
parsing, and the two model builders (the tiny model, the GGUF import)."""
