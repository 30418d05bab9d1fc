"""Service presence in a real JetStream key-value bucket."""

import asyncio

import nats
import pytest

from services.common.config import load_config
from services.common.transport.presence import Presence, read_presence, roles_down
from tests.conftest import write_config

pytestmark = pytest.mark.integration


def test_every_registered_replica_is_read_back_every_time(tiny_model, tmp_path, nats_url):
    model_dir, data_dir = tiny_model
    cfg = load_config(
        write_config(
            tmp_path / "c.yaml", model_dir, data_dir, tmp_path / "runs", run_id="presence", nats={"url": nats_url}
        )
    )

    async def scenario():
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await read_presence(js, cfg)  # the trainer's read creates the bucket, which the stages wait for
        replicas = [
            await Presence(
                js, cfg.model_copy(update={"service": cfg.service.model_copy(update={"instance": name})}), role
            ).start()
            for name, role in (("rollout-0", "rollout"), ("rollout-1", "rollout"), ("reward-0", "reward"))
        ]
        again = await Presence(
            js, cfg.model_copy(update={"service": cfg.service.model_copy(update={"instance": "reward-0"})}), "reward"
        ).start()
        # Read many times over: kv.keys() sometimes answered "no keys" here, making every replica look gone.
        for _ in range(40):
            entries = await read_presence(js, cfg)
            assert [(e["instance"], e["up"]) for e in entries] == [
                ("reward-0", True),
                ("rollout-0", True),
                ("rollout-1", True),
            ]
        assert {e["instance"]: e["restarts"] for e in entries}["reward-0"] == 1
        # Roles never seen: down, unless they may still be starting.
        assert roles_down(entries) == ["reference"] and roles_down(entries, count_unseen=False) == []
        for replica in (*replicas, again):
            await replica.stop()
        await nc.close()

    asyncio.run(scenario())
