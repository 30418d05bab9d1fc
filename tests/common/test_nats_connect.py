"""The broker against what a service needs: its version, and its message limit against the config's."""

import pytest
from nats.aio.client import ServerVersion

from services.common.transport.nats_connect import broker_version_refusal, message_limit_refusal

pytestmark = pytest.mark.unit


def test_a_message_limit_within_the_brokers_max_payload_is_accepted():
    assert message_limit_refusal(512 * 1024, 1024 * 1024) is None
    assert message_limit_refusal(1024 * 1024, 1024 * 1024) is None


def test_a_message_limit_above_the_brokers_max_payload_is_refused_naming_both_numbers():
    assert message_limit_refusal(2 * 1024 * 1024, 1024 * 1024) == (
        "nats.max_message_bytes is 2097152 bytes but the broker takes at most 1048576 (its max_payload): "
        "set nats.max_message_bytes to 1048576 or less, or raise max_payload in the nats-server config"
    )


def test_a_broker_older_than_2_11_is_refused_naming_its_version_and_the_one_needed():
    assert broker_version_refusal(ServerVersion("2.11.0")) is None
    assert broker_version_refusal(ServerVersion("2.15.1")) is None
    assert broker_version_refusal(ServerVersion("3.0.0")) is None
    assert broker_version_refusal(ServerVersion("2.10.22")) == (
        "the broker is nats-server 2.10.22; rlpipe needs 2.11 or later (its trainer reads streams in batched direct "
        "gets): upgrade the server (deploy/compose.yaml pins the tested image)"
    )
    assert "nats-server 0.0.0;" in broker_version_refusal(ServerVersion("0.0.0-unknown"))
    assert broker_version_refusal(ServerVersion("2.11")) == (
        "the broker's version <nats server v2.11> cannot be read; rlpipe needs nats-server 2.11 or later"
    )
