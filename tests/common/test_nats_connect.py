"""The broker's message limit against the config's: a config that sends more than the broker takes is refused."""

import pytest

from services.common.transport.nats_connect import message_limit_refusal

pytestmark = pytest.mark.unit


def test_a_message_limit_within_the_brokers_max_payload_is_accepted():
    assert message_limit_refusal(512 * 1024, 1024 * 1024) is None
    assert message_limit_refusal(1024 * 1024, 1024 * 1024) is None


def test_a_message_limit_above_the_brokers_max_payload_is_refused_naming_both_numbers():
    assert message_limit_refusal(2 * 1024 * 1024, 1024 * 1024) == (
        "nats.max_message_bytes is 2097152 bytes but the broker takes at most 1048576 (its max_payload): "
        "set nats.max_message_bytes to 1048576 or less, or raise max_payload in the nats-server config"
    )
