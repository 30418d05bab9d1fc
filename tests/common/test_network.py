"""Bytes per role over the network (services/common/observe/network.py): counts read at each scrape or added as they
pass, and the trainer's step-row rates between two rows."""

from __future__ import annotations

import pytest

from services.common.observe.network import (
    NETWORK_ROW_KEYS,
    NetworkRates,
    add_network_bytes,
    network_bytes,
    watch_network_bytes,
)

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_each_role_channel_and_direction_sums_its_readers_and_what_was_added():
    stats = {"in_bytes": 10, "out_bytes": 3}
    watch_network_bytes("role-a", "bus", "in", lambda: stats["in_bytes"])
    watch_network_bytes("role-a", "bus", "in", lambda: 5)  # a second connection of the same role
    add_network_bytes("role-a", "weight_sync", "in", 7)
    add_network_bytes("role-a", "weight_sync", "in", 1)
    stats["in_bytes"] = 20
    totals = network_bytes()
    assert totals[("role-a", "bus", "in")] == 25
    assert totals[("role-a", "weight_sync", "in")] == 8
    with pytest.raises(ValueError, match="channel 'disk'"):
        add_network_bytes("role-a", "disk", "in", 1)


def test_the_step_row_gives_each_rate_since_the_last_row_and_the_busier_directions_share_of_the_link():
    clock, sent, received, served = Clock(), [0], [0], [0]
    watch_network_bytes("role-b", "bus", "out", lambda: sent[0])
    watch_network_bytes("role-b", "bus", "in", lambda: received[0])
    watch_network_bytes("role-b", "weight_sync", "out", lambda: served[0])
    rates = NetworkRates("role-b", link_bytes_per_s=1000.0, clock=clock)
    clock.now += 2
    sent[0], received[0], served[0] = 400, 100, 1200
    row = rates.row()
    assert set(row) == set(NETWORK_ROW_KEYS)
    assert row == {
        "network/bus_in_bytes_per_s": 50.0,
        "network/bus_out_bytes_per_s": 200.0,
        "network/weight_sync_out_bytes_per_s": 600.0,
        "network/link_use_frac": 0.8,  # out: (400 + 1200) / 2 s of a 1000 B/s link
    }
    clock.now += 4  # nothing moved since: every rate 0
    assert rates.row()["network/link_use_frac"] == 0.0
    assert "network/link_use_frac" not in NetworkRates("role-b", None, clock).row()  # no link size: no share
