"""A URL's credentials stay out of every text rlpipe writes: config dumps, config errors, log lines, events."""

import io
import json
import logging

import pytest
import yaml

from services.common.config import ConfigError, hide_url_secrets, load_config, redact, redacted_dump
from services.common.observe.events import Event, EventLog
from services.common.observe.logs import JsonFormatter, log_event
from services.common.transport.dead_letters import letter_headers
from services.common.transport.streams import H_REASON
from tests.support.runs import write_config

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "text, shown",
    [
        ("postgresql://ml:PW@db:5432/runs", "postgresql://ml:<redacted>@db:5432/runs"),
        ("nats://alice:PW@nats:4222", "nats://alice:<redacted>@nats:4222"),
        ("nats://PW@nats:4222", "nats://<redacted>@nats:4222"),  # token auth: the user name is the secret
        ("postgresql://ml:P@ss:PW@db/runs", "postgresql://ml:<redacted>@db/runs"),  # an unencoded "@" in it
        ("https://hooks.example/x?token=PW&v=2", "https://hooks.example/x?token=<redacted>&v=<redacted>"),
        ("cannot reach 'https://u:PW@r/score': refused", "cannot reach 'https://u:<redacted>@r/score': refused"),
        ("s3://bucket/run/step-3", "s3://bucket/run/step-3"),
        ("hf://gpt2@main", "hf://gpt2@main"),  # a model's repository and revision, no credential
        ("http://127.0.0.1:8000/score", "http://127.0.0.1:8000/score"),
        ("no address at all", "no address at all"),
    ],
)
def test_a_urls_password_token_and_query_values_are_hidden_and_the_rest_kept(text, shown):
    assert hide_url_secrets(text) == shown
    assert hide_url_secrets(shown) == shown


def config_with(tmp_path, config_only_model, **sections):
    model_dir, data_dir = config_only_model
    return write_config(tmp_path / "c.yaml", model_dir, data_dir, tmp_path / "runs", **sections)


def test_every_string_of_a_configs_dump_is_shown_without_url_credentials(tmp_path, config_only_model):
    path = config_with(
        tmp_path,
        config_only_model,
        telemetry={"mlflow_tracking_uri": "postgresql://ml:PW-mlflow@db/mlflow"},
        nats={"url": "nats://alice:PW-nats@nats:4222"},
    )
    dumped = yaml.safe_dump(redacted_dump(load_config(path)))
    assert "PW-" not in dumped and "postgresql://ml:<redacted>@db/mlflow" in dumped
    # Whatever field a URL lands in: every string leaf of the config's shape goes through the same redaction.
    data = load_config(path).model_dump(mode="json", by_alias=True)

    def planted(node, at=""):
        if isinstance(node, dict):
            return {key: planted(value, f"{at}.{key}") for key, value in node.items()}
        return f"https://user:PW{at}@host/x?k=PW{at}" if isinstance(node, str) else node

    assert "PW" not in json.dumps(redact("", planted(data)))


def test_a_config_error_quoting_a_url_hides_its_credentials(tmp_path, config_only_model):
    path = config_with(tmp_path, config_only_model, reward={"http": {"url": "ftp://scorer:PW-reward@r/score"}})
    with pytest.raises(ConfigError, match=r"reward\.http\.url") as refused:
        load_config(path)
    assert "PW-reward" not in str(refused.value) and "ftp://scorer:<redacted>@r/score" in str(refused.value)


def test_log_lines_events_and_dead_letter_reasons_hide_url_credentials(tmp_path):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter("reward", "run"))
    logger = logging.getLogger("test-redaction")
    logger.addHandler(handler)
    try:
        log_event(
            logger,
            Event.ALERT,
            level=logging.WARNING,
            url="https://u:PW-field@r/score",
            error="ConnectionError('nats://PW-token@b')",
        )
    finally:
        logger.removeHandler(handler)
    assert "PW-" not in stream.getvalue() and "https://u:<redacted>@r/score" in stream.getvalue()

    record = EventLog(tmp_path / "events.jsonl")
    record.write(Event.ALERT, "the reward service https://u:PW-event@r is down", url="https://u:PW-event@r")
    assert "PW-" not in (tmp_path / "events.jsonl").read_text()

    headers = letter_headers({}, "https://u:PW-dead@r/score answered 500", "rollouts", 7, "reward")
    assert headers[H_REASON] == "https://u:<redacted>@r/score answered 500"
