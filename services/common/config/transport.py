"""The transport sections: checkpoint storage, the NATS broker and its streams, and the WeightSync port's TLS."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from services.common.config.base import DeployTime, Live, Restart, Section, Security


class CheckpointConfig(Section):
    store_url: Security[str] = Field(
        default="", description="file:///path or s3://bucket/prefix; empty = file://<runs_dir>"
    )
    save_every_steps: Live[int] = Field(default=25, ge=0, description="0 saves only at the end")
    keep_last: Live[int] = Field(
        default=3, ge=1, description="newest checkpoints kept; older ones are pruned unless marked stable (count)"
    )
    optimizer_every: Restart[int] = Field(
        default=1,
        ge=1,
        description="the optimizer state (AdamW's moments, twice the float32 weights' bytes) goes into every K-th "
        "periodic save (count of saves, by step: step / save_every_steps divisible by K); the others hold weights, "
        "schedule and RNG only, and a resume or rollback to one starts the optimizer fresh (event optimizer_fresh). "
        "Saves at a stop, at the end of a run and on request always hold it",
    )
    weights_dtype: Restart[Literal["master", "serving"]] = Field(
        default="master",
        description="dtype of the saved weights: master = the trainer's own (float32 master weights: a resume is "
        "exact); serving = model.dtype (half the bytes when it is bfloat16; a resume widens them back to the master "
        "dtype and is not bit-exact)",
    )
    compression: Restart[Literal["none", "zlib"]] = Field(
        default="none",
        description="how a save stores its weights and optimizer state: none = as they are; zlib = their bytes "
        "shuffled by element size and deflated (about 14% smaller in float32, 30% in bfloat16, at 10 to 30 MB/s "
        "of one core: worth it only on a link slower than that, or to pay for less storage; docs/performance.md). "
        "Steps saved either way load either way",
    )
    resume: Restart[bool] = Field(
        default=True, description="a starting trainer continues from the latest valid checkpoint"
    )
    resume_step: Restart[int | None] = Field(
        default=None,
        ge=0,
        description="continue from this step instead of the latest, once: a restart after that resume (the "
        "launcher's, or a later --resume) continues from the newest step",
    )
    resume_wait_s: Restart[float] = Field(
        default=300.0,
        ge=0,
        description="seconds a resuming trainer waits for a checkpoint store it cannot read (or that lacks the "
        "step this run's own record says it saved) before it refuses to start; it never starts from base weights",
    )
    s3_endpoint: Security[str] = Field(default="", description="host:port of the S3 endpoint for s3:// URLs")
    s3_secure: Security[bool] = Field(
        default=True, description="speak HTTPS to s3_endpoint; false = plain HTTP (a local MinIO)"
    )
    s3_ca_file: Security[Path | None] = Field(
        default=None,
        description="PEM CA bundle the S3 endpoint's certificate must chain to (with s3_secure), e.g. the "
        "compose deployment's own CA for its MinIO; null: the public CAs (certifi)",
    )
    s3_region: Security[str] = Field(default="us-east-1", description="the S3 region requests are signed for")
    s3_part_mib: Restart[int] = Field(
        default=16, ge=5, description="multipart part size; larger objects upload in parallel parts"
    )
    s3_parallel_uploads: Restart[int] = Field(
        default=4, ge=1, description="multipart parts one upload sends at once (parts)"
    )
    s3_object_tags: Restart[bool] = Field(
        default=True,
        description="tag what is stored (claim bodies, checkpoint steps, run archives) for the bucket's lifecycle "
        "rules (docs/operations.md), which needs s3:PutObjectTagging; false for an S3-compatible store without "
        "object tagging (then no rule can select them)",
    )
    mirror_url: Security[str] = Field(
        default="", description="a second store (file:// or s3:// on the same endpoint) that gets a copy of every step"
    )
    min_free_mib: Restart[int] = Field(
        default=1024,
        ge=0,
        description="free space a save needs at least on the runs directory (and a file:// store) when no "
        "checkpoint has been saved yet to measure; the disk_space_low alert fires below twice what a save needs",
    )

    @field_validator("store_url", "mirror_url")
    @classmethod
    def _scheme(cls, url: str) -> str:
        if url and not re.match(r"^(file|s3)://.+", url):
            raise ValueError(f"{url!r} must start with file:// or s3://")
        return url

    @field_validator("s3_ca_file")
    @classmethod
    def _ca_exists(cls, path: Path | None) -> Path | None:
        if path is not None and not path.is_file():
            raise ValueError(f"file {str(path)!r} does not exist")
        return path


class NatsConfig(Section):
    url: DeployTime[str] = Field(
        default="nats://127.0.0.1:4222", description="the broker: nats://host:port, or tls://host:port for TLS"
    )
    nkey_seed_file: DeployTime[Path | None] = Field(
        default=None,
        description="file holding this service's NATS nkey seed (SU...), readable by it alone; the broker admits that "
        "key with its role's permissions only (services/common/transport/nats_auth.py). rlpipe run generates "
        "one per role; null connects without authentication",
    )
    tls_ca_file: DeployTime[Path | None] = Field(
        default=None,
        description="PEM CA bundle the broker's certificate must chain to (a tls:// url); null: system CAs",
    )
    storage: Restart[Literal["file", "memory"]] = Field(
        default="file",
        description="where streams and buckets keep their messages; memory loses them when the broker stops",
    )
    stream_replicas: Restart[int] = Field(
        default=1, ge=1, le=5, description="copies of every stream and bucket in a NATS cluster (3 in production)"
    )
    sync_always: Restart[bool] = Field(
        default=False,
        description="embedded nats-server fsyncs every write (sync_interval: always); the default 2 min "
        "interval can lose acknowledged messages on power loss. Production brokers must set it in their own config.",
    )
    ack_wait_s: Restart[float] = Field(
        default=60.0, gt=0, description="time a stage has to finish a message before redelivery"
    )
    max_deliver: Restart[int] = Field(
        default=5,
        ge=1,
        description="deliveries of one message before it is dead-lettered with reason max_deliver (count)",
    )
    max_ack_pending: Restart[int] = Field(
        default=256,
        ge=1,
        description="messages one stage's consumer may hold unacknowledged across its replicas (count)",
    )
    duplicate_window_s: Restart[float] = Field(
        default=1800.0,
        gt=0,
        description="how long JetStream remembers a message id to drop a repeated publish (seconds); longer than "
        "ack_wait_s * max_deliver",
    )
    dead_letter_max_age_s: Restart[float] = Field(
        default=14 * 86400.0,
        gt=0,
        description="DEAD keeps a dead letter this long for `rlpipe dead-letters` to list or re-inject, then drops it",
    )
    heartbeat_s: Restart[float] = Field(default=10.0, gt=0, description="in_progress() interval during long work")
    max_work_s: Restart[float] = Field(
        default=900.0,
        gt=0,
        description="longest a stage may compute one batch: past it the work is abandoned and the messages nakked "
        "with backoff (DEAD with reason timeout after max_deliver tries); a loop without progress for twice this "
        "long reports NOT_SERVING on its gRPC health, so liveness probes restart it",
    )
    fetch_timeout_s: Restart[float] = Field(
        default=1.0,
        gt=0,
        description="longest one pull of a stage waits for messages before it looks around again (seconds)",
    )
    max_message_bytes: Restart[int] = Field(
        default=512 * 1024, ge=1024, description="larger messages are dead-lettered (server max is 1 MiB)"
    )
    claim_check_bytes: Restart[int] = Field(
        default=256 * 1024,
        ge=512,
        description="a larger group goes to the object store and the message carries its key",
    )
    max_claim_bytes: Restart[int] = Field(
        default=256 << 20,
        ge=1024,
        description="bytes; a claim-checked body declared larger is dead-lettered unread, and a stored one is read "
        "no further than its declared size",
    )

    @field_validator("nkey_seed_file", "tls_ca_file")
    @classmethod
    def _readable_file(cls, path: Path | None) -> Path | None:
        if path is not None and not path.is_file():
            raise ValueError(f"file {str(path)!r} does not exist")
        return path

    @model_validator(mode="after")
    def _claims_below_the_limit(self) -> NatsConfig:
        if self.claim_check_bytes >= self.max_message_bytes:
            raise ValueError(
                "claim_check_bytes must be below max_message_bytes, or large groups would be dead-lettered"
            )
        if self.max_claim_bytes <= self.claim_check_bytes:
            raise ValueError("max_claim_bytes must be above claim_check_bytes, or every claim-checked group is refused")
        return self

    @model_validator(mode="after")
    def _heartbeat_within_ack_wait(self) -> NatsConfig:
        if self.heartbeat_s >= self.ack_wait_s:
            raise ValueError(
                f"heartbeat_s ({self.heartbeat_s}) must be below ack_wait_s ({self.ack_wait_s}), "
                "or long work is redelivered while it still runs"
            )
        return self

    @model_validator(mode="after")
    def _dedup_outlives_redelivery(self) -> NatsConfig:
        if self.duplicate_window_s <= self.ack_wait_s * self.max_deliver:
            raise ValueError(
                "duplicate_window_s must be longer than ack_wait_s * max_deliver "
                f"({self.ack_wait_s} * {self.max_deliver}) so a redelivered compute cannot publish twice"
            )
        return self


class WeightSyncConfig(Section):
    """TLS of the trainer's WeightSync port and of relaying rollouts' ports; the run's token (RLPIPE_WEIGHTSYNC_TOKEN)
    is a credential, not config."""

    tls_cert: Security[Path | None] = Field(
        default=None,
        description="PEM certificate chain; with tls_key, the trainer's WeightSync port (and a relaying rollout's "
        "gRPC port) speaks TLS only",
    )
    tls_key: Security[Path | None] = Field(default=None, description="PEM private key of tls_cert")
    tls_ca: Security[Path | None] = Field(
        default=None,
        description="PEM CA a rollout checks the trainer's WeightSync certificate against; set = connect by TLS",
    )

    @model_validator(mode="after")
    def _cert_and_key_together(self) -> WeightSyncConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("set both tls_cert and tls_key, or neither")
        for path in (self.tls_cert, self.tls_key, self.tls_ca):
            if path is not None and not path.is_file():
                raise ValueError(f"file {str(path)!r} does not exist")
        return self
