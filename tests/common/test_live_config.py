"""Live config versions in a real JetStream key-value bucket."""

import asyncio
import sys

import nats
import pytest

from services.common.config import ConfigError
from services.common.transport.live_config import LiveConfig, parse_value, stored_config
from tests.support.runs import run_config

pytestmark = pytest.mark.integration


@pytest.fixture
def base(tmp_path, tiny_model, nats_url):
    return run_config(tmp_path, tiny_model, nats={"url": nats_url})


def test_versions_are_validated_stored_with_history_and_picked_up(base, nats_url):
    async def scenario():
        operator_conn, service_conn = await nats.connect(nats_url), await nats.connect(nats_url)
        operator = await LiveConfig(base, operator_conn.jetstream()).start()
        service = await LiveConfig(base, service_conn.jetstream(), poll_s=0).start()
        assert service.version == 0 and await service.refresh() == []

        first = await operator.propose({"train.learning_rate": 5e-5, "train.batch_size": 4}, author="alice")
        assert first.version == 1
        assert {(c.key, c.old, c.new, c.live) for c in first.changes} == {
            ("train.learning_rate", 1e-3, 5e-5, True),
            ("train.batch_size", 8, 4, False),
        }
        assert await service.refresh() == ["train.learning_rate"]  # batch_size changed too, but only at a restart
        assert service.cfg.train.learning_rate == 5e-5 and service.version == 1
        assert service.cfg.train.batch_size == 8  # restart-only: a running service keeps what it started with

        with pytest.raises(ConfigError, match=r"sampling.temperature: Input should be greater than 0"):
            await operator.propose({"sampling.temperature": -1}, author="bob")
        with pytest.raises(ConfigError, match=r"train\.learnin_rate: no such field"):
            await operator.propose({"train.learnin_rate": 1}, author="bob")
        assert (await operator.propose({"sampling.temperature": 0.5}, author="bob", dry_run=True)).version == 2
        assert await service.refresh() == []  # refused and dry-run proposals store nothing

        second = await operator.propose(
            {"reward.functions": parse_value("{exact_match: 1.0, format: 0.2}")}, author="carol"
        )
        assert await service.refresh() == ["reward.functions"]
        assert service.cfg.reward.functions == {"exact_match": 1.0, "format": 0.2}
        assert service.cfg.train.learning_rate == 5e-5  # versions are cumulative

        # A webhook URL decides where alert payloads go (its path often holds a token): not changeable live,
        # and the refusal does not repeat it.
        hook = "https://hooks.example/T0/SECRET-TOKEN"
        for settings in ({"alerts.webhook_url": hook}, {"alerts": {"webhook_url": hook, "enabled": True}}):
            with pytest.raises(ConfigError, match=r"alerts\.webhook_url: is not changeable live") as refused:
                await operator.propose(settings, author="dave")
            assert "SECRET-TOKEN" not in str(refused.value)
        third = await operator.propose({"alerts.enabled": False}, author="dave")
        assert await service.refresh() == ["alerts.enabled"] and service.cfg.alerts.enabled is False
        fourth = await operator.propose({"alerts": {"enabled": True, "cooldown_steps": 5}}, author="dave")
        assert set(await service.refresh()) == {"alerts", "alerts.enabled"} and service.cfg.alerts.cooldown_steps == 5

        history = await operator.history()
        assert [(v.version, v.author) for v in history] == [
            (1, "alice"),
            (2, "carol"),
            (3, "dave"),
            (4, "dave"),
        ] and second.version == 2
        assert "SECRET-TOKEN" not in repr([third.changes, fourth.changes, [v.changes for v in history]])
        assert [(c.key, c.old, c.new) for c in third.changes] == [("alerts.enabled", True, False)]
        # A service started later takes every stored change, restart-only ones included.
        late = await LiveConfig(base, service_conn.jetstream()).start()
        assert late.cfg.train.batch_size == 4 and late.version == 4
        # That is the config every service process starts with (run_service passes it to its main).
        assert (await stored_config(base)).train.batch_size == 4
        # Which run and broker a service belongs to, and who starts its replicas, are not the admin's to change.
        for key, value in (
            ("nats.url", "nats://elsewhere:4222"),
            ("nats", {"url": "nats://elsewhere:4222"}),
            ("run_id", "other"),
            ("supervision.scaler", "launcher"),  # an orchestrator's replicas are not rlpipe scale's
        ):
            with pytest.raises(ConfigError, match=rf"{key}: names the run and its broker"):
                await operator.propose({key: value}, author="eve")
        await operator_conn.close()
        await service_conn.close()

    asyncio.run(scenario())


@pytest.mark.unit
def test_values_parse_as_yaml_and_malformed_ones_are_named():
    assert [parse_value(v) for v in ("5e-5", "[notify, pause]", "true", "")] == ["5e-5", ["notify", "pause"], True, ""]
    with pytest.raises(ConfigError, match="is not valid YAML"):
        parse_value("[unclosed")


def test_a_running_trainer_refuses_security_settings_and_new_plugins_and_imports_nothing(
    base, nats_url, tmp_path, monkeypatch
):
    (tmp_path / "live_admin_plugin.py").write_text("def score(prompt, completion, answer):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    async def scenario():
        connection = await nats.connect(nats_url)
        trainer = await LiveConfig(base, connection.jetstream()).start()
        for settings, refusal in (
            ({"checkpoint.store_url": "s3://elsewhere/run"}, r"checkpoint\.store_url: is not changeable live"),
            ({"reward": {"http": {"url": "https://elsewhere/score"}}}, r"reward\.http\.url: is not changeable live"),
            ({"admin.tls_cert": "/tmp/cert.pem"}, r"admin\.tls_cert: is not changeable live"),
            # What a security review found an admin token could redirect at each role's next start (or, for the
            # reward token file, at once: pointed at /proc/self/environ it sent the environment as the token).
            ({"rollout.environment_url": "http://elsewhere/env"}, r"rollout\.environment_url: is not changeable"),
            ({"service.trainer_host": "elsewhere"}, r"service\.trainer_host: is not changeable live"),
            ({"rollout.relay_host": "elsewhere"}, r"rollout\.relay_host: is not changeable live"),
            ({"metrics_path": "/tmp/elsewhere.jsonl"}, r"metrics_path: is not changeable live"),
            ({"runs_dir": "/tmp/elsewhere"}, r"runs_dir: is not changeable live"),
            ({"service.log_dir": "/tmp/elsewhere"}, r"service\.log_dir: is not changeable live"),
            ({"reward.http.token_file": "/proc/self/environ"}, r"reward\.http\.token_file: is not changeable live"),
            (
                {"reward.functions": {"exact_match": 1.0, "live_admin_plugin:score": 1.0}},
                r"reward\.functions: 'live_admin_plugin:score' is a 'module:function' plugin",
            ),
        ):
            with pytest.raises(ConfigError, match=refusal):
                await trainer.propose(settings, author="mallory")
        assert "live_admin_plugin" not in sys.modules  # validating a change never imported it
        assert await trainer.history() == []  # nothing was stored
        await connection.close()

    try:
        asyncio.run(scenario())
    finally:
        sys.modules.pop("live_admin_plugin", None)
