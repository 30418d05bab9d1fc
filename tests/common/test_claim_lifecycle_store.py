"""A work queue's claim-checked bodies against a real nats-server and a real S3 endpoint (moto_server): deleted once
consumed, kept where a dead letter, a re-inject's letter or a lapsed delivery's twin may read them, and tagged for
the bucket's lifecycle rule."""

import asyncio
import json
import time
from pathlib import Path

import pytest

from services.cli.dead_letters import list_dead_letters, reinject
from services.common.transport.bus import Bus
from services.common.transport.lifecycle_tags import TRANSIENT_TAG
from services.common.transport.messages import ClaimCheck, RolloutGroup, ScoredGroup, decode
from services.common.transport.reader import StreamReader
from services.common.transport.stage import Stage
from services.common.transport.streams import DEAD, H_GROUP, ROLLOUTS, SCORED
from tests.support.bus import running
from tests.support.messages import completion, rollout_group, scored
from tests.support.runs import run_config
from tests.support.servers import create_run_state
from tests.support.waits import until

pytestmark = pytest.mark.integration

ACK_WAIT_S = 4.0  # a delivery may go 2 s without a beat and still count as held throughout


def group(group_id: str, tokens: int = 400) -> RolloutGroup:
    return rollout_group(group_id, [completion(tokens, finish_reason="length")] * 2)


def config(tmp_path, tiny_model, nats_url, s3_env):
    return run_config(
        tmp_path,
        tiny_model,
        run_id="lifecycle",
        nats={
            "url": nats_url,
            "claim_check_bytes": 1024,
            "max_message_bytes": 4096,
            "ack_wait_s": ACK_WAIT_S,
            "heartbeat_s": 0.2,
            "max_deliver": 2,
            "duplicate_window_s": 60,
        },
        train={"lost_after_s": 120},
        checkpoint={"store_url": "s3://lifecycle/ckpt", "s3_endpoint": s3_env, "s3_secure": False},
    )


async def rollout_keys(bus: Bus, count: int) -> dict[str, str]:
    """group id -> claim key of the first ``count`` messages published to ROLLOUTS (read from the stream's record
    of them: ROLLOUTS is a work queue, so the DEAD letters and re-injects are what outlive the acks)."""
    keys = {}
    reader = StreamReader(bus, ROLLOUTS, 1)
    for _ in range(count):
        msg = await reader.next(5)
        keys[msg.headers[H_GROUP]] = decode(msg.data, ClaimCheck).key
    return keys


def test_a_consumed_body_is_deleted_and_one_a_dead_letter_or_a_reinject_still_needs_is_kept(
    tiny_model, tmp_path, nats_url, s3_env
):
    cfg = config(tmp_path, tiny_model, nats_url, s3_env)

    async def compute(groups: list[RolloutGroup]) -> list[ScoredGroup]:
        if any(g.group_id == "poison" for g in groups):
            raise ValueError("this group always fails")
        return [scored(g) for g in groups]

    async def scenario() -> None:
        await create_run_state(cfg)
        producer = await Bus(cfg, "rollout").connect()
        bus = await Bus(cfg, "reward").connect()
        store = bus.claims
        for name in ("fine", "poison"):
            await producer.publish(ROLLOUTS, group(name), msg_id=f"{name}.rollout")
        sent = await rollout_keys(producer, 2)
        tags = store.client.get_object_tags("lifecycle", f"ckpt/{sent['fine']}")
        assert dict(tags) == dict([TRANSIENT_TAG])  # what the bucket's lifecycle rule selects

        stage = Stage(bus, ROLLOUTS, SCORED, RolloutGroup, compute, 1, "reward")
        stop = asyncio.Event()
        loop = asyncio.create_task(stage.run(stop))
        for _ in range(200):  # the poison group's second delivery comes after a 2 s nak delay
            letters = await list_dead_letters(nats_url, cfg.run_id)
            if stage.handled == 1 and letters:
                break
            await asyncio.sleep(0.1)
        assert stage.handled == 1
        assert [letter.group_id for letter in letters] == ["poison"]
        claims = f"{cfg.run_id}/claims/"
        # The consumed body is gone; the dead letter's is there for `rlpipe dead-letters` and --reinject;
        # the output the stage published (SCORED, not consumed here) keeps its own.
        remaining = store.list(claims)
        assert sent["fine"] not in remaining
        assert sent["poison"] in remaining
        assert [key for key in remaining if key.startswith(f"{claims}scored/")] != []

        stop.set()
        await loop

        # Sent back and consumed, a re-inject leaves the body its letter still points at.
        await reinject(nats_url, cfg.run_id, letters[0].sequence)
        fixed = Stage(bus, ROLLOUTS, SCORED, RolloutGroup, accept_all, 1, "reward")
        async with running(fixed):
            await until(lambda: fixed.handled == 1, 10, "the re-injected group handled")
        assert sent["poison"] in store.list(claims)
        dead = StreamReader(bus, DEAD, 1)
        letter = await dead.next(5)
        assert decode(letter.data, ClaimCheck).key == sent["poison"]
        await bus.close()
        await producer.close()

    asyncio.run(scenario())


async def accept_all(groups: list[RolloutGroup]) -> list[ScoredGroup]:
    return [scored(g) for g in groups]


def test_a_delivery_that_went_half_an_ack_wait_without_a_beat_leaves_its_body_to_the_lifecycle_rule(
    tiny_model, tmp_path, nats_url, s3_env
):
    cfg = config(tmp_path, tiny_model, nats_url, s3_env)

    async def stalling(groups: list[RolloutGroup]) -> list[ScoredGroup]:
        # Blocks the event loop, as a stalled process would: no beat goes out for 2.5 s, more than half the
        # ack wait, so the broker may have handed the message to a twin that still needs its body.
        time.sleep(ACK_WAIT_S / 2 + 0.5)
        return await accept_all(groups)

    async def scenario() -> None:
        await create_run_state(cfg)
        producer = await Bus(cfg, "rollout").connect()
        bus = await Bus(cfg, "reward").connect()
        await producer.publish(ROLLOUTS, group("slow"), msg_id="slow.rollout")
        key = (await rollout_keys(producer, 1))["slow"]
        stage = Stage(bus, ROLLOUTS, SCORED, RolloutGroup, stalling, 1, "reward")
        async with running(stage):
            await until(lambda: stage.handled == 1, 10, "the slow group handled")
        assert key in bus.claims.list(f"{cfg.run_id}/claims/rollouts/")
        await bus.close()
        await producer.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("where", ["minio", "s3"])
def test_an_s3_endpoint_accepts_the_buckets_lifecycle_rules_as_written(s3_env, where):
    # The same documents `aws s3api put-bucket-lifecycle-configuration` takes (docs/operations.md).
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=f"http://{s3_env}",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    bucket = f"lifecycle-rule-{where}"
    client.create_bucket(Bucket=bucket)
    document = json.loads((Path(__file__).resolve().parents[2] / "deploy" / where / "lifecycle.json").read_text())
    client.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration=document)
    stored = {rule["ID"]: rule for rule in client.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]}
    assert set(stored) == {rule["ID"] for rule in document["Rules"]}
    assert stored["rlpipe-work-queue-claims"]["Filter"]["Tag"] == {"Key": TRANSIENT_TAG[0], "Value": TRANSIENT_TAG[1]}
    assert stored["rlpipe-work-queue-claims"]["Expiration"]["Days"] == 21
