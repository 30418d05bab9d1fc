"""Alert rules: the rule model, the alerts section, and the rules a run has by default."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from services.common.config.base import Live, Section, Security

AlertCondition = Literal["above", "below", "nan", "absent", "rises_by", "falls_by"]
AlertAction = Literal["notify", "pause", "stop", "rollback"]


class AlertRule(Section):
    """One rule over a metric of the trainer's step rows (or a status metric such as services_down).

    above/below: every value of the last ``window_steps`` rows is beyond ``threshold``.
    nan: the newest value is NaN or infinite.
    absent: no row has carried the metric for ``window_s`` seconds.
    rises_by/falls_by: the mean of the last ``window_steps`` values differs from the mean
    of the ``window_steps`` before them by more than ``threshold`` (relative, 1.0 = doubled).
    """

    name: str = Field(
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="names the rule in firings and logs (1-64 letters, digits, _ . -)",
    )
    metric: str = Field(description="a metric of the trainer's step rows or a status metric (docs/metrics.md)")
    condition: AlertCondition = Field(description="above | below | nan | absent | rises_by | falls_by (see above)")
    threshold: float = Field(
        default=0.0, description="the bound, in the metric's unit; relative for rises_by/falls_by (1.0 = doubled)"
    )
    window_steps: int = Field(default=1, ge=1, description="step rows the condition is judged over (steps)")
    window_s: float = Field(default=60.0, gt=0, description="for absent: how long the metric may be missing (seconds)")
    severity: Literal["info", "warning", "critical"] = Field(default="warning", description="carried by the firing")
    actions: list[AlertAction] = Field(
        default_factory=lambda: ["notify"],
        description="notify (log and webhook) | pause | stop | rollback (to the last stable checkpoint), in order",
    )


def default_alert_rules() -> list[AlertRule]:
    """The operator's usual worries, with thresholds loose enough not to fire on a healthy run."""
    rules = [
        {"name": "entropy_collapse", "metric": "entropy", "condition": "below", "threshold": 0.02, "window_steps": 5},
        {"name": "kl_too_high", "metric": "kl_ref", "condition": "above", "threshold": 1.0, "window_steps": 5},
        {
            "name": "reward_std_explodes",
            "metric": "reward_std",
            "condition": "rises_by",
            "threshold": 10.0,
            "window_steps": 10,
        },
        {
            "name": "response_length_runaway",
            "metric": "response_length_mean",
            "condition": "rises_by",
            "threshold": 1.0,
            "window_steps": 20,
        },
        {
            "name": "termination_rate_falls",
            "metric": "termination_rate",
            "condition": "below",
            "threshold": 0.5,
            "window_steps": 10,
        },
        {
            "name": "step_time_regression",
            "metric": "step_time_s",
            "condition": "rises_by",
            "threshold": 2.0,
            "window_steps": 20,
        },
        {
            "name": "checkpoint_failures",
            "metric": "checkpoint_failed",
            "condition": "above",
            "threshold": 0.0,
            "severity": "critical",
        },
        {
            "name": "nan_loss",
            "metric": "loss",
            "condition": "nan",
            "severity": "critical",
            "actions": ["notify", "pause"],
        },
        {
            "name": "service_down",
            "metric": "services_down",
            "condition": "above",
            "threshold": 0.0,
            "window_steps": 3,
            "severity": "critical",
        },
        {
            # A group neither applied, dropped nor dead-lettered within train.lost_after_s: samples went missing.
            "name": "groups_lost",
            "metric": "groups_lost",
            "condition": "above",
            "threshold": 0.0,
            "severity": "critical",
        },
        {
            # Under 5% of the GPU's memory free for 3 steps: the next longer batch is an OOM. Only CUDA runs
            # carry the metric (services/common/observe/hardware.py), and a rule whose metric is absent is not judged.
            "name": "gpu_memory_headroom",
            "metric": "memory/headroom_frac",
            "condition": "below",
            "threshold": 0.05,
            "window_steps": 3,
        },
        {
            # No step for 15 minutes while the run is not paused: a stage stopped, hung or starved the trainer.
            "name": "steps_absent",
            "metric": "step_time_s",
            "condition": "absent",
            "window_s": 900.0,
            "severity": "critical",
        },
        {
            # Roles whose every live replica's loop made no progress for 2 * nats.max_work_s (the health rows,
            # every few seconds, carry the count; services/common/transport/presence.py).
            "name": "role_stalled",
            "metric": "roles_stalled",
            "condition": "above",
            "threshold": 0.0,
            "window_steps": 3,
            "severity": "critical",
        },
        {
            # Every group scored alike for 10 steps: GRPO advantages are all zero and nothing is learned
            # (a broken reward function, or prompts far too easy or too hard).
            "name": "zero_reward_variance",
            "metric": "zero_variance_groups",
            "condition": "above",
            "threshold": 0.999,
            "window_steps": 10,
        },
        {
            # Applied groups come from policies more than 4 versions old on average: rollouts cannot keep up
            # or do not receive new weights.
            "name": "staleness_high",
            "metric": "staleness_mean",
            "condition": "above",
            "threshold": 4.0,
            "window_steps": 10,
        },
        {
            # A role restarted more than 3 times within supervision.restart_window_s: a crash loop.
            "name": "restart_loop",
            "metric": "role_restarts",
            "condition": "above",
            "threshold": 3.0,
            "severity": "critical",
        },
        {
            # Most of a multi-turn run's episodes ended because the environment raised or answered off the schema,
            # for 3 steps: a broken plugin or environment service (its episodes still train, on what they got).
            # Single-turn runs carry no agent/ keys, and a rule whose metric is absent is not judged.
            "name": "environment_errors",
            "metric": "agent/outcome/env_error",
            "condition": "above",
            "threshold": 0.5,
            "window_steps": 3,
        },
        {
            # Most episodes ended waiting on the environment past rollout.environment_timeout_s, for 3 steps.
            "name": "environment_timeouts",
            "metric": "agent/outcome/timeout",
            "condition": "above",
            "threshold": 0.5,
            "window_steps": 3,
        },
        {
            # The trainer's link busier than 0.8 of telemetry.link_mib_s in one direction for 5 steps: the bus and the
            # weights it serves queue behind each other, so steps wait on the network. Only with link_mib_s set (the
            # metric is absent otherwise, and a rule whose metric is absent is not judged).
            "name": "network_saturated",
            "metric": "network/link_use_frac",
            "condition": "above",
            "threshold": 0.8,
            "window_steps": 5,
        },
        {
            # Free space on the runs directory (and a file:// store) is less than two saves need.
            "name": "disk_space_low",
            "metric": "disk_free_saves",
            "condition": "below",
            "threshold": 2.0,
            "severity": "critical",
        },
    ]
    return [AlertRule(**rule) for rule in rules]


class AlertsConfig(Section):
    enabled: Live[bool] = Field(default=True, description="judge the rules; false = no alert fires")
    webhook_url: Security[str] = Field(default="", description="each firing is POSTed here as JSON; empty = log only")
    webhook_retries: Live[int] = Field(
        default=3,
        ge=0,
        description="retries of a failed webhook POST (an error or a non-2xx answer), with doubling backoff",
    )
    webhook_backoff_s: Live[float] = Field(
        default=1.0, gt=0, description="wait before the first webhook retry, doubled after"
    )
    heartbeat_s: Live[float] = Field(
        default=300.0,
        ge=0,
        description="the trainer POSTs a `watchdog` firing to the webhook this often (0 = never), so a dead-man "
        "receiver notices when alerts could no longer reach anyone",
    )
    cooldown_steps: Live[int] = Field(default=20, ge=0, description="a rule that fired stays quiet this many steps")
    rules: Live[list[AlertRule]] = Field(
        default_factory=default_alert_rules,
        description="the rules judged after every step; setting them replaces the defaults (listed below)",
    )

    @field_validator("rules")
    @classmethod
    def _unique_names(cls, rules: list[AlertRule]) -> list[AlertRule]:
        names = [rule.name for rule in rules]
        if len(names) != len(set(names)):
            raise ValueError(f"rule names must be unique, got {names}")
        return rules
