"""The run's event journal: every event name is an ``Event``, and one ``Journal.emit`` writes an event to each sink.

Event names are a contract: the launcher reads ``done`` and the operators' actions from ``events.jsonl`` (and the
refusals from its children's log lines), so do ``rlpipe verify`` and ``report``; the default alert rules and Loki
queries match them, tests and docs/operations.md name them. So they are members of one ``StrEnum`` (a member is
its string: the JSON is unchanged), and ``log_event`` takes nothing else (tests/common/test_events.py scans every
call).

The sinks of one event:

- the log line (``log_event``): always; the only sink of a component without a run record (bus, stage, rollout);
- ``runs/<run>/events.jsonl`` (``EventLog``): the events in ``RECORDED_AS``, what happened to the run besides
  its steps, under the kind their readers know (``paused`` is recorded as ``pause``);
- a role's own ``JournalSink``s: the trainer's alert sink turns an ``alert`` into its metrics row (and so the
  trackers' text event), its Prometheus counter and its webhook POST.

A call site emits once, ``journal.emit(Event.PAUSED, reason, step=step, reason=reason)``, and each sink takes
what it keeps. ``events.jsonl`` holds one JSON line per recorded event: ``{"time", "step", "kind", "message",
...}``. The report marks them on its curves; operators read them to line up a metric swing with its cause.

Two processes write it, the launcher (restarts) and the trainer (everything else), each line
whole: past ``telemetry.jsonl_max_mib`` it rolls to ``events.00001.jsonl`` and so on like
``metrics.jsonl`` (``RollingJsonl``, whose lock lets either writer roll it), the oldest part deleted
past ``telemetry.jsonl_keep_parts``. Readers go through
``jsonl_parts``: ``records.read_events`` for the whole record (typed as ``EventRecord``), ``JsonlFollower`` to
follow it.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from services.common.config import RunConfig, hide_url_secrets
from services.common.observe.logs import RollingJsonl, log_event


class Event(StrEnum):
    """Every event rlpipe logs or records, one per line, sorted; the comment says when it is emitted."""

    ACK_FAILED = "ack_failed"  # a stage could not ack or hand back a message (its broker away)
    ADMIN_READ_ONLY_REFUSED = "admin_read_only_refused"  # an Admin call that changes the run came with the read token
    ADMIN_SOURCE_REFUSED = "admin_source_refused"  # an Admin call from outside admin.allowed_sources was refused
    ADMIN_TOKENS_EQUAL = "admin_tokens_equal"  # a rotation made the read and admin tokens equal: it only reads (alert)
    ADMIN_TOKEN_EMPTY = "admin_token_empty"  # the trainer's admin token file is empty: admin calls are refused
    ADMIN_TOKEN_ROTATED = "admin_token_rotated"  # the admin token file changed and was read again
    ADMIN_TOKEN_UNREADABLE = "admin_token_unreadable"  # the admin token file cannot be read
    ADMIN_UNAUTHENTICATED = "admin_unauthenticated"  # an Admin call came with neither token (method and peer named)
    ADOPTION_SERVE_RETRY = "adoption_serve_retry"  # a resume's or rollback's weights were not served: tried again
    ADOPTION_UNSERVED = "adoption_unserved"  # a resume's or rollback's weights could not be served: not done
    ALERT = "alert"  # an alert rule fired (log, events.jsonl, metrics row, Prometheus counter, webhook)
    ALERT_ROLLBACK_FAILED = "alert_rollback_failed"  # an alert's rollback failed: the run is paused
    ALERT_WEBHOOK_FAILED = "alert_webhook_failed"  # an alert's webhook POST failed after its retries
    ALERT_WEBHOOK_RETRY = "alert_webhook_retry"  # an alert's webhook POST failed and is tried again
    BATCH_FAILED = "batch_failed"  # a stage's batch raised: its messages are retried or dead-lettered
    BROKER_CALL_FAILED = "broker_call_failed"  # the trainer's intake could not reach the broker; backs off
    BROKER_STATE_LOST = "broker_state_lost"  # the broker came back without this run's messages: the trainer refuses
    BUILD = "build"  # the trainer's build and config version, at start
    BUS_RECONNECTED = "bus_reconnected"  # the NATS connection came back
    BUS_RESTORED = "bus_restored"  # streams and consumers restored after a reconnect
    BUS_RESTORE_FAILED = "bus_restore_failed"  # streams or consumers could not be restored after a reconnect
    BUS_RESTORE_RETRY = "bus_restore_retry"  # restoring streams after a reconnect failed and is tried again
    BUS_UNAVAILABLE = "bus_unavailable"  # a read from the broker failed; retried with backoff
    CHECKPOINT = "checkpoint"  # a checkpoint was stored
    CHECKPOINTS_ABANDONED = "checkpoints_abandoned"  # checkpoints after a rollback's step were marked abandoned
    CHECKPOINT_DEFERRED = "checkpoint_deferred"  # a save was skipped: the previous upload still runs
    CHECKPOINT_FAILED = "checkpoint_failed"  # a save failed; training goes on
    CHECKPOINT_FALLBACK = "checkpoint_fallback"  # a resume passed over newer checkpoints (recorded)
    CHECKPOINT_RECORD_FAILED = "checkpoint_record_failed"  # a stored step could not be noted in the run folder: held
    CHECKPOINT_RECORD_RETRY = "checkpoint_record_retry"  # noting a stored step in the run folder failed once
    CHECKPOINT_REPLACED = "checkpoint_replaced"  # a torn or foreign checkpoint at a step was replaced
    CHECKPOINT_SIZE_UNKNOWN = "checkpoint_size_unknown"  # the status could not size the newest checkpoint
    CHECKPOINT_SKIPPED = "checkpoint_skipped"  # a checkpoint that cannot be read was passed over
    CLAIM_DELETE_FAILED = "claim_delete_failed"  # a consumed claim body could not be deleted (lifecycle rule's now)
    CLAIM_KEPT = "claim_kept"  # a consumed claim body was left to the lifecycle rule: a letter or a twin may read it
    CLAIM_MISSING_AFTER_LAPSE = "claim_missing_after_lapse"  # a lapsed delivery's body is gone: handed back, not DEAD
    CLAIM_UNAVAILABLE = "claim_unavailable"  # a claim-checked body cannot be read yet
    COMMAND_SKIPPED = "command_skipped"  # an admin command was dropped: its caller went away
    COMPUTE_FAILED = "compute_failed"  # a stage's compute failed for one message
    CONFIG_APPLIED = "config_applied"  # a role put a new config version in force
    CONFIG_CHANGE = "config_change"  # the trainer put a new config version in force (recorded)
    CONFIG_POLL_FAILED = "config_poll_failed"  # reading the live config bucket failed
    CONFIG_REJECTED = "config_rejected"  # a stored config version failed validation and was not applied
    CONFIG_UPDATED = "config_updated"  # an operator stored a config version through the admin API
    CONSUMER_UPDATED = "consumer_updated"  # a stream consumer's settings were changed to the config's
    CONTROL_NOT_STORED = "control_not_stored"  # a pause or stop could not be stored in the config bucket
    CRASHED = "crashed"  # a role's process died of an exception; the line carries its traceback
    CRASH_LOOP = "crash_loop"  # a role crashed twice alike with no progress between: the launcher ends the run
    DATA_ROW_SKIPPED = "data_row_skipped"  # a dataset row that cannot be read was skipped
    DEAD_LETTER = "dead_letter"  # a message was moved to the DEAD stream with its reason
    # A DEAD message its subject does not vouch for (another stream's letter, a record off the operator's subject):
    # the trainer ignores it (alert: some stage's key writes what it should not)
    DEAD_LETTER_FORGED = "dead_letter_forged"
    DEAD_LETTER_OF_REINJECTED_IGNORED = "dead_letter_of_reinjected_ignored"  # a dead letter of a re-injected copy
    DEPENDENCY_DOWN = "dependency_down"  # a stage's dependency is down past its bound, or refuses it (alert)
    DEPENDENCY_RECOVERED = "dependency_recovered"  # a stage's dependency answers again (recorded by the trainer)
    DEPENDENCY_REFUSED = "dependency_refused"  # a dependency refuses a replica: token, TLS, DNS (recorded, alert)
    DEPENDENCY_UNAVAILABLE = "dependency_unavailable"  # a stage's dependency failed; the batch is retried
    DONE = "done"  # the trainer finished its steps or was stopped (the launcher ends the run)
    DRAINING = "draining"  # a stage stops taking work and hands back what it holds
    DYNAMIC_SAMPLING_FILTERING_MOST = "dynamic_sampling_filtering_most"  # filtering ten batches to fill one (alert)
    ENDED_UNSAVED = "ended_unsaved"  # the trainer ended with applied steps not stored
    ENVIRONMENT_REQUEST_FAILED = "environment_request_failed"  # a request to an HTTP environment failed; retried
    ENVIRONMENT_RESET_FAILED = "environment_reset_failed"  # an environment reset failed; batch retried (alert)
    ENVIRONMENT_SERVICE_DOWN = "environment_service_down"  # an HTTP environment is down past its bound (alert)
    ENVIRONMENT_SERVICE_RECOVERED = "environment_service_recovered"  # an HTTP environment answers again
    ENVIRONMENT_STEP_FAILED = "environment_step_failed"  # an environment step failed; its episode ends, named
    EVAL = "eval"  # an evaluation finished
    EVENT_RECORD_FAILED = "event_record_failed"  # an event could not be written to events.jsonl (the log has it)
    FEED_FAILED = "feed_failed"  # a prompt could not be published; fed again later
    FEED_REFUSED = "feed_refused"  # the broker refuses a prompt itself (too large for PROMPTS): fed again, alert
    FEED_REPEATED = "feed_repeated"  # a prompt was fed again after its first publish was not confirmed
    FENCED_OUT = "fenced_out"  # a newer trainer's epoch is in the store: this one stops writing
    FOLLOWER_READY = "follower_ready"  # a distributed trainer's follower rank is ready
    FOLLOWER_STOPPED = "follower_stopped"  # a distributed trainer's follower rank stopped
    FOREIGN_DEAD_LETTER_IGNORED = "foreign_dead_letter_ignored"  # a dead letter of another incarnation
    FOREIGN_GROUP_DROPPED = "foreign_group_dropped"  # a group of another incarnation was dropped
    GPUS_WATCHED = "gpus_watched"  # a role watches the GPUs NVML shows it (once, at start)
    GPU_MEMORY_SHARE = "gpu_memory_share"  # a role with a share of its GPU capped its allocator, or says why not
    GPU_MEMORY_UNREADABLE = "gpu_memory_unreadable"  # a role's GPU memory reading failed: its figures skip a beat
    GROUPS_LOST = "groups_lost"  # groups overdue and nowhere in the pipeline were written off (recorded, alert)
    GROUPS_REOPENED_BY_ROLLBACK = "groups_reopened_by_rollback"  # a rollback put settled groups in flight (recorded)
    GROUP_LOST_TO_DEAD_LETTERS = "group_lost_to_dead_letters"  # a group's message was dead-lettered
    GROUP_REOPENED = "group_reopened"  # a dead letter's re-injection reopened its group
    HANDED_BACK_AT_STOP = "handed_back_at_stop"  # a stage stopping gave back, uncomputed, what its last fetch took
    LEASE_ACQUIRED = "lease_acquired"  # the trainer holds the run's lease
    LEASE_LOST = "lease_lost"  # the trainer lost the run's lease and stops
    LEASE_RECLAIMED = "lease_reclaimed"  # the lease ran out unrenewed, nobody took it, and the trainer took it back
    LEASE_RELEASE_FAILED = "lease_release_failed"  # releasing the lease failed; it expires on its own
    LEASE_RELEASE_SKIPPED = "lease_release_skipped"  # another trainer holds the lease now
    LEASE_RENEW_FAILED = "lease_renew_failed"  # renewing the lease failed; tried again
    LEASE_WAITING = "lease_waiting"  # another trainer holds the lease; waiting for it to expire
    LOOP_PROGRESSING = "loop_progressing"  # a stalled service loop moves again: health SERVING
    LOOP_STALLED = "loop_stalled"  # a service loop made no progress past its bound: health NOT_SERVING
    LORA_ADAPTER_UNAVAILABLE = (
        "lora_adapter_unavailable"  # vLLM cannot serve the LoRA adapter: the rollout merges it into the base instead
    )
    MARKED_STABLE = "marked_stable"  # a checkpoint was marked stable
    MIRROR_FAILED = "mirror_failed"  # a write to the checkpoint mirror failed
    MODEL_FETCHED = "model_fetched"  # model.path's S3 prefix or Hub repository was fetched into the cache folder
    OPTIMIZER_FRESH = "optimizer_fresh"  # a save without optimizer state was adopted: AdamW starts fresh (recorded)
    PAUSE = "pause"  # events.jsonl's kind of PAUSED
    PAUSED = "paused"  # training is held (an operator, an alert, or a hold kept over a restart)
    PORT_BUSY = "port_busy"  # a fixed gRPC port is still held by another socket: binding is tried again
    PRESENCE_FAILED = "presence_failed"  # a replica's presence entry could not be written
    PRESENCE_MALFORMED = "presence_malformed"  # a presence entry this build cannot read, or not its key's: left out
    PRESENCE_PRUNED = "presence_pruned"  # the trainer removed entries of replicas gone for presence_retention_s
    PRESENCE_UNREADABLE = "presence_unreadable"  # the trainer's status could not read the presence bucket
    PRESENCE_UPGRADED = "presence_upgraded"  # an older build's presence bucket now refuses rollups; old keys gone
    PRUNE_FAILED = "prune_failed"  # deleting an old checkpoint failed
    PURGED = "purged"  # consumed experience and its claim-checked bodies were deleted
    PURGE_FAILED = "purge_failed"  # purging consumed experience failed; tried at the next save
    PYTHON_TOOL_UNISOLATED = "python_tool_unisolated"  # no box here: the Python tool runs code unboxed, as allowed
    READY = "ready"  # a role is serving (its presence entry says so too: services.common.service.announce_ready)
    RECONNECT_LISTENER_FAILED = "reconnect_listener_failed"  # a callback after a reconnect raised
    REOPEN_REFUSED = "reopen_refused"  # a re-injected dead letter's group cannot be reopened
    REPEAT_DROPPED = "repeat_dropped"  # a copy of a settled group was dropped
    REPLAY_PURGED = "replay_purged"  # EXPERIENCE no longer holds what a resume would re-read
    RESTART = "restart"  # the launcher restarted a child or nats-server (recorded)
    RESUME = "resume"  # events.jsonl's kind of RESUMED
    RESUMED = "resumed"  # the trainer restored its run from a checkpoint
    RESUME_STEP_DONE = "resume_step_done"  # checkpoint.resume_step was already made: resuming from the newest
    RESUME_WAITING = "resume_waiting"  # the checkpoint store cannot be read at resume; waiting
    REWARD_FUNCTION_TIMEOUT = "reward_function_timeout"  # a reward function ran past its time limit
    REWARD_REQUEST_FAILED = "reward_request_failed"  # a request to the remote reward service failed
    REWARD_SERVICE_DOWN = "reward_service_down"  # the remote reward service is down (alert)
    REWARD_SERVICE_RECOVERED = "reward_service_recovered"  # the remote reward service answers again
    ROLLBACK = "rollback"  # events.jsonl's kind of ROLLED_BACK
    ROLLED_BACK = "rolled_back"  # the trainer went back to a checkpoint
    SCALED = "scaled"  # the launcher changed a stage role's replica count as an operator asked (recorded)
    SCALE_RECORD_MALFORMED = "scale_record_malformed"  # a stored replica count is not one this build reads: ignored
    SCALE_REQUESTED = "scale_requested"  # an operator asked the admin API for a stage role's replica count
    SERVED_VERSION_UNRECORDED = "served_version_unrecorded"  # the broker refused the served-version mark (warning)
    STALLED_EXIT = (
        "stalled_exit"  # a loop stalled past service.exit_when_stalled_s: the process exits 3 to be restarted
    )
    STARTUP_CHECK_FAILED = "startup_check_failed"  # a start-up check failed (exit 2)
    START_REFUSED = "start_refused"  # a role refused to start (exit 2; the launcher prints the reason)
    STEP = "step"  # a training step's metrics, every train.log_interval steps
    STEP_SKIPPED = "step_skipped"  # a step's update was skipped on non-finite numbers (recorded, alert)
    STOP = "stop"  # events.jsonl's kind of STOP_REQUESTED
    STOPPED = "stopped"  # a role drained and exits
    STOPPED_EARLY = "stopped_early"  # the trainer stopped before its last step
    STOP_REQUESTED = "stop_requested"  # the run was asked to drain and end
    STORE_RETRY = "store_retry"  # a checkpoint store call failed and is tried again
    STORE_UNREADABLE = "store_unreadable"  # a checkpoint store cannot be listed
    TRACKERS_OPEN = "trackers_open"  # the experiment trackers of telemetry.report_to are open
    TRACKER_FAILED = "tracker_failed"  # an experiment tracker failed to open, log or close; training goes on
    TRAINER_STATE_FOUND = "trainer_state_found"  # the trainer's streams and buckets exist: a role goes on starting
    UNDECLARED_METRIC = "undeclared_metric"  # a metrics row carries a key services/common/observe/metrics.py lacks
    UNPAUSE = "unpause"  # events.jsonl's kind of UNPAUSED
    UNPAUSED = "unpaused"  # an operator resumed training
    WAITING_FOR_TRAINER = "waiting_for_trainer"  # a role waits for the trainer to create the streams
    WARM_START_FAILED = "warm_start_failed"  # the launcher could not fork a role warm; every role starts cold
    WEIGHTS_LOADED = "weights_loaded"  # a rollout loaded a new policy version
    WEIGHT_RELAY_ADDRESS_REFUSED = "weight_relay_address_refused"  # a relay address off its watcher's host: left out
    WEIGHT_RELAY_FALLBACK = "weight_relay_fallback"  # a rollout pulled weights from the trainer, not a relay
    WEIGHT_RELAY_FORGED = "weight_relay_forged"  # a peer sent weights the trainer does not vouch for
    WEIGHT_RELAY_OFF = "weight_relay_off"  # the rollout cannot relay weights (no reachable address)
    WEIGHT_RELAY_PULL_FAILED = "weight_relay_pull_failed"  # pulling weights from a relay failed
    WEIGHT_SYNC_DEFERRED = "weight_sync_deferred"  # a rollout keeps its weights; the newer version is loaded later
    WEIGHT_SYNC_OPEN = "weight_sync_open"  # the trainer serves weights without a token (no RLPIPE_WEIGHTSYNC_TOKEN)
    WEIGHT_SYNC_TORN = "weight_sync_torn"  # a weight transfer was torn off; fetched again
    WEIGHT_WATCH_LOST = "weight_watch_lost"  # a rollout's watch on new weight versions broke; reconnecting
    WORK_TIMED_OUT = "work_timed_out"  # a stage's batch ran past its bound
    WRITER_FAILED = "writer_failed"  # a background writer's sink (metrics file, trackers) raised; rows go on


# The events written to events.jsonl, under the kind its readers (verify, report, the tuner, operators) know.
RECORDED_AS: dict[Event, Event] = {
    Event.ADOPTION_UNSERVED: Event.ADOPTION_UNSERVED,
    Event.ALERT: Event.ALERT,
    Event.CHECKPOINT_FALLBACK: Event.CHECKPOINT_FALLBACK,
    Event.CHECKPOINT_RECORD_FAILED: Event.CHECKPOINT_RECORD_FAILED,
    Event.CONFIG_CHANGE: Event.CONFIG_CHANGE,
    Event.DEPENDENCY_RECOVERED: Event.DEPENDENCY_RECOVERED,
    Event.DEPENDENCY_REFUSED: Event.DEPENDENCY_REFUSED,
    Event.DONE: Event.DONE,
    Event.GROUPS_LOST: Event.GROUPS_LOST,
    Event.GROUPS_REOPENED_BY_ROLLBACK: Event.GROUPS_REOPENED_BY_ROLLBACK,
    Event.OPTIMIZER_FRESH: Event.OPTIMIZER_FRESH,
    Event.PAUSED: Event.PAUSE,
    Event.PRESENCE_PRUNED: Event.PRESENCE_PRUNED,
    Event.RESTART: Event.RESTART,
    Event.RESUMED: Event.RESUME,
    Event.ROLLED_BACK: Event.ROLLBACK,
    Event.SCALED: Event.SCALED,
    Event.STEP_SKIPPED: Event.STEP_SKIPPED,
    Event.STOP_REQUESTED: Event.STOP,
    Event.UNPAUSED: Event.UNPAUSE,
}


class EventLog:
    """``events.jsonl``: the run's record of what happened to it besides its steps."""

    def __init__(self, path: Path, max_bytes: int | None = None, keep_parts: int = 0):
        self.path = path
        # Without max_bytes one file grows for ever (a drill's or a test's short record).
        self.file = RollingJsonl(path, max_bytes or sys.maxsize, keep_parts)

    @classmethod
    def of_run(cls, cfg: RunConfig) -> EventLog:
        """The run's ``events.jsonl``, rolled at ``telemetry.jsonl_max_mib`` and pruned to
        ``telemetry.jsonl_keep_parts`` parts like its metrics."""
        return cls(cfg.run_dir / "events.jsonl", cfg.telemetry.jsonl_max_mib * 2**20, cfg.telemetry.jsonl_keep_parts)

    def write(self, kind: Event, message: str, step: int | None = None, **extra: Any) -> None:
        row = {"time": round(time.time(), 3), "step": step, "kind": kind, "message": message, **extra}
        self.file.write(hide_url_secrets(json.dumps(row, default=str)) + "\n")


@dataclass(frozen=True)
class JournalEntry:
    """One event as every sink sees it."""

    event: Event
    message: str
    level: int
    step: int | None
    fields: dict[str, Any] = field(default_factory=dict)


class JournalSink(Protocol):
    """A sink beside the log and the events file (a role's metrics, counters, webhook); it takes what it keeps."""

    def write(self, entry: JournalEntry) -> None: ...


class Journal:
    """Writes each event once to every sink: the log line, ``events.jsonl`` for the ``RECORDED_AS`` events, and
    the role's own sinks. A journal without a record (a test's, a drill's) still logs and feeds its sinks."""

    log = logging.getLogger("rlpipe.journal")

    def __init__(self, record: EventLog | None = None, sinks: Sequence[JournalSink] = ()):
        self.record = record
        self.sinks = list(sinks)

    def emit(
        self,
        event: Event,
        message: str = "",
        *,
        level: int = logging.INFO,
        step: int | None = None,
        alert: bool = False,
        **fields: Any,
    ) -> None:
        """``alert`` marks the log line for log-based alerting (``alert: true``); the record and sinks go by event."""
        entry = JournalEntry(event, message, level, step, fields)
        said = {"message": message} if message else {}
        at = {"step": step} if step is not None else {}
        log_event(self.log, event, level=level, **at, **said, **({"alert": True} if alert else {}), **fields)
        kind = RECORDED_AS.get(event)
        if self.record is not None and kind is not None:
            try:
                self.record.write(kind, message, step=step, **fields)
            except OSError as error:  # a full or unwritable run folder: the log line above still says it
                log_event(
                    self.log,
                    Event.EVENT_RECORD_FAILED,
                    level=logging.ERROR,
                    alert=True,
                    kind=kind,
                    error=repr(error)[:300],
                )
        for sink in self.sinks:
            sink.write(entry)
