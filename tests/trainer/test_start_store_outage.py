"""A checkpoint store out of reach when a trainer process starts: a restart (a resume) waits for it, a fresh start
refuses. Real trainer processes (``python -m services.trainer``), a real nats-server and a moto S3 endpoint that the
test stops and starts."""

import signal

import pytest

from services.common.service import EXIT_REFUSED
from tests.support.runs import config_file
from tests.support.trainer import TrainerProcess

pytestmark = pytest.mark.integration

S3_KEYS = {"RLPIPE_S3_ACCESS_KEY": "testing", "RLPIPE_S3_SECRET_KEY": "testing"}


def test_a_trainer_restarted_while_its_store_is_down_waits_for_it_and_a_fresh_start_is_refused(
    tiny_model, tmp_path, nats_url, s3
):
    """Before, the start-up check's probe failed the restart with exit 2 (which the launcher never restarts), so a
    passing store outage at a trainer's restart ended the run before the resume's wait could hold it."""
    config = config_file(tmp_path, tiny_model, checkpoint=s3.checkpoint(resume_wait_s=300))
    s3.stop()
    restarted = TrainerProcess(config, nats_url, RLPIPE_CHECKPOINT__RESUME="true", **S3_KEYS)
    try:
        waiting = restarted.wait_event("resume_waiting")
        assert "cannot read the lease fence" in waiting["error"] and waiting["alert"] is True
        assert restarted.event("startup_check_failed") is None
        s3.start()
        restarted.wait_event("ready")
        restarted.process.send_signal(signal.SIGTERM)
        assert restarted.wait_exit() == 0
    finally:
        if restarted.process.poll() is None:
            restarted.process.kill()

    s3.stop()  # a first start against a store never reached: the endpoint is most likely wrong
    fresh = TrainerProcess(config, nats_url, RLPIPE_CHECKPOINT__RESUME="false", **S3_KEYS)
    assert fresh.wait_exit() == EXIT_REFUSED
    said = "".join(fresh.output)
    assert "storage: s3://ckpt/prefix: write failed:" in said and "never reached at a fresh start" in said
