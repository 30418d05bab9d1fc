"""What reaches the trainer and what became of it: prompts fed from the dataset, EXPERIENCE read in stream order, the
ledger that gives every fed group one fate, and the per-step records of what was applied (samples, episode stats)."""
