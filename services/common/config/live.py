"""Which fields a running service may change, and which only where it is deployed."""

from __future__ import annotations

# Fields a running service applies between steps or batches; any other change takes effect at its next start.
LIVE_FIELDS = (
    "train.learning_rate",
    "train.kl.coef",
    "train.entropy_coef",
    "train.clip",
    "train.max_grad_norm",
    "train.max_staleness",
    "train.log_interval",
    "sampling.temperature",
    "sampling.top_p",
    "sampling.max_new_tokens",
    "reward.functions",
    "alerts",
    "checkpoint.save_every_steps",
    "checkpoint.keep_last",
    "data.eval_every_steps",
)
# Fields that say which run and broker a service belongs to: set where it is deployed, never through the admin.
DEPLOY_TIME_FIELDS = ("run_id", "nats.url", "nats.nkey_seed_file", "nats.tls_ca_file")


def is_live(key: str) -> bool:
    return any(key == live or key.startswith(live + ".") for live in LIVE_FIELDS)
