"""The metrics contract: every key a row of ``metrics.jsonl`` may carry, declared once.

Each declaration gives the row key (the JSON key on disk, unchanged for the tools and people that read the file),
what it means, its kind and unit, and its name in the experiment trackers. Everything else is derived from this
table: the step keys the trainer exports as ``rlpipe_trainer_<key>`` gauges (``TRAINER_STEP_KEYS``), the trackers'
names (``tracker_name``), the readers' constants (``services/common/observe/records.py`` reads rows through them),
and the table in docs/metrics.md (``python -m services.common.observe.metrics_reference``; a unit test fails while
the checked-in copy differs).

A key that varies with the run (one per reward function, one per role) is declared once as a ``Family`` whose key
holds placeholders: ``reward/<fn>/mean``. A family with ``values`` is closed (``agent/outcome/<outcome>`` takes
only the six outcomes) and can be exported per value; one without is open.

The declarations' types (``Kind``, ``Group``, ``Metric``, ``Family``) are services/common/observe/metric_types.py's.
To add a metric, add one line below in its group; a row that carries an undeclared key is logged once by the
trainer's metrics writer (``UndeclaredKeys``) and fails the tests that read real runs' rows (``check_row``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from services.common.observe.events import Event
from services.common.observe.logs import log_event
from services.common.observe.metric_types import Family, Group, Kind, Metric, default_tracker_name
from services.common.observe.timeshare import StepPhase

log = logging.getLogger(__name__)


_TABLE: list[Metric | Family] = []


class Declare:
    """Declares the metrics of one group, in the order the docs list them."""

    def __init__(self, group: Group):
        self.group = group

    def metric(
        self, key: str, kind: Kind, unit: str, description: str, tracker: str = "", exported: bool = False
    ) -> Metric:
        declared = Metric(key, self.group, kind, unit, description, tracker, exported)
        _TABLE.append(declared)
        return declared

    def family(
        self,
        pattern: str,
        kind: Kind,
        unit: str,
        description: str,
        values: Iterable[str] | None = None,
        exported: bool = False,
    ) -> Family:
        frozen = None if values is None else tuple(values)
        declared = Family(pattern, self.group, kind, unit, description, frozen, exported)
        _TABLE.append(declared)
        return declared


GAUGE, COUNTER, RATE, INDEX, TEXT = Kind.GAUGE, Kind.COUNTER, Kind.RATE, Kind.INDEX, Kind.TEXT
# Episode.outcome's values (services/common/transport/messages.py, which observe may not import; a test compares).
EPISODE_OUTCOMES = ("done", "max_turns", "max_tokens", "env_error", "timeout", "truncated")

# The table. Kept out of the formatter so that each declaration stays a line or two.
# fmt: off
row = Declare(Group.ROW)
TIME = row.metric("time", INDEX, "s", "unix time the row was made (not when it was written)")
STEP = row.metric("step", INDEX, "step", "the trainer step the row belongs to; the trackers log every value at it",
                  exported=True)
POLICY_VERSION = row.metric("policy_version", COUNTER, "version", "weight version the step produced",
                            tracker="actor/policy_version", exported=True)
CONFIG_VERSION = row.metric("config_version", GAUGE, "version", "live config version in force (rlpipe config set)",
                            tracker="config/version")

policy = Declare(Group.POLICY)
LOSS = policy.metric("loss", GAUGE, "", "the policy's total loss (policy gradient + KL and entropy terms); NaN on a "
                     "skipped step", tracker="actor/loss", exported=True)
PG_LOSS = policy.metric("pg_loss", GAUGE, "", "the clipped surrogate (policy-gradient) loss", tracker="actor/pg_loss",
                        exported=True)
ENTROPY = policy.metric("entropy", GAUGE, "nats/token", "mean token entropy of the policy on the sampled responses",
                        tracker="actor/entropy", exported=True)
KL_REF = policy.metric("kl_ref", GAUGE, "nats/token", "KL estimate (train.kl.estimator) to the frozen reference model",
                       tracker="actor/kl_ref", exported=True)
APPROX_KL = policy.metric("approx_kl", GAUGE, "nats/token", "mean(old logprob - new logprob): how far the update "
                          "moved the policy", tracker="actor/ppo_kl", exported=True)
CLIPFRAC = policy.metric("clipfrac", RATE, "fraction", "share of tokens whose ratio was clipped",
                         tracker="actor/pg_clipfrac", exported=True)
CLIPFRAC_LOWER = policy.metric("clipfrac_lower", RATE, "fraction", "share of tokens the dual clip bounded (negative "
                               "advantages)", tracker="actor/pg_clipfrac_lower", exported=True)
GRAD_NORM = policy.metric("grad_norm", GAUGE, "", "gradient norm before clipping to train.max_grad_norm",
                          tracker="actor/grad_norm", exported=True)
LEARNING_RATE = policy.metric("learning_rate", GAUGE, "", "the learning rate this step", tracker="actor/lr",
                              exported=True)
# The off-policy ratio rho = pi_old / pi_rollout over the step's sampled tokens, with train.old_logprobs: recompute,
# and what train.off_policy's correction made of it (docs/algorithms.md).
OFF_POLICY_RATIO = policy.family("off_policy/ratio_<quantile>", GAUGE, "ratio", "the ratio pi_old / pi_rollout over "
                                 "the step's sampled tokens, at this quantile (with train.old_logprobs: recompute)",
                                 values=("min", "p5", "p50", "p95", "max"), exported=True)
OFF_POLICY_RATIO_P50 = OFF_POLICY_RATIO.of("p50")
OFF_POLICY_MISMATCH_KL = policy.metric("off_policy/mismatch_kl", GAUGE, "nats/token", "mean of rho - log rho - 1: "
                                       "an estimate of KL(pi_rollout || pi_old), 0 when the trainer scores as the "
                                       "sampler did", exported=True)
OFF_POLICY_WEIGHT_MEAN = policy.metric("off_policy/weight_mean", GAUGE, "", "mean weight of the "
                                       "train.off_policy correction (masked tokens count as 0)", exported=True)
OFF_POLICY_WEIGHT_MAX = policy.metric("off_policy/weight_max", GAUGE, "", "largest weight of the train.off_policy "
                                      "correction", exported=True)
OFF_POLICY_MASKED_TOKENS = policy.metric("off_policy/masked_token_fraction", RATE, "fraction", "share of sampled "
                                         "tokens the correction masked", exported=True)
OFF_POLICY_MASKED_SEQUENCES = policy.metric("off_policy/masked_sequence_fraction", RATE, "fraction", "share of "
                                            "responses with at least one token the correction masked", exported=True)
UPDATES_SKIPPED = policy.metric("updates_skipped", COUNTER, "updates", "optimizer updates of the step left out "
                                "because a loss or gradient was not finite")

critic = Declare(Group.CRITIC)
VALUE_LOSS = critic.metric("value_loss", GAUGE, "", "the critic's clipped value loss", tracker="critic/vf_loss",
                           exported=True)
VALUE_CLIPFRAC = critic.metric("value_clipfrac", RATE, "fraction", "share of values the value clip bounded",
                               tracker="critic/vf_clipfrac", exported=True)
EXPLAINED_VARIANCE = critic.metric("explained_variance", GAUGE, "", "1 - Var(returns - values)/Var(returns): how "
                                   "much of the return the critic predicts", tracker="critic/vf_explained_var")
VALUE_MEAN = critic.metric("value_mean", GAUGE, "", "mean critic value on response tokens",
                           tracker="critic/values/mean")
CRITIC_ONLY = critic.metric("critic_only", GAUGE, "flag", "1 on steps that train only the critic "
                            "(train.critic.warmup_steps)", tracker="critic/warmup_step")

batch = Declare(Group.BATCH)
REWARD_MEAN = batch.metric("reward_mean", GAUGE, "", "reward over the batch's completions; every step row carries it",
                           tracker="reward/mean", exported=True)
REWARD_STD = batch.metric("reward_std", GAUGE, "", "standard deviation of the reward over the batch's completions",
                          tracker="reward/std", exported=True)
REWARD_PART = batch.family("reward/<fn>/mean", GAUGE, "", "one reward part before weighting (a rule function, "
                           "`model`, `http`, `overlong`: DAPO's soft overlong penalty in [-1, 0]), over the "
                           "completions that carry it")
ADVANTAGE_MEAN = batch.metric("advantage_mean", GAUGE, "", "mean advantage the update used",
                              tracker="critic/advantages/mean")
ADVANTAGE_STD = batch.metric("advantage_std", GAUGE, "", "standard deviation of the advantages the update used",
                             tracker="critic/advantages/std", exported=True)
ZERO_VARIANCE_GROUPS = batch.metric("zero_variance_groups", RATE, "fraction", "share of groups whose completions all "
                                    "scored the same: no GRPO signal", tracker="reward/zero_variance_groups",
                                    exported=True)
RESPONSE_LENGTH_MEAN = batch.metric("response_length_mean", GAUGE, "tokens", "mean response length",
                                    tracker="response_length/mean", exported=True)
RESPONSE_LENGTH_MAX = batch.metric("response_length_max", GAUGE, "tokens", "longest response",
                                   tracker="response_length/max", exported=True)
TERMINATION_RATE = batch.metric("termination_rate", RATE, "fraction", "share of responses that ended with EOS",
                                tracker="response_length/terminated_ratio", exported=True)
TRUNCATION_RATE = batch.metric("truncation_rate", RATE, "fraction", "share of responses cut at "
                               "sampling.max_new_tokens", tracker="response_length/clip_ratio", exported=True)
GENERATED_BY_VERSION_MIN = batch.metric("generated_by_version_min", GAUGE, "version", "oldest policy version that "
                                        "generated the batch", tracker="rollout/policy_version_min")
GENERATED_BY_VERSION_MAX = batch.metric("generated_by_version_max", GAUGE, "version", "newest policy version that "
                                        "generated the batch", tracker="rollout/policy_version_max")
STALENESS_MEAN = batch.metric("staleness_mean", GAUGE, "versions", "mean policy versions between a group's "
                              "generation and its use", tracker="rollout/staleness_mean", exported=True)
MIXED_VERSION_FRACTION = batch.metric("mixed_version_fraction", RATE, "fraction", "share of the step's completions "
                                      "whose sampled tokens came from more than one policy version "
                                      "(rollout.inflight_updates, or a sync between an episode's turns)",
                                      tracker="rollout/mixed_version_fraction", exported=True)
STALENESS_MAX = batch.metric("staleness_max", GAUGE, "versions", "most policy versions between a group's generation "
                             "and its use", tracker="rollout/staleness_max", exported=True)
GROUPS = batch.metric("groups", COUNTER, "groups", "groups in the step", tracker="rollout/groups")
COMPLETIONS = batch.metric("completions", COUNTER, "completions", "completions in the step",
                           tracker="rollout/completions")
DROPPED_STALE = batch.metric("dropped_stale", COUNTER, "groups", "groups dropped for exceeding train.max_staleness",
                             tracker="rollout/dropped_stale", exported=True)
GROUPS_FILTERED = batch.metric("groups_filtered", COUNTER, "groups", "groups train.dynamic_sampling left out of the "
                               "step's batch; absent with it off", tracker="pipeline/groups_filtered", exported=True)
DYNAMIC_SAMPLING_DROPPED = batch.metric("dynamic_sampling/dropped_fraction", RATE, "fraction", "share of the step's "
                                        "usable groups train.dynamic_sampling left out (all rewards equal); absent "
                                        "with it off", exported=True)

time_ = Declare(Group.TIME)
STEP_TIME_S = time_.metric("step_time_s", GAUGE, "s", "wall time of the learner's update", tracker="perf/step_time_s",
                           exported=True)
TOKENS_PER_S = time_.metric("tokens_per_s", RATE, "tokens/s", "tokens trained per second of update",
                            tracker="perf/throughput_tokens_per_s", exported=True)
TIME_SPLIT = time_.family("time/<phase>_s", GAUGE, "s", "the wall time since the previous step row, by phase: "
                          "collecting experience (wait), the learner's step (compute), offering the new weights "
                          "(publish), evaluating (eval), the rest (bookkeeping: ledger, lineage, metrics, "
                          "checkpoints, commands); together the whole interval. Publishing runs in the background: "
                          "publish is what the loop waits for it", values=StepPhase, exported=True)
WEIGHTS_OFFER_S = time_.metric("weights/offer_s", GAUGE, "s", "the background time, from offer to served (copy to "
                               "host memory, its check, serving), of the newest version served by then; step N's row "
                               "usually carries version N-1's (absent before the first is served)")

pipeline = Declare(Group.PIPELINE)
GROUPS_DEAD = pipeline.metric("groups_dead", COUNTER, "groups", "fed groups dead-lettered since the last step row",
                              tracker="pipeline/groups_dead")
GROUPS_REOPENED = pipeline.metric("groups_reopened", COUNTER, "groups", "dead groups re-injected since the last step "
                                  "row (each stays counted dead too)", tracker="pipeline/groups_reopened")
GROUPS_LOST = pipeline.metric("groups_lost", COUNTER, "groups", "fed groups written off as lost since the last row",
                              tracker="pipeline/groups_lost")
REPEATS_DROPPED = pipeline.metric("repeats_dropped", COUNTER, "groups", "copies of settled groups refused since the "
                                  "last step row", tracker="pipeline/repeats_dropped")
IN_FLIGHT_GROUPS = pipeline.metric("in_flight_groups", GAUGE, "groups", "groups fed and not yet settled",
                                   tracker="pipeline/in_flight_groups")
SERVICES_DOWN = pipeline.metric("services_down", GAUGE, "roles", "roles without a live replica",
                                tracker="pipeline/services_down")
ROLES_STALLED = pipeline.metric("roles_stalled", GAUGE, "roles", "roles whose loop has made no progress for "
                                "2 * nats.max_work_s")
ROLE_RESTARTS = pipeline.metric("role_restarts", GAUGE, "starts", "most restarts of one role within "
                                "supervision.restart_window_s")
DISK_FREE_SAVES = pipeline.metric("disk_free_saves", GAUGE, "saves", "how many saves the fullest local disk a save "
                                  "writes to still has room for")
TIME_SHARE = pipeline.family("share/<role>/<activity>", RATE, "fraction", "each role's fractions of its loop time "
                             "since its replicas started (presence): busy (computing), idle (waiting for input), "
                             "blocked (waiting to publish or for weights); the stages export the seconds as "
                             "`rlpipe_stage_time_seconds_total{activity}`")

agent = Declare(Group.AGENT)
AGENT_TURNS = agent.metric("agent/turns_mean", GAUGE, "turns", "turns per episode in the step", exported=True)
AGENT_TOOL_CALLS = agent.metric("agent/tool_calls_mean", GAUGE, "calls", "tool calls per episode", exported=True)
AGENT_TOOL_ERRORS = agent.metric("agent/tool_errors_mean", GAUGE, "calls", "failed tool calls per episode",
                                 exported=True)
AGENT_ENV_SECONDS = agent.metric("agent/env_seconds_mean", GAUGE, "s", "seconds in the environment per episode",
                                 exported=True)
AGENT_OUTCOME = agent.family("agent/outcome/<outcome>", RATE, "fraction", "share of the step's episodes that ended "
                             "so (every outcome present, 0 if none)", values=EPISODE_OUTCOMES, exported=True)

hardware = Declare(Group.HARDWARE)
HOST_RSS_GB = hardware.metric("memory/host_rss_gb", GAUGE, "GiB", "the trainer process's resident set size",
                              exported=True)
CUDA_ALLOCATED_GB = hardware.metric("memory/allocated_gb", GAUGE, "GiB", "CUDA memory held by live tensors",
                                    exported=True)
CUDA_RESERVED_GB = hardware.metric("memory/reserved_gb", GAUGE, "GiB", "CUDA memory held by torch's caching "
                                   "allocator", exported=True)
CUDA_PEAK_GB = hardware.metric("memory/peak_gb", GAUGE, "GiB", "most CUDA memory allocated within the step",
                               exported=True)
CUDA_HEADROOM = hardware.metric("memory/headroom_frac", RATE, "fraction", "free / total device memory (other "
                                "processes on the GPU count as used)", exported=True)
GPU_UTIL = hardware.metric("gpu/util_pct", RATE, "%", "% of NVML's last sample period a kernel ran", exported=True)
GPU_MEM_USED_GB = hardware.metric("gpu/mem_used_gb", GAUGE, "GiB", "device memory in use, all processes",
                                  exported=True)
GPU_MEM_TOTAL_GB = hardware.metric("gpu/mem_total_gb", GAUGE, "GiB", "device memory", exported=True)
ROLE_GPU_MEMORY = hardware.family("memory/<role>/<figure>_gb", GAUGE, "GiB", "GPU memory of a role's live replicas "
                                  "summed, from their presence entries: figure allocated or reserved (torch's "
                                  "allocator) or used (NVML); observe/gpu_memory.py. Each role also exports "
                                  "`rlpipe_role_gpu_memory_bytes{role,kind}` itself")
MFU = hardware.metric("perf/mfu", RATE, "fraction", "the learner's model FLOPs utilization: the step's model FLOPs "
                      "over its wall time and the device's bfloat16 peak (observe/flops.py); absent where the peak "
                      "is unknown (a CPU)", exported=True)

network = Declare(Group.NETWORK)
NETWORK_BUS_IN = network.metric("network/bus_in_bytes_per_s", RATE, "B/s", "NATS payload bytes the trainer read per "
                                "second since the previous step row", exported=True)
NETWORK_BUS_OUT = network.metric("network/bus_out_bytes_per_s", RATE, "B/s", "NATS payload bytes the trainer wrote "
                                 "per second since the previous step row", exported=True)
NETWORK_WEIGHT_SYNC_OUT = network.metric("network/weight_sync_out_bytes_per_s", RATE, "B/s", "weight-sync bytes the "
                                         "trainer served per second since the previous step row", exported=True)
NETWORK_LINK_USE = network.metric("network/link_use_frac", RATE, "fraction", "the busier direction's share of "
                                  "telemetry.link_mib_s (absent without it)", exported=True)

evaluation = Declare(Group.EVAL)
EVAL_ACCURACY = evaluation.metric("eval_accuracy", RATE, "fraction", "held-out accuracy (greedy); every eval row "
                                  "carries it", tracker="eval/accuracy")
EVAL_TIME_S = evaluation.metric("eval_time_s", GAUGE, "s", "time the evaluation took", tracker="eval/time_s")
EVAL_REWARD_MEAN = evaluation.metric("eval/reward_mean", GAUGE, "", "a multi-turn run's held-out episodes (greedy, "
                                     "with its environment): mean reward")
EVAL_TURNS = evaluation.metric("eval/turns_mean", GAUGE, "turns", "a multi-turn run's held-out episodes: turns per "
                               "episode")
EVAL_TOOL_CALLS = evaluation.metric("eval/tool_calls_mean", GAUGE, "calls", "a multi-turn run's held-out episodes: "
                                    "tool calls per episode")
EVAL_TOOL_ERRORS = evaluation.metric("eval/tool_errors_mean", GAUGE, "calls", "a multi-turn run's held-out "
                                     "episodes: failed tool calls per episode")

checkpoint = Declare(Group.CHECKPOINT)
CHECKPOINT_SAVED = checkpoint.metric("checkpoint_saved", COUNTER, "saves", "1 on the row of a checkpoint written",
                                     tracker="checkpoint/saved")
CHECKPOINT_FAILED = checkpoint.metric("checkpoint_failed", COUNTER, "saves", "1 on the row of a save that failed",
                                      tracker="checkpoint/failed")
CHECKPOINT_TIME_S = checkpoint.metric("checkpoint_time_s", GAUGE, "s", "time to store the checkpoint",
                                      tracker="checkpoint/time_s")
CHECKPOINT_STALL_S = checkpoint.metric("checkpoint_stall_s", GAUGE, "s", "how long taking the save's snapshot held "
                                       "the training loop (the upload runs in the background; also "
                                       "`rlpipe_checkpoint_stall_seconds` on the trainer's endpoint)",
                                       tracker="checkpoint/stall_s")
CHECKPOINT_LINEAGE_S = checkpoint.metric("checkpoint_lineage_s", GAUGE, "s", "of the stall, how long reading the "
                                         "lineage took (on a worker thread)", tracker="checkpoint/lineage_s")
ERROR = checkpoint.metric("error", TEXT, "", "why the save failed")

alert = Declare(Group.ALERT)
ALERT = alert.metric("alert", TEXT, "", "the rule that fired; the trackers get `alert/<rule>` = 1 at its step and a "
                     "text event")
ALERT_SEVERITY = alert.metric("alert_severity", TEXT, "", "the rule's severity: info, warning or critical")
# fmt: on
del row, policy, critic, batch, time_, pipeline, agent, hardware, evaluation, checkpoint, alert

METRICS: tuple[Metric, ...] = tuple(d for d in _TABLE if isinstance(d, Metric))
FAMILIES: tuple[Family, ...] = tuple(d for d in _TABLE if isinstance(d, Family))
DECLARED: tuple[Metric | Family, ...] = tuple(_TABLE)
_BY_KEY: dict[str, Metric] = {metric.key: metric for metric in METRICS}
if len(_BY_KEY) != len(METRICS):
    raise ValueError("a row key is declared twice")

# The step-row metrics the trainer exports, one gauge each; a fixed list keeps the scrape's size bounded.
EXPORTED: tuple[Metric, ...] = tuple(
    metric
    for declared in DECLARED
    for metric in ([declared] if isinstance(declared, Metric) else declared.members())
    if metric.exported
)
TRAINER_STEP_KEYS: tuple[str, ...] = tuple(metric.key for metric in EXPORTED)
# Carried by a row but not a metric: the wall clock and the step every value is logged at.
NOT_METRICS: frozenset[str] = frozenset(metric.key for metric in METRICS if metric.kind in (Kind.INDEX, Kind.TEXT))


@functools.lru_cache(maxsize=4096)
def find(key: str) -> Metric | None:
    """The declaration of the row key ``key`` (a family's member made concrete), or None when it is undeclared."""
    if key in _BY_KEY:
        return _BY_KEY[key]
    for family in FAMILIES:
        parts = family.parts(key)
        if parts is not None:
            return family.of(*parts)
    return None


def tracker_name(key: str) -> str:
    """The trackers' name of the row key ``key``; an undeclared key gets the default rule."""
    metric = find(key)
    return metric.tracker_name if metric is not None else default_tracker_name(key)


def undeclared(keys: Iterable[str]) -> list[str]:
    """The keys among ``keys`` the contract does not declare, in order."""
    return [key for key in keys if find(key) is None]


class UndeclaredMetric(ValueError):
    """A metrics row carries a key the contract does not declare."""


def check_row(row: Mapping[str, Any]) -> None:
    """Raise ``UndeclaredMetric`` naming every key of ``row`` the contract does not declare (the tests' check)."""
    unknown = undeclared(row)
    if unknown:
        raise UndeclaredMetric(
            f"metrics row keys not declared in services/common/observe/metrics.py: {', '.join(unknown)}"
        )


class UndeclaredKeys:
    """The production side of the check: each undeclared key is logged once (``undeclared_metric``) and the row is
    written as it is. A key missing from the contract is a gap in the docs and the derived lists, never a reason to
    lose a row or stop training."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def note(self, row: Mapping[str, Any]) -> None:
        for key in undeclared(key for key in row if key not in self.seen):
            self.seen.add(key)
            log_event(log, Event.UNDECLARED_METRIC, level=logging.WARNING, key=key)
