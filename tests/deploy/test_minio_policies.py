"""deploy/minio/*.json: each role's store user may touch what that role reads and writes, and nothing else.

No MinIO runs here, so the policies are evaluated as S3 evaluates an Allow-only policy: an action is allowed when a
statement names it (wildcards as in IAM), names the resource, and its StringLike condition on s3:prefix holds."""

from __future__ import annotations

import json
from fnmatch import fnmatchcase

import pytest

from services.common.transport.claims import claim_prefix
from tests.support.deploy import DEPLOY, load_yaml

pytestmark = pytest.mark.unit

RUN = load_yaml(DEPLOY / "config" / "dev.yaml")["run_id"]


def store_location() -> tuple[str, str]:
    """The bucket and key prefix of the compose deployment's store (s3://rlpipe/checkpoints)."""
    url = load_yaml(DEPLOY / "config" / "dev.yaml")["checkpoint"]["store_url"]
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    return bucket, prefix


def allowed(policy: str, action: str, key: str | None = None, list_prefix: str | None = None) -> bool:
    """Whether ``policy`` allows ``action`` on ``key`` of the store (an object), or on the bucket with
    ``list_prefix``."""
    bucket, prefix = store_location()
    resource = f"arn:aws:s3:::{bucket}/{prefix}/{key}" if key is not None else f"arn:aws:s3:::{bucket}"
    document = json.loads((DEPLOY / "minio" / f"{policy}.json").read_text())
    for statement in document["Statement"]:
        assert statement["Effect"] == "Allow"
        if not any(fnmatchcase(action, pattern) for pattern in statement["Action"]):
            continue
        if not any(fnmatchcase(resource, pattern) for pattern in statement["Resource"]):
            continue
        condition = statement.get("Condition", {}).get("StringLike", {}).get("s3:prefix")
        if condition is not None:
            asked = f"{prefix}/{list_prefix}" if list_prefix is not None else None
            if asked is None or not any(fnmatchcase(asked, pattern) for pattern in condition):
                continue
        return True
    return False


CLAIM = f"{claim_prefix(RUN)}rollouts/m1-0123456789abcdef"
CHECKPOINT = f"{RUN}/step_00000100/model.safetensors"
MANIFEST = f"{RUN}/step_00000100/manifest.json"


def test_a_stage_reads_and_writes_claim_checked_bodies_and_nothing_of_the_checkpoints():
    for action in ("s3:GetObject", "s3:PutObject", "s3:DeleteObject"):
        assert allowed("stage", action, CLAIM), action
        assert not allowed("stage", action, CHECKPOINT), action
        assert not allowed("stage", action, MANIFEST), action
    assert allowed("stage", "s3:ListBucket", list_prefix=claim_prefix(RUN))
    assert not allowed("stage", "s3:ListBucket", list_prefix=f"{RUN}/")
    assert not allowed("stage", "s3:ListBucket")
    for action in ("s3:CreateBucket", "s3:DeleteBucket", "s3:PutBucketPolicy"):
        assert not allowed("stage", action), action


def test_the_trainer_owns_checkpoints_and_claims_under_the_store_prefix_only():
    for action in ("s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"):
        assert allowed("trainer", action, CHECKPOINT), action
        assert allowed("trainer", action, CLAIM), action
    assert allowed("trainer", "s3:ListBucket", list_prefix=f"{RUN}/")
    assert allowed("trainer", "s3:CreateBucket")  # a put recreates a bucket removed by hand
    bucket, _ = store_location()
    assert not any(
        fnmatchcase(f"arn:aws:s3:::{bucket}/elsewhere/x", pattern)
        for statement in json.loads((DEPLOY / "minio" / "trainer.json").read_text())["Statement"]
        for pattern in statement["Resource"]
    )
    for action in ("s3:DeleteBucket", "s3:PutBucketPolicy", "admin:*"):
        assert not allowed("trainer", action), action


def test_the_trainer_writes_the_production_checkpoint_mirror_the_operator_reads_it_and_stages_do_not():
    mirror = load_yaml(DEPLOY / "config" / "prod.yaml")["checkpoint"]["mirror_url"]
    bucket, _, prefix = mirror.removeprefix("s3://").partition("/")
    key = f"arn:aws:s3:::{bucket}/{prefix}/{CHECKPOINT}"

    def grants(policy: str, action: str, resource: str) -> bool:
        return any(
            any(fnmatchcase(action, a) for a in statement["Action"])
            and any(fnmatchcase(resource, r) for r in statement["Resource"])
            for statement in json.loads((DEPLOY / "minio" / f"{policy}.json").read_text())["Statement"]
        )

    for action in ("s3:PutObject", "s3:GetObject", "s3:DeleteObject"):
        assert grants("trainer", action, key), action
        assert not grants("stage", action, key), action
    assert grants("trainer", "s3:ListBucket", f"arn:aws:s3:::{bucket}")
    # The operator's `rlpipe checkpoints verify --all` reads the mirror too, and writes nothing there.
    assert grants("operator", "s3:GetObject", key) and grants("operator", "s3:ListBucket", f"arn:aws:s3:::{bucket}")
    assert not grants("operator", "s3:PutObject", key) and not grants("operator", "s3:DeleteObject", key)


def test_the_operator_reads_checkpoints_and_writes_nothing():
    assert allowed("operator", "s3:GetObject", MANIFEST)
    assert allowed("operator", "s3:ListBucket", list_prefix=f"{RUN}/")
    for key in (CHECKPOINT, CLAIM):
        for action in ("s3:PutObject", "s3:DeleteObject"):
            assert not allowed("operator", action, key), (action, key)
