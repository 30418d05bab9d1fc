"""What the CLI builds for a run that cannot download one: the tiny models, their data and tasks, a reward model, and
SmolLM2 imported from a GGUF file. No role imports these."""
