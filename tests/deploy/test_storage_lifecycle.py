"""The compose deployment's storage lifecycle: the bucket rule that expires leftover work-queue claim bodies, and
Prometheus's retention."""

from __future__ import annotations

import json

import pytest

from services.common.config import NatsConfig
from services.common.transport.claim_lifecycle import TRANSIENT_TAG
from tests.deploy.conftest import DEPLOY, load_yaml

pytestmark = pytest.mark.unit

DAY_S = 86400


def lifecycle() -> dict:
    return json.loads((DEPLOY / "minio" / "lifecycle.json").read_text())


def test_the_bucket_rule_expires_only_tagged_work_queue_claims_and_outlives_a_dead_letter():
    (rule,) = lifecycle()["Rules"]
    assert rule["Status"] == "Enabled"
    # Selected by the tag alone: checkpoints and EXPERIENCE bodies (untagged) are the trainer's to prune.
    assert rule["Filter"] == {"Tag": {"Key": TRANSIENT_TAG[0], "Value": TRANSIENT_TAG[1]}}
    # A dead letter's body must be readable (rlpipe dead-letters, --reinject) as long as DEAD keeps the letter.
    assert rule["Expiration"]["Days"] * DAY_S > NatsConfig().dead_letter_max_age_s


def test_the_compose_init_step_imports_the_rule_whole_and_the_store_users_may_tag_what_they_put():
    init = (DEPLOY / "minio" / "init.sh").read_text()
    assert 'mc ilm rule import rlpipe/rlpipe <"$policies/lifecycle.json"' in init.splitlines()
    for policy in ("stage", "trainer"):
        statements = json.loads((DEPLOY / "minio" / f"{policy}.json").read_text())["Statement"]
        putting = [s for s in statements if "s3:PutObject" in s["Action"]]
        assert [("s3:PutObjectTagging" in s["Action"]) for s in putting] == [True]


def test_prometheus_keeps_its_series_for_a_bounded_time_and_size():
    command = load_yaml(DEPLOY / "compose.yaml")["services"]["prometheus"]["command"]
    assert "--storage.tsdb.retention.time=30d" in command
    assert "--storage.tsdb.retention.size=20GB" in command
    assert "--config.file=/etc/prometheus/prometheus.yml" in command  # the image's own arguments kept
