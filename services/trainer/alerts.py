"""Alert rules over the trainer's metrics rows: which rules fire, when they clear, and the webhook.

The evaluator is pure bookkeeping: the caller hands it every metrics row it writes
(step rows, eval rows, checkpoint rows, status rows such as ``{"services_down": 1}``)
together with the current time, and acts on the firings it returns. The semantics of
each condition are those of ``AlertRule``'s docstring; the choices that docstring
leaves open are made here:

- A row *carries* a metric when the key is present. Rows without it leave the rule's
  window untouched and do not judge the rule.
- Values that are not finite numbers (NaN, inf, None, strings) are kept in the window
  as NaN: ``nan`` fires on them, ``above``/``below`` never count them as beyond the
  threshold, and ``rises_by``/``falls_by`` cannot judge a window holding one. A loss
  logged as ``null`` is as broken as one logged as NaN, so the ``nan`` rule reports both.
- Thresholds are strict: ``above 0`` fires on 1, not on 0.
- ``rises_by``/``falls_by`` compare ``(new_mean - old_mean) / |old_mean|``; when
  ``old_mean`` is zero the relative change is undefined and the rule does not fire,
  because a run whose reward spread starts at exactly 0 is not exploding when it learns.
- Cooldown counts in the ``step`` of the rows (rows without a step, and ``check_absent``,
  use the last step seen). If the step goes below a firing's step (a rollback or a
  resume from an older checkpoint), that rule's quiet period restarts from the new step,
  so a window still full of pre-rollback values cannot fire again straight away.
- A firing stays in ``active`` until a later row carrying the metric finds the
  condition false (for ``absent``: until a row carries the metric at all). A firing
  suppressed by cooldown is neither returned nor made active.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import urllib.parse
import urllib.request
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from services.common.config import AlertRule
from services.common.observe.events import Event
from services.common.observe.logs import log_event
from services.common.observe.records import MetricsRow

log = logging.getLogger("rlpipe.alerts")

# Values kept per metric even when no rule needs as many, so that a rule added by a hot
# reload can judge from the run's recent history instead of waiting for a fresh window.
MIN_HISTORY = 256


@dataclass(frozen=True)
class Firing:
    rule: str
    metric: str
    condition: str
    value: float  # the newest value; for absent the seconds since last seen; for rises_by/falls_by the relative change
    threshold: float
    window: str
    severity: str
    actions: list[str] = field(default_factory=list)
    step: int | None = None
    time: float = 0.0
    message: str = ""

    def as_dict(self) -> dict[str, Any]:
        """The firing as plain Python types for ``json.dumps``. A NaN value stays a float (the
        admin API's ``double`` carries it); ``post_webhook`` spells it out for strict JSON."""
        return asdict(self)


def _number(value: Any) -> float:
    """The value as a float, or NaN when it is not a number at all."""
    if isinstance(value, (int, float)):
        return float(value)
    return math.nan


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


class AlertEvaluator:
    def __init__(self, rules: list[AlertRule], cooldown_steps: int, now: float | None = None):
        self._created = time.time() if now is None else now
        self._history: dict[str, deque[float]] = {}
        self._last_seen: dict[str, float] = {}
        self._step: int | None = None
        self._fired_at: dict[str, int] = {}  # rule name -> step of its last firing
        self._active: dict[str, Firing] = {}
        self.replace_rules(rules, cooldown_steps)

    @property
    def rules(self) -> list[AlertRule]:
        return list(self._rules)

    @property
    def active(self) -> list[Firing]:
        """Firings whose condition has not been seen false since, in rule order."""
        return [self._active[rule.name] for rule in self._rules if rule.name in self._active]

    def replace_rules(self, rules: list[AlertRule], cooldown_steps: int) -> None:
        """Swap in new rules (a hot reload). Metric history stays; a rule that keeps its
        name keeps its cooldown and active firing, which the next row re-judges."""
        self._rules = list(rules)
        self.cooldown_steps = cooldown_steps
        names = {rule.name for rule in rules}
        self._fired_at = {name: step for name, step in self._fired_at.items() if name in names}
        self._active = {name: firing for name, firing in self._active.items() if name in names}
        self._depth = max([MIN_HISTORY] + [2 * rule.window_steps for rule in rules])
        self._history = {metric: deque(values, maxlen=self._depth) for metric, values in self._history.items()}

    def observe(self, row: dict[str, Any], now: float) -> list[Firing]:
        """Record one metrics row and return the rules it makes fire."""
        step = MetricsRow(row).step
        if step is not None:
            self._step = step
            for name, fired in self._fired_at.items():
                if step < fired:
                    self._fired_at[name] = step
        for metric, value in row.items():
            self._history.setdefault(metric, deque(maxlen=self._depth)).append(_number(value))
            self._last_seen[metric] = now
        firings = []
        for rule in self._rules:
            if rule.metric not in row:
                continue
            if rule.condition == "absent":
                self._active.pop(rule.name, None)
                continue
            judged = self._judge(rule, list(self._history[rule.metric]))
            if judged is None:
                self._active.pop(rule.name, None)
            elif not self._quiet(rule):
                firings.append(self._fire(rule, *judged, now))
        return firings

    def restart_absence_clocks(self, now: float) -> None:
        """Count absence from ``now`` (after a pause, when no metric was due)."""
        self._created = now
        self._last_seen = dict.fromkeys(self._last_seen, now)

    def check_absent(self, now: float) -> list[Firing]:
        """Fire the ``absent`` rules whose metric no row has carried for ``window_s``
        seconds (counted from the evaluator's creation for a metric never seen)."""
        firings = []
        for rule in self._rules:
            if rule.condition != "absent":
                continue
            age = now - self._last_seen.get(rule.metric, self._created)
            if age <= rule.window_s or self._quiet(rule):
                continue
            message = f"{rule.metric} has not been reported for {age:.0f} s, more than the {rule.window_s:g} s allowed."
            firings.append(self._fire(rule, age, message, now))
        return firings

    def _judge(self, rule: AlertRule, values: list[float]) -> tuple[float, str] | None:
        """(value, message) when the rule's condition holds on the metric's history, else None."""
        metric, threshold, window = rule.metric, rule.threshold, rule.window_steps
        if rule.condition == "nan":
            newest = values[-1]
            if math.isfinite(newest):
                return None
            return newest, f"{metric} is {newest} (not a finite number) in the newest row."
        if rule.condition in ("above", "below"):
            recent = values[-window:]
            beyond = (lambda v: v > threshold) if rule.condition == "above" else (lambda v: v < threshold)
            if len(recent) < window or not all(beyond(v) for v in recent):
                return None
            return (
                recent[-1],
                f"{metric} has been {rule.condition} {threshold:g} for the last {_steps(window)} "
                f"(newest {recent[-1]:.4g}).",
            )
        # rises_by / falls_by
        if len(values) < 2 * window:
            return None
        old = sum(values[-2 * window : -window]) / window
        new = sum(values[-window:]) / window
        if not (math.isfinite(old) and math.isfinite(new)) or old == 0:
            return None
        change = (new - old) / abs(old)
        if (change if rule.condition == "rises_by" else -change) <= threshold:
            return None
        verb = "rose" if change > 0 else "fell"
        return change, (
            f"{metric} {verb} by {abs(change):.0%} (mean {old:.4g} over the previous {_steps(window)}, "
            f"{new:.4g} over the last {window}), more than the {threshold:.0%} allowed."
        )

    def _quiet(self, rule: AlertRule) -> bool:
        fired = self._fired_at.get(rule.name)
        return fired is not None and (self._step or 0) - fired < self.cooldown_steps

    def _fire(self, rule: AlertRule, value: float, message: str, now: float) -> Firing:
        window = (
            f"{rule.window_s:g} s"
            if rule.condition == "absent"
            else _steps(1 if rule.condition == "nan" else rule.window_steps)
        )
        at = f" at step {self._step}" if self._step is not None else ""
        firing = Firing(
            rule=rule.name,
            metric=rule.metric,
            condition=rule.condition,
            value=value,
            threshold=rule.threshold if rule.condition != "absent" else rule.window_s,
            window=window,
            severity=rule.severity,
            actions=list(rule.actions),
            step=self._step,
            time=now,
            message=f"[{rule.severity}] {rule.name}{at}: {message}",
        )
        self._fired_at[rule.name] = self._step or 0
        self._active[rule.name] = firing
        return firing


def _strict_json(value: Any) -> Any:
    """``value`` with non-finite floats turned into their text ("nan", "inf"), which strict
    JSON parsers (JavaScript's, most webhook receivers') accept where NaN is a syntax error."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(item) for item in value]
    return value


def post_webhook(
    url: str, payload: dict[str, Any], timeout_s: float = 5.0, retries: int = 0, backoff_s: float = 1.0
) -> None:
    """POST ``payload`` as strict JSON to ``url`` from a background thread; failures are logged, never raised.

    A failed POST (no connection, a timeout, an answer other than 2xx) is tried again up to
    ``retries`` times, ``backoff_s`` after the first failure and twice as long after each next
    one: a receiver restarting or rate-limiting for a moment still gets the alert.
    The trainer must not stall on a slow receiver, and an alert that cannot be delivered
    is still in the logs and the events file. The thread is not a daemon: an alert that
    stops the run is still delivered (within its retries) before the process exits.
    """
    body = json.dumps(_strict_json(payload), default=str, allow_nan=False).encode()
    # Webhook URLs often carry a secret in the path, query or user part: log only the host.
    parts = urllib.parse.urlsplit(url)
    where = f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"

    def send() -> None:
        request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
        for attempt in range(1, retries + 2):
            try:
                with urllib.request.urlopen(request, timeout=timeout_s) as response:  # raises on 4xx and 5xx
                    response.read()
                return
            except Exception as error:
                if attempt > retries:
                    log_event(
                        log,
                        Event.ALERT_WEBHOOK_FAILED,
                        level=logging.WARNING,
                        url=where,
                        attempts=attempt,
                        error=repr(error)[:300],
                    )
                    return
                delay = backoff_s * 2 ** (attempt - 1)
                log_event(
                    log, Event.ALERT_WEBHOOK_RETRY, url=where, attempt=attempt, retry_s=delay, error=repr(error)[:300]
                )
                time.sleep(delay)

    threading.Thread(target=send, name="alert-webhook").start()


WATCHDOG_RULE = "watchdog"


class Heartbeat:
    """The dead-man check's sender side: says when the next ``watchdog`` POST is due.

    The receiver (a dead-man's-switch service, or Alertmanager's own Watchdog route) raises the alarm when
    these stop arriving: a trainer that is down, hung, or cut off from the webhook can send no alert itself.
    """

    def __init__(self) -> None:
        self.last: float | None = None

    def due(self, now: float, every_s: float) -> bool:
        """True (and counted as sent) when ``every_s`` seconds have passed since the last beat; never for 0."""
        if every_s <= 0 or (self.last is not None and now - self.last < every_s):
            return False
        self.last = now
        return True

    @staticmethod
    def payload(run_id: str, step: int, now: float) -> dict[str, Any]:
        return {
            "run_id": run_id,
            "rule": WATCHDOG_RULE,
            "severity": "none",
            "step": step,
            "time": now,
            "message": f"[none] {WATCHDOG_RULE}: the trainer of {run_id} is alive at step {step} and can reach "
            "this webhook; a dead-man receiver alarms when these stop.",
        }
