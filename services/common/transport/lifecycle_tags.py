"""The object tags a bucket's lifecycle rules select (deploy/minio/lifecycle.json, deploy/s3/lifecycle.json).

A rule cannot match a key pattern under every run's prefix (``<run>/claims/``, ``<run>/step-N/``, ``<run>/archive/``),
so what a rule may expire or move to colder storage is tagged when it is stored, and each rule names one tag:

- ``TRANSIENT_TAG``: a work queue's claim-checked body, garbage once consumed (``claim_lifecycle``); expired.
- ``CHECKPOINT_TAG``: every object of a checkpoint step (parts, manifest, markers); moved to colder storage where
  the store has it, expired after a long idle time in the single-box compose bucket (docs/operations.md).
- ``ARCHIVE_TAG``: a run's archived record (``services.cli.launch.archive``): logs, metrics, events; expired after a
  year.

Untagged: EXPERIENCE's bodies (the trainer purges them), the fence and the purge notes (a run's bookkeeping, small).
"""

from __future__ import annotations

TRANSIENT_TAG = ("rlpipe-claim", "work-queue")
CHECKPOINT_TAG = ("rlpipe-kind", "checkpoint")
ARCHIVE_TAG = ("rlpipe-kind", "archive")
