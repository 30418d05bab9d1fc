"""Bytes each role moves over the network, by channel: the bus (NATS message payloads, as nats-py counts them in
``nc.stats``) and weight sync (the tensor bytes a trainer or relaying rollout serves, a rollout pulls).

Every role exports them as one counter, ``rlpipe_network_bytes_total{role,channel,direction}`` (``rate()`` of it
is bytes per second), read at each scrape from byte counts that only grow (a NATS client's stats, a weight
server's ``sent_bytes``) plus what a role adds as it goes (a completed pull). With ``telemetry.link_mib_s`` each
role also exports its link's capacity, ``rlpipe_network_link_bytes_per_second{role}``, which the Prometheus rule
compares the rates with. The trainer's step rows carry its own rates since the previous row (``NetworkRates``):
``network/<channel>_<direction>_bytes_per_s``, and ``network/link_use_frac``, the busier direction's share of the
link, which the default ``network_saturated`` rule judges.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable

from opentelemetry.metrics import CallbackOptions, Observation

from services.common.observe import metrics as m
from services.common.observe.telemetry import meter

Key = tuple[str, str, str]  # (role, channel, direction)
CHANNELS = ("bus", "weight_sync")
DIRECTIONS = ("in", "out")
# The trainer's step-row keys: its bus both ways, the weights it serves, and the link's busier direction's share.
NETWORK_ROW_KEYS = tuple(
    metric.key for metric in (m.NETWORK_BUS_IN, m.NETWORK_BUS_OUT, m.NETWORK_WEIGHT_SYNC_OUT, m.NETWORK_LINK_USE)
)

_lock = threading.Lock()
_readers: dict[Key, list[Callable[[], int]]] = {}
_added: dict[Key, int] = {}


def _key(role: str, channel: str, direction: str) -> Key:
    if channel not in CHANNELS or direction not in DIRECTIONS:
        raise ValueError(f"network bytes of channel {channel!r} ({CHANNELS}), direction {direction!r} ({DIRECTIONS})")
    return role, channel, direction


def watch_network_bytes(role: str, channel: str, direction: str, read: Callable[[], int]) -> None:
    """Count ``read()`` (a byte count that only grows, read at each scrape) in ``role``'s ``channel`` bytes."""
    _exported()
    with _lock:
        _readers.setdefault(_key(role, channel, direction), []).append(read)


def add_network_bytes(role: str, channel: str, direction: str, nbytes: int) -> None:
    """``nbytes`` more bytes moved by ``role`` over ``channel``."""
    _exported()
    key = _key(role, channel, direction)
    with _lock:
        _added[key] = _added.get(key, 0) + nbytes


def network_bytes() -> dict[Key, int]:
    """Each (role, channel, direction)'s bytes so far in this process."""
    with _lock:
        readers = {key: list(reads) for key, reads in _readers.items()}
        totals = dict(_added)
    for key, reads in readers.items():
        totals[key] = totals.get(key, 0) + sum(read() for read in reads)
    return totals


def _observe(options: CallbackOptions) -> Iterable[Observation]:
    return [
        Observation(count, {"role": role, "channel": channel, "direction": direction})
        for (role, channel, direction), count in network_bytes().items()
    ]


@functools.cache
def _exported() -> None:
    meter().create_observable_counter(
        "rlpipe_network",
        callbacks=[_observe],
        unit="By",
        description="bytes this role moved over the network, by channel (bus: NATS message payloads; weight_sync: "
        "tensor bytes) and direction",
    )


def export_link_capacity(role: str, bytes_per_s: float) -> None:
    """Export ``rlpipe_network_link_bytes_per_second{role}`` (telemetry.link_mib_s), what the alert compares with."""
    meter().create_observable_gauge(
        "rlpipe_network_link",
        callbacks=[lambda options: [Observation(bytes_per_s, {"role": role})]],
        unit="By/s",
        description="the capacity of this role's network link, each direction (telemetry.link_mib_s)",
    )


class NetworkRates:
    """``role``'s bytes per second since the previous ``row()`` (the first: since it was made), as step-row keys.

    ``link_bytes_per_s``: the link's capacity each way (None: unknown, and no ``network/link_use_frac``)."""

    def __init__(self, role: str, link_bytes_per_s: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.role = role
        self.link_bytes_per_s = link_bytes_per_s
        self.clock = clock
        self.last = (clock(), self._totals())

    def _totals(self) -> dict[tuple[str, str], int]:
        return {
            (channel, direction): n for (role, channel, direction), n in network_bytes().items() if role == self.role
        }

    def row(self) -> dict[str, float]:
        now, totals = self.clock(), self._totals()
        (then, before), self.last = self.last, (now, totals)
        seconds = max(now - then, 1e-9)
        rate = {key: (n - before.get(key, 0)) / seconds for key, n in totals.items()}
        row = {
            m.NETWORK_BUS_IN.key: rate.get(("bus", "in"), 0.0),
            m.NETWORK_BUS_OUT.key: rate.get(("bus", "out"), 0.0),
            m.NETWORK_WEIGHT_SYNC_OUT.key: rate.get(("weight_sync", "out"), 0.0),
        }
        if self.link_bytes_per_s:
            busier = max(sum(r for (_, d), r in rate.items() if d == way) for way in DIRECTIONS)
            row[m.NETWORK_LINK_USE.key] = busier / self.link_bytes_per_s
        return {key: round(value, 3) for key, value in row.items()}
