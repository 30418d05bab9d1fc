"""``rlpipe doctor --network``'s rows: round-trip time and throughput from here to each remote service the config
names, each from a few timed requests, against what the config asks of that link.

- **nats**: the median of ``PROBES`` PING/PONG round trips (``flush``), and ``PROBE_BYTES`` published to a subject
  this connection subscribes to (through the broker and back). Need: one step's groups cross the bus about three
  times with their tokens (ROLLOUTS, SCORED, EXPERIENCE; ``bus_step_bytes``, an upper bound at train.max_seq_len).
- **checkpoint store** (s3:// only): the median of ``PROBES`` listings, and ``PROBE_BYTES`` put, read back and
  deleted under the run's prefix. Need: a save at a stop must upload within supervision.trainer_stop_grace_s (the
  launcher kills the trainer after it), so one save's bytes over the upload rate must fit in it.
- **reward.http.url**, **rollout.environment_url**: the median of ``PROBES`` TCP connects, and one GET of the URL
  (any answer counts: it is timed, not judged). Need: a group's completions go out reward.http.batch_size to a
  request, an episode asks the environment once per turn; either must finish well inside nats.max_work_s.
- **weight sync**: not measured here (the trainer serves it only while it runs); one version's bytes to every
  rollout replica per step, against telemetry.link_mib_s when it is set.

A need is compared with the link where the config fixes it. The ones that depend on how long a step takes use the
median wall time between the run's recent step rows (its metrics.jsonl) when there is one; without it the row says
what a step costs on that link and stays ok. A row warns when a need takes more than half of what it has.
"""

from __future__ import annotations

import asyncio
import math
import socket
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlparse

from services.cli.verify.health import remote_services
from services.common.config import RunConfig
from services.common.observe import metrics as m
from services.common.observe.records import read_metrics
from services.common.startup_checks import CheckResult, human_size, shorten, weight_files
from services.common.transport.model_source import local_model_path
from services.common.transport.nats_connect import connect_options
from services.common.transport.storage import S3Store, open_store

PROBES = 5
PROBE_BYTES = 8 << 20
NATS_MESSAGE_BYTES = 256 << 10
TIMEOUT_S = 10.0
# Per token of a completion on the bus: its id (int32), its sampling logprob and its reference logprob (float32).
BUS_BYTES_PER_TOKEN = 12
BUS_TOKEN_EDGES = 3  # ROLLOUTS, SCORED, EXPERIENCE carry the tokens; PROMPTS only the prompt text
SHORT = 0.5  # a need taking more than this share of the time it has warns
STEP_ROWS = 20  # recent step rows the step interval is the median of


@dataclass(frozen=True)
class Measured:
    """A link as measured: round trip (s), and bytes per second each way (None: not measured)."""

    rtt_s: float
    up_bytes_per_s: float | None = None
    down_bytes_per_s: float | None = None

    def describe(self) -> str:
        both = (("up", self.up_bytes_per_s), ("down", self.down_bytes_per_s))
        rates = [f"{name} {human_size(rate)}/s" for name, rate in both if rate]
        return ", ".join([f"rtt {self.rtt_s * 1000:.1f} ms", *rates])


def median_s(call: Callable[[], object], times: int = PROBES) -> float:
    spent = []
    for _ in range(times):
        started = time.perf_counter()
        call()
        spent.append(time.perf_counter() - started)
    return statistics.median(spent)


def judged(name: str, link: str, need_s: float, has_s: float | None, what: str, has: str) -> CheckResult:
    """Warn when ``need_s`` (``what``) takes more than ``SHORT`` of ``has_s`` (``has``); ok with the figures
    either way, and with no comparison when ``has_s`` is unknown."""
    detail = f"{link}; {what} ~{need_s:.2f} s"
    if has_s is None:
        return CheckResult(name, "ok", f"{detail} ({has}: unknown)")
    if need_s > SHORT * has_s:
        return CheckResult(name, "warn", f"{detail}, over half of {has} ({has_s:.2f} s): this link is short")
    return CheckResult(name, "ok", f"{detail}, within {has} ({has_s:.2f} s)")


def step_interval_s(cfg: RunConfig) -> float | None:
    """The median wall time between the run's recent step rows (their time/<phase>_s summed); None without any."""
    if not cfg.metrics_file.is_file():
        return None
    phases = [row.family(m.TIME_SPLIT) for row in read_metrics(cfg.metrics_file)]
    intervals = [sum(split.values()) for split in phases if ("wait",) in split][-STEP_ROWS:]
    return statistics.median(intervals) if intervals else None


def bus_step_bytes(cfg: RunConfig) -> int:
    """An upper bound of what one step's groups move through the broker: every completion at train.max_seq_len
    tokens, ``BUS_BYTES_PER_TOKEN`` a token, on each of ``BUS_TOKEN_EDGES`` edges."""
    completions = cfg.train.batch_size * cfg.sampling.group_size
    return completions * cfg.train.max_seq_len * BUS_BYTES_PER_TOKEN * BUS_TOKEN_EDGES


# ---------------------------------------------------------------- nats


async def measure_nats(cfg: RunConfig) -> Measured:
    """PING/PONG round trips, then ``PROBE_BYTES`` through the broker to this connection's own subscription."""
    import nats

    nc = await nats.connect(
        cfg.nats.url,
        connect_timeout=TIMEOUT_S,
        allow_reconnect=False,
        name="rlpipe-doctor-network",
        **connect_options(cfg.nats, "operator"),
    )
    try:
        rtts = []
        for _ in range(PROBES):
            started = time.perf_counter()
            await nc.flush(timeout=TIMEOUT_S)  # pyright: ignore[reportArgumentType]  (nats-py says int; any seconds)
            rtts.append(time.perf_counter() - started)
        size = min(NATS_MESSAGE_BYTES, nc.max_payload)
        count = math.ceil(PROBE_BYTES / size)
        arrived, done = [0], asyncio.Event()

        async def received(msg: object) -> None:
            arrived[0] += 1
            if arrived[0] == count:
                done.set()

        subject = nc.new_inbox()
        subscription = await nc.subscribe(subject, cb=received, pending_bytes_limit=2 * PROBE_BYTES)
        payload = bytes(size)
        started = time.perf_counter()
        for _ in range(count):
            await nc.publish(subject, payload)
        await asyncio.wait_for(done.wait(), TIMEOUT_S * 3)
        rate = size * count / (time.perf_counter() - started)
        await subscription.unsubscribe()
        return Measured(statistics.median(rtts), rate, rate)
    finally:
        await nc.close()


def nats_row(cfg: RunConfig, embedded: bool) -> CheckResult:
    if embedded:
        return CheckResult("network nats", "skip", "rlpipe run's broker is on this machine")
    try:
        link = asyncio.run(measure_nats(cfg))
    except Exception as error:  # the broker's own row names why it cannot be reached
        return CheckResult("network nats", "fail", f"{cfg.nats.url}: {shorten(error)}")
    need = bus_step_bytes(cfg)
    seconds = need / (link.up_bytes_per_s or 1.0)
    what = f"a step's groups ({human_size(need)} at most, through the broker) take"
    return judged("network nats", f"{cfg.nats.url}: {link.describe()}", seconds, step_interval_s(cfg), what, "a step")


# ---------------------------------------------------------------- the checkpoint store


def measure_store(store: S3Store, run_id: str) -> Measured:
    """Listings timed, then ``PROBE_BYTES`` put, read back and deleted under the run's prefix."""
    probe = f"{run_id}/.doctor-network-{uuid.uuid4().hex[:8]}"
    rtt = median_s(lambda: store.list(probe + "/"))
    data = bytes(PROBE_BYTES)
    try:
        up = PROBE_BYTES / median_s(lambda: store.put(probe, data), times=1)
        down = PROBE_BYTES / median_s(lambda: store.get(probe), times=1)
    finally:
        store.delete([probe])
    return Measured(rtt, up, down)


def save_bytes(cfg: RunConfig) -> int | None:
    """One save of the run, as the disk check sizes it: the weights and AdamW's two moments; None while the model
    is not here to size."""
    from services.cli.doctor.checks import CHECKPOINT_WEIGHT_FACTOR

    model = local_model_path(cfg)
    if model is None:
        return None
    return sum(path.stat().st_size for path in weight_files(model)) * CHECKPOINT_WEIGHT_FACTOR


def store_row(cfg: RunConfig) -> CheckResult:
    url = cfg.checkpoint_url
    if not url.startswith("s3://"):
        return CheckResult("network store", "skip", f"checkpoints go to {url}, a folder of this machine")
    store = open_store(url, cfg.checkpoint)
    assert isinstance(store, S3Store)
    try:
        link = measure_store(store, cfg.run_id)
    except Exception as error:  # the storage row names why it cannot be reached
        return CheckResult("network store", "fail", f"{url} at {cfg.checkpoint.s3_endpoint}: {shorten(error)}")
    where = f"{url} at {cfg.checkpoint.s3_endpoint}: {link.describe()}"
    need = save_bytes(cfg)
    if need is None:
        return CheckResult("network store", "ok", f"{where}; the model is not here to size a save by")
    seconds = need / (link.up_bytes_per_s or 1.0)
    return judged(
        "network store",
        where,
        seconds,
        cfg.supervision.trainer_stop_grace_s,
        f"one save ({human_size(need)}) uploads in",
        "supervision.trainer_stop_grace_s, for the save at a stop",
    )


# ---------------------------------------------------------------- reward and environment services


def measure_http(url: str) -> tuple[Measured, float]:
    """TCP connects timed, and one GET of ``url`` (its answer, whatever it is): (the link, the request's seconds)."""
    import urllib3

    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)

    def connect() -> None:
        with socket.create_connection((parsed.hostname or "", port), timeout=TIMEOUT_S):
            pass

    rtt = median_s(connect)
    http = urllib3.PoolManager(timeout=urllib3.Timeout(connect=TIMEOUT_S, read=TIMEOUT_S), retries=False)
    request_s = median_s(lambda: http.request("GET", url, redirect=False), times=1)
    return Measured(rtt), request_s


def http_rows(cfg: RunConfig) -> list[CheckResult]:
    rows = []
    for label, url in remote_services(cfg).items():
        name = f"network {label.split('.')[0]}"
        try:
            link, request_s = measure_http(url)
        except Exception as error:  # the remote services row names why it cannot be reached
            rows.append(CheckResult(name, "fail", f"{label} {url}: {shorten(error)}"))
            continue
        where = f"{label} {url}: {link.describe()}, a request {request_s * 1000:.1f} ms"
        if label == "reward.http.url" and cfg.reward.http is not None:
            requests = math.ceil(cfg.sampling.group_size / cfg.reward.http.batch_size)
            what = f"a group's {requests} request(s) take at least"
            need_s = requests * request_s
        else:
            what = f"an episode's {cfg.rollout.max_turns + 1} requests take at least"
            need_s = (cfg.rollout.max_turns + 1) * request_s
        rows.append(judged(name, where, need_s, cfg.nats.max_work_s, what, "nats.max_work_s"))
    return rows


# ---------------------------------------------------------------- weight sync


def weight_sync_row(cfg: RunConfig) -> CheckResult:
    model = local_model_path(cfg)
    if cfg.model.lora is not None or model is None:
        why = "LoRA runs send adapters only" if cfg.model.lora is not None else "the model is not here to size"
        return CheckResult("network weight sync", "skip", why)
    version = sum(path.stat().st_size for path in weight_files(model))
    # rollout.replicas: auto starts as many as fit in the GPU at launch: sized here at the most it may start.
    auto = cfg.rollout.replicas == "auto"
    replicas = cfg.rollout.auto_max_replicas if cfg.rollout.replicas == "auto" else cfg.rollout.replicas
    fanout = min(cfg.rollout.relay_fanout or replicas, replicas)
    sent = version * fanout  # relays pass the rest on
    to = f"at most {fanout} replica(s) (rollout.replicas: auto)" if auto else f"{fanout} replica(s)"
    what = f"a version ({human_size(version)}) to {to} takes"
    link = cfg.telemetry.link_mib_s
    if link is None:
        return CheckResult("network weight sync", "ok", f"{what} the trainer's link (telemetry.link_mib_s: unknown)")
    seconds = sent / (link * 2**20)
    where = f"the trainer's link, telemetry.link_mib_s {link:g} MiB/s"
    return judged("network weight sync", where, seconds, step_interval_s(cfg), what, "a step")


def network_rows(cfg: RunConfig, embedded: bool) -> list[CheckResult]:
    return [nats_row(cfg, embedded), store_row(cfg), *http_rows(cfg), weight_sync_row(cfg)]
