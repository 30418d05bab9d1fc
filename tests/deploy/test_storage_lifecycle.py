"""The storage lifecycle: the bucket rules for leftover work-queue claim bodies, idle checkpoints and run archives
(compose's MinIO and S3), and Prometheus's retention."""

from __future__ import annotations

import json

import pytest

from services.common.config import NatsConfig
from services.common.transport.lifecycle_tags import ARCHIVE_TAG, CHECKPOINT_TAG, TRANSIENT_TAG
from tests.support.deploy import DEPLOY, load_yaml

pytestmark = pytest.mark.unit

DAY_S = 86400


def rules(where: str) -> dict[str, dict]:
    """Rule ID -> rule of ``deploy/<where>/lifecycle.json``."""
    document = json.loads((DEPLOY / where / "lifecycle.json").read_text())
    return {rule["ID"]: rule for rule in document["Rules"]}


def tag_filter(tag: tuple[str, str]) -> dict:
    return {"Tag": {"Key": tag[0], "Value": tag[1]}}


@pytest.mark.parametrize("where", ["minio", "s3"])
def test_each_rule_selects_by_one_tag_rlpipe_puts_and_claims_outlive_their_dead_letter(where):
    found = rules(where)
    assert all(rule["Status"] == "Enabled" for rule in found.values())
    claims, checkpoints, archives = (
        found["rlpipe-work-queue-claims"],
        found["rlpipe-idle-checkpoints"],
        found["rlpipe-run-archives"],
    )
    # Selected by the tag alone: EXPERIENCE bodies and the run's fence (untagged) are the trainer's.
    assert claims["Filter"] == tag_filter(TRANSIENT_TAG)
    assert checkpoints["Filter"] == tag_filter(CHECKPOINT_TAG)
    assert archives["Filter"] == tag_filter(ARCHIVE_TAG)
    # A dead letter's body must be readable (rlpipe dead-letters, --reinject) as long as DEAD keeps the letter.
    assert claims["Expiration"]["Days"] * DAY_S > NatsConfig().dead_letter_max_age_s
    assert archives["Expiration"] == {"Days": 365}


def test_compose_expires_idle_checkpoints_and_s3_moves_them_to_colder_classes_that_read_at_once():
    assert rules("minio")["rlpipe-idle-checkpoints"]["Expiration"] == {"Days": 180}
    on_s3 = rules("s3")["rlpipe-idle-checkpoints"]
    assert "Expiration" not in on_s3  # never deleted: a resume or rollback reads them as they are
    # Both classes serve a GET at once (no restore): Glacier Flexible or Deep Archive would break a resume.
    assert on_s3["Transitions"] == [
        {"Days": 30, "StorageClass": "STANDARD_IA"},
        {"Days": 90, "StorageClass": "GLACIER_IR"},
    ]
    assert rules("s3")["rlpipe-incomplete-uploads"]["AbortIncompleteMultipartUpload"] == {"DaysAfterInitiation": 7}


def test_the_compose_init_step_imports_the_rules_into_both_buckets_and_the_store_users_may_tag_what_they_put():
    init = (DEPLOY / "minio" / "init.sh").read_text().splitlines()
    assert "for bucket in rlpipe rlpipe-mirror; do" in init
    assert '    mc ilm rule import "rlpipe/$bucket" <"$policies/lifecycle.json"' in init
    for policy in ("stage", "trainer"):
        statements = json.loads((DEPLOY / "minio" / f"{policy}.json").read_text())["Statement"]
        putting = [s for s in statements if "s3:PutObject" in s["Action"]]
        assert [("s3:PutObjectTagging" in s["Action"]) for s in putting] == [True]


def test_prometheus_keeps_its_series_for_a_bounded_time_and_size():
    command = load_yaml(DEPLOY / "compose.yaml")["services"]["prometheus"]["command"]
    assert "--storage.tsdb.retention.time=30d" in command
    assert "--storage.tsdb.retention.size=20GB" in command
    assert "--config.file=/etc/prometheus/prometheus.yml" in command  # the image's own arguments kept
