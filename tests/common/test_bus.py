"""Claim checks over a real JetStream server and file store."""

import asyncio

import numpy as np

from services.common.bus import H_CLAIM, ROLLOUTS, Bus, StreamReader
from services.common.config import load_config
from services.common.messages import Completion, DecodeError, Prompt, RolloutGroup, advance
from tests.conftest import write_config


def big_group(tokens: int) -> RolloutGroup:
    completion = Completion(text="x", token_ids=np.arange(tokens, dtype=np.int32), logprobs=np.full(tokens, -0.5, np.float32), finish_reason="length")
    return advance(Prompt(group_id="big", prompt_id="p", prompt="1+1=", answer="2"), RolloutGroup,
                   prompt_ids=np.array([1, 2], np.int32), policy_version=3, completions=[completion] * 4)


def test_large_groups_travel_by_claim_check(tiny_model, tmp_path, nats_url):
    model_dir, data_dir = tiny_model
    cfg = load_config(write_config(tmp_path / "c.yaml", model_dir, data_dir, tmp_path / "runs", run_id="claims",
                                   nats={"url": nats_url, "claim_check_bytes": 4096, "max_message_bytes": 8192}))

    async def scenario() -> None:
        bus = await Bus(cfg, "test").connect()
        group = big_group(5000)  # ~160 KB encoded, far above both limits
        await bus.publish(ROLLOUTS, group, msg_id="big.rollout")
        await bus.publish(ROLLOUTS, big_group(10), msg_id="small.rollout")
        reader = StreamReader(bus, ROLLOUTS, 1)
        claimed, small = await reader.next(5), await reader.next(5)
        assert claimed.headers[H_CLAIM] == "1" and len(claimed.data) < 1024
        assert H_CLAIM not in (small.headers or {})
        back = bus.decode(claimed, RolloutGroup)
        np.testing.assert_array_equal(back.completions[0].token_ids, group.completions[0].token_ids)
        assert back.policy_version == 3

        # A body that no longer matches its claim is refused (and so would be dead-lettered).
        [key] = [k for k in bus.claims.list("claims/claims/")]
        bus.claims.put(key, b"tampered")
        try:
            bus.decode(claimed, RolloutGroup)
        except DecodeError as error:
            assert "does not match" in str(error)
        else:
            raise AssertionError("a tampered claim-checked body was accepted")
        await bus.close()

    asyncio.run(scenario())
