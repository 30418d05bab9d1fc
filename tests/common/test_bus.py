"""Claim checks over a real JetStream server and file store."""

import asyncio

import numpy as np
import pytest

from services.common.transport.bus import Bus
from services.common.transport.claims import StoreUnavailable
from services.common.transport.messages import (
    ClaimCheck,
    DecodeError,
    RolloutGroup,
    decode,
    encode,
)
from services.common.transport.reader import StreamReader
from services.common.transport.stage import Stage
from services.common.transport.streams import (
    DEAD,
    H_CLAIM,
    H_GROUP,
    H_REASON,
    ROLLOUTS,
    SCORED,
    StreamMessage,
    stream_name,
)
from tests.support.bus import until_messages
from tests.support.messages import completion, rollout_group
from tests.support.runs import run_config
from tests.support.servers import create_run_state, free_port

pytestmark = pytest.mark.integration


def big_group(tokens: int) -> RolloutGroup:
    return rollout_group("big", [completion(tokens, finish_reason="length")] * 4, policy_version=3)


def test_large_groups_travel_by_claim_check(tiny_model, tmp_path, nats_url):
    cfg = run_config(
        tmp_path,
        tiny_model,
        run_id="claims",
        nats={"url": nats_url, "claim_check_bytes": 4096, "max_message_bytes": 8192},
    )

    async def scenario() -> None:
        bus = await Bus(cfg, "test").connect()
        group = big_group(5000)  # ~160 KB encoded, far above both limits
        await bus.publish(ROLLOUTS, group, msg_id="big.rollout")
        await bus.publish(ROLLOUTS, big_group(10), msg_id="small.rollout")
        reader = StreamReader(bus, ROLLOUTS, 1)
        claimed, small = await reader.next(5), await reader.next(5)
        assert claimed.headers[H_CLAIM] == "1" and len(claimed.data) < 1024
        assert H_CLAIM not in (small.headers or {})
        back = await bus.decode(claimed, RolloutGroup)
        np.testing.assert_array_equal(back.completions[0].token_ids, group.completions[0].token_ids)
        assert back.policy_version == 3

        # A redelivered compute publishes a new sample under the same id: the stream drops the repeat,
        # and the body of the message it kept stays intact.
        ack = await bus.publish(ROLLOUTS, big_group(5001), msg_id="big.rollout")
        assert ack.duplicate
        np.testing.assert_array_equal(
            (await bus.decode(claimed, RolloutGroup)).completions[0].token_ids, group.completions[0].token_ids
        )

        # A body that no longer matches its claim is refused (and so would be dead-lettered).
        key = decode(claimed.data, ClaimCheck).key
        bus.claims.put(key, b"tampered")
        try:
            await bus.decode(claimed, RolloutGroup)
        except DecodeError as error:
            assert "does not match" in str(error)
        else:
            raise AssertionError("a tampered claim-checked body was accepted")
        await bus.close()

    asyncio.run(scenario())


def test_a_message_whose_deliveries_never_came_back_is_dead_lettered(tiny_model, tmp_path, nats_url):
    cfg = run_config(
        tmp_path,
        tiny_model,
        run_id="unsettled",
        nats={"url": nats_url, "ack_wait_s": 1, "heartbeat_s": 0.5, "max_deliver": 2, "fetch_timeout_s": 0.5},
    )

    async def scenario() -> None:
        await create_run_state(cfg)
        bus = await Bus(cfg, "reward").connect()
        await bus.publish(ROLLOUTS, big_group(10), msg_id="g.rollout")
        queue = await bus.work_queue(ROLLOUTS)
        # A reward replica takes it and dies before any outcome, twice: each fetch waits for the broker to deliver it
        # again, once the ack wait of the delivery before has passed.
        for _ in range(cfg.nats.max_deliver):
            [_msg] = await queue.fetch(1, timeout=5)
        computed = []

        async def compute(groups):
            computed.extend(groups)
            return []

        stop = asyncio.Event()
        stage = asyncio.create_task(Stage(bus, ROLLOUTS, SCORED, RolloutGroup, compute, 1, "reward").run(stop))
        await until_messages(bus, DEAD, 1, timeout=10)
        stop.set()
        await stage
        letter = await bus.js.get_msg(stream_name("unsettled", DEAD), seq=1)
        assert "delivered 3 times without an outcome" in letter.headers[H_REASON] and letter.headers[H_GROUP] == "big"
        assert computed == []  # the third delivery is not tried again: it would crash the replica once more
        await bus.close()

    asyncio.run(scenario())


def test_a_missing_claim_body_is_bad_input_but_an_unreachable_store_is_only_a_delay(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("RLPIPE_S3_ACCESS_KEY", "testing")
    monkeypatch.setenv("RLPIPE_S3_SECRET_KEY", "testing")
    claim = StreamMessage(
        1, encode(ClaimCheck(key="test/claims/rollouts/g.rollout", size=10, sha256="0" * 64)), {H_CLAIM: "1"}
    )
    on_disk = run_config(tmp_path, tiny_model, "a.yaml")
    with pytest.raises(DecodeError, match="is missing"):  # dead-lettered: no retry brings it back
        asyncio.run(Bus(on_disk, "reward").decode(claim, RolloutGroup))
    # An S3 endpoint nobody answers on: the message stays (nak, re-read) until the store is back.
    unreachable = run_config(
        tmp_path,
        tiny_model,
        "b.yaml",
        checkpoint={"store_url": "s3://claims/x", "s3_endpoint": f"127.0.0.1:{free_port()}", "s3_secure": False},
    )
    with pytest.raises(StoreUnavailable, match="could not be read"):
        asyncio.run(Bus(unreachable, "reward").decode(claim, RolloutGroup))
