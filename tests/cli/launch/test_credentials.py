from pathlib import Path

import pytest

from services.cli.launch.credentials import ROLE_TOKENS, RunCredentials, inherited_env
from services.common.transport.nats_connect import SERVICE_ROLES

pytestmark = pytest.mark.unit


def test_admin_and_read_token_files_kept_from_an_earlier_start_are_made_owner_only_and_new(tmp_path, monkeypatch):
    monkeypatch.delenv("RLPIPE_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("RLPIPE_ADMIN_READ_TOKEN", raising=False)
    credentials = RunCredentials(tmp_path)
    for path in (credentials.token_file, credentials.read_token_file):
        path.write_text("old\n")
        path.chmod(0o644)
    credentials.write_admin_tokens()
    assert credentials.read_token_file == credentials.token_file.with_name("admin-read.token")
    for path in (credentials.token_file, credentials.read_token_file):
        assert path.stat().st_mode & 0o777 == 0o600
        assert path.read_text() != "old\n"
    assert credentials.token_file.read_text() != credentials.read_token_file.read_text()


def test_the_read_token_comes_from_the_shell_when_set_and_goes_to_the_trainer_alone_as_a_file(tmp_path, monkeypatch):
    monkeypatch.setenv("RLPIPE_ADMIN_READ_TOKEN", "read-from-the-shell")
    credentials = RunCredentials.issue(tmp_path)
    assert credentials.read_token_file.read_text() == "read-from-the-shell\n"
    files = {role: credentials.role_env(role).get("RLPIPE_ADMIN__READ_TOKEN_FILE") for role in SERVICE_ROLES}
    assert files == {"trainer": str(credentials.read_token_file), "rollout": None, "reward": None, "reference": None}


def test_the_weight_sync_token_comes_from_the_shell_when_set_and_goes_to_the_trainer_and_the_rollouts_alone(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("RLPIPE_WEIGHTSYNC_TOKEN", "from-the-shell")
    credentials = RunCredentials.issue(tmp_path)
    tokens = {role: credentials.role_env(role).get("RLPIPE_WEIGHTSYNC_TOKEN") for role in SERVICE_ROLES}
    assert tokens == {"trainer": "from-the-shell", "rollout": "from-the-shell", "reward": None, "reference": None}
    monkeypatch.delenv("RLPIPE_WEIGHTSYNC_TOKEN")
    fresh = RunCredentials.issue(tmp_path).weight_sync_token
    assert fresh and fresh != "from-the-shell"


def test_each_start_issues_every_role_its_own_new_nats_key(tmp_path):
    first, second = RunCredentials.issue(tmp_path), RunCredentials.issue(tmp_path)
    seeds = {role: Path(first.role_env(role)["RLPIPE_NATS__NKEY_SEED_FILE"]) for role in SERVICE_ROLES}
    assert len(set(seeds.values())) == len(SERVICE_ROLES)
    assert first.nats_keys["trainer"].public_key != second.nats_keys["trainer"].public_key


def test_no_child_inherits_a_token_from_the_launching_shell(monkeypatch):
    for name in ROLE_TOKENS:
        monkeypatch.setenv(name, "from-the-shell")
    monkeypatch.setenv("RLPIPE_SOMETHING_ELSE", "kept")
    inherited = inherited_env()
    assert not set(ROLE_TOKENS) & set(inherited)
    assert inherited["RLPIPE_SOMETHING_ELSE"] == "kept"
    assert set(ROLE_TOKENS) == {"RLPIPE_ADMIN_TOKEN", "RLPIPE_ADMIN_READ_TOKEN", "RLPIPE_WEIGHTSYNC_TOKEN"}
