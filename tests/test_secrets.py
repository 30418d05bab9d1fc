"""No credential leaves its place: a whole run with a distinctive token planted in every credential the run holds,
and a reward token rotated to one that cannot be sent, then every file of the run directory searched for them."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.observe.records import read_jsonl
from tests.support.runs import (
    config_file,
    metric_rows,
    rlpipe,
    rlpipe_command,
    running_pipeline,
    service_events,
    wait_for,
)
from tests.support.servers import free_port, start_reward_server

pytestmark = pytest.mark.e2e

# Each planted where the run reads it; none may appear anywhere but the one file that is its store.
REWARD_TOKEN = "PLANTED-reward-token-7f3a"
ROTATED_LINE = "PLANTED-rotated-second-line-91c2"  # the second line of a rotation gone wrong
ADMIN_TOKEN = "PLANTED-admin-token-4b8e"
WEIGHT_SYNC_TOKEN = "PLANTED-weight-sync-token-c61d"
S3_ACCESS_KEY = "PLANTED-s3-access-key-2e90"
S3_SECRET_KEY = "PLANTED-s3-secret-key-d05b"
API_KEY = "PLANTED-reward-api-key-88aa"
PLANTED = (REWARD_TOKEN, ROTATED_LINE, ADMIN_TOKEN, WEIGHT_SYNC_TOKEN, S3_ACCESS_KEY, S3_SECRET_KEY, API_KEY)


def events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e.get("kind") == kind] if run_dir.exists() else []


def steps(run_dir: Path) -> int:
    return max((r.step or 0 for r in metric_rows(run_dir) if r.is_step), default=0) if run_dir.exists() else 0


def leaks(text: bytes | str, where: str) -> list[str]:
    data = text.encode() if isinstance(text, str) else text
    return [f"{secret} in {where}" for secret in PLANTED if secret.encode() in data]


def test_no_credential_reaches_a_log_event_metric_dead_letter_or_refusal_of_a_run(tiny_model, tmp_path, monkeypatch):
    """The reward token is rotated mid-run to two lines (before, http.client refused the header quoting it, and
    every group went to DEAD with the token in its reason): the groups are held, the trainer records
    dependency_refused at once naming the refusal, and the rewritten token lets the run go on. The admin refuses
    to repoint the token file (it was live: at /proc/self/environ it sent the environment as the token) or any
    endpoint. Then nothing the run wrote, nor anything an operator was shown, holds any planted credential."""
    port = free_port()
    token_file = tmp_path / "reward.token"
    token_file.write_text(REWARD_TOKEN + "\n")
    for name, value in (
        ("RLPIPE_ADMIN_TOKEN", ADMIN_TOKEN),
        ("RLPIPE_WEIGHTSYNC_TOKEN", WEIGHT_SYNC_TOKEN),
        ("RLPIPE_S3_ACCESS_KEY", S3_ACCESS_KEY),
        ("RLPIPE_S3_SECRET_KEY", S3_SECRET_KEY),
        ("TEST_REWARD_API_KEY", API_KEY),
    ):
        monkeypatch.setenv(name, value)
    config = config_file(
        tmp_path,
        tiny_model,
        "secrets.yaml",
        run_id="secrets",
        train={"total_steps": 1000, "batch_size": 4},  # open-ended: stopped below, never raced
        rollout={"prompts_per_batch": 8},
        reward={
            "functions": {"exact_match": 1.0},
            "http": {
                "url": f"http://127.0.0.1:{port}/score",
                "token_file": str(token_file),
                "headers_from_env": {"X-Api-Key": "TEST_REWARD_API_KEY"},
                "timeout_s": 5.0,
                "retries": 0,
            },
        },
    )
    run_dir = tmp_path / "runs" / "secrets"
    shown: list[tuple[str, str]] = []  # what operators were shown: (what, text)
    server = start_reward_server(port, "--token", REWARD_TOKEN)
    try:
        with running_pipeline(config) as process:
            wait_for(lambda: steps(run_dir) >= 1, "a step scored by the reward service", process, timeout=600)
            for setting in (
                "reward.http.token_file=/proc/self/environ",
                "rollout.environment_url=http://elsewhere/env",
                "service.trainer_host=elsewhere",
            ):
                refused = rlpipe(run_dir, "config", "set", setting)
                field = setting.partition("=")[0]
                assert refused.returncode != 0 and f"{field}: is not changeable live" in refused.stderr, refused
                shown.append((f"config set {field}", refused.stdout + refused.stderr))

            token_file.write_text(f"{REWARD_TOKEN}\n{ROTATED_LINE}\n")  # a rotation gone wrong
            wait_for(
                lambda: any(e.get("refusal") == "token" for e in events(run_dir, "dependency_refused")),
                "dependency_refused in the run's events",
                process,
                timeout=180,
            )
            [refusal] = events(run_dir, "dependency_refused")
            assert refusal["role"] == "reward" and "reward.http.token_file" in refusal["message"]
            token_file.write_text(REWARD_TOKEN + "\n")
            held_at = steps(run_dir)
            wait_for(lambda: steps(run_dir) >= held_at + 2, "steps after the token was fixed", process, timeout=300)
            wait_for(lambda: events(run_dir, "dependency_recovered"), "dependency_recovered", process, timeout=60)

            listed = rlpipe_command("dead-letters", str(run_dir), "--json")
            assert listed.returncode == 0, listed.stderr
            assert listed.stdout.strip() == ""  # held, never dead-lettered
            shown.append(("dead-letters", listed.stdout + listed.stderr))
            for command in (("status", "--json"), ("config", "show"), ("config", "history")):
                answer = rlpipe(run_dir, *command)
                shown.append((" ".join(command), answer.stdout + answer.stderr))
            assert rlpipe(run_dir, "stop").returncode == 0
            console, _ = process.communicate(timeout=300)
        assert process.returncode == 0, console[-3000:]
    finally:
        server.kill()
        server.wait()
    assert "dependency_refused" in console  # the launcher's console showed it
    shown.append(("the launcher's console", console))

    found = [leak for what, text in shown for leak in leaks(text, what)]
    searched = 0
    for path in sorted(run_dir.rglob("*")):
        if not path.is_file():
            continue
        if path == run_dir / "admin.token":  # the one store of the admin token: owner-only
            assert path.stat().st_mode & 0o777 == 0o600 and path.read_text().strip() == ADMIN_TOKEN
            continue
        found += leaks(path.read_bytes(), str(path.relative_to(run_dir)))
        searched += 1
    assert found == []
    # The search covered what the run wrote: every role's log, the events, the metrics, the broker's store.
    logs = {path.name for path in (run_dir / "logs").iterdir()}
    assert {"trainer.log", "reward-0.log", "rollout-0.log", "reference-0.log"} <= logs
    assert (run_dir / "events.jsonl").is_file() and (run_dir / "metrics.jsonl").is_file() and searched > 20
    # The reward stage alerted at its first refusal, naming it.
    down = [e for e in service_events(run_dir, "reward-0") if e["event"] == "dependency_down"]
    assert [(e["level"], e["kind"], e["refused"]) for e in down] == [("ERROR", "token", True)]
