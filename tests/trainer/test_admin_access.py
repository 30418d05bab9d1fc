"""Which token each Admin call needs: every method of proto/admin.proto is classified, the interceptor's decision on
a call follows the classification, the admin token and the read token, and a read token that is the admin token is
refused when the config loads."""

from __future__ import annotations

import itertools

import pytest

from services.common.config import Change, ConfigError
from services.common.config.live import field_classes, is_live
from services.common.pb import admin_pb2
from services.trainer.admin import (
    ADMIN_SERVICE,
    METHOD_ACCESS,
    Access,
    AdminToken,
    Verdict,
    access_needed,
    judge,
    read_only_refusal,
)
from tests.support.paths import ROOT
from tests.support.runs import run_config

pytestmark = pytest.mark.unit

ADMIN, READ = "admin-s3cret", "read-s3cret"
PROTO_METHODS = {method.name for method in admin_pb2.DESCRIPTOR.services_by_name["Admin"].methods}
READS = {"GetStatus", "GetConfig", "GetConfigHistory", "ListCheckpoints"}


def test_every_admin_method_in_the_proto_is_classified_so_a_new_rpc_cannot_silently_become_readable():
    assert set(METHOD_ACCESS) == PROTO_METHODS, "classify the new Admin method in services/trainer/admin.py"
    assert {name for name, access in METHOD_ACCESS.items() if access == Access.READ} == READS


def test_a_method_nobody_classified_needs_the_admin_token():
    assert access_needed(f"{ADMIN_SERVICE}GetStatus") == Access.READ
    assert access_needed(f"{ADMIN_SERVICE}SomeNewCall") == Access.ADMIN
    assert access_needed("/rlpipe.v1.WeightSync/GetStatus") == Access.ADMIN  # another service's method of that name


@pytest.mark.parametrize("method", sorted(PROTO_METHODS))
def test_the_admin_token_makes_every_call_and_the_read_token_only_the_reads(method):
    path = f"{ADMIN_SERVICE}{method}"
    assert judge(path, f"Bearer {ADMIN}", ADMIN, READ) == Verdict.ADMITTED
    assert judge(path, f"Bearer {ADMIN}", ADMIN, "") == Verdict.ADMITTED
    expected = Verdict.ADMITTED if method in READS else Verdict.READ_ONLY
    assert judge(path, f"Bearer {READ}", ADMIN, READ) == expected


@pytest.mark.parametrize(
    "authorization",
    ["", "Bearer ", f"Bearer {ADMIN}x", f"bearer {READ}", READ, f"Bearer {READ} ", "Bearer read-s3cre"],
)
def test_anything_but_a_token_in_force_is_unauthenticated(authorization):
    for method in PROTO_METHODS:
        assert judge(f"{ADMIN_SERVICE}{method}", authorization, ADMIN, READ) == Verdict.UNAUTHENTICATED


def test_without_a_read_token_an_empty_bearer_is_no_read_token():
    assert judge(f"{ADMIN_SERVICE}GetStatus", "Bearer ", ADMIN, "") == Verdict.UNAUTHENTICATED
    assert judge(f"{ADMIN_SERVICE}GetStatus", f"Bearer {READ}", ADMIN, "") == Verdict.UNAUTHENTICATED


def test_the_read_only_refusal_names_the_call_and_what_it_needs_never_a_token():
    said = read_only_refusal(f"{ADMIN_SERVICE}Rollback")
    assert said == "the read-only token may not call Rollback: it needs the admin token"


def test_the_read_token_file_is_read_at_start_and_again_when_it_changes(tmp_path):
    path = tmp_path / "admin-read.token"
    path.write_text("first\n")
    token = AdminToken(path=path, field="admin.read_token_file")
    assert token.current() == "first"
    path.write_text("second-one\n")  # another size: seen as a change even within the same clock tick
    assert token.current() == "second-one"
    path.write_text("")  # half-way through a rewrite: the token in force stands
    assert token.current() == "second-one"


def test_a_read_token_equal_to_the_admin_token_is_refused_at_load_naming_where_it_came_from(
    config_only_model, tmp_path, monkeypatch
):
    monkeypatch.delenv("RLPIPE_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("RLPIPE_ADMIN_READ_TOKEN", raising=False)
    admin_file, read_file = tmp_path / "admin.token", tmp_path / "admin-read.token"
    admin_file.write_text("LEAKED-same\n")
    read_file.write_text("LEAKED-same")  # the same token, however it is written
    files = {"token_file": str(admin_file), "read_token_file": str(read_file)}
    with pytest.raises(ConfigError) as from_files:
        run_config(tmp_path, config_only_model, admin=files)
    said = str(from_files.value)
    assert f"admin.read_token_file: the token in {str(read_file)!r} is the admin token" in said
    monkeypatch.setenv("RLPIPE_ADMIN_TOKEN", "LEAKED-other")
    assert run_config(tmp_path, config_only_model, admin=files).admin.read_token_file == read_file
    monkeypatch.setenv("RLPIPE_ADMIN_READ_TOKEN", "LEAKED-other")  # wins over the file, and is the admin token too
    with pytest.raises(ConfigError) as from_environment:
        run_config(tmp_path, config_only_model, admin=files)
    assert "RLPIPE_ADMIN_READ_TOKEN is the admin token" in str(from_environment.value)
    monkeypatch.delenv("RLPIPE_ADMIN_READ_TOKEN")
    assert "LEAKED" not in said + str(from_environment.value)


def test_a_read_token_file_that_does_not_exist_is_refused_at_load_naming_the_field(config_only_model, tmp_path):
    with pytest.raises(ConfigError, match=r"admin: .*file '.*/missing\.token' does not exist"):
        run_config(tmp_path, config_only_model, admin={"read_token_file": str(tmp_path / "missing.token")})
    assert not is_live("admin.read_token_file")
    assert field_classes()["admin.read_token_file"] == Change.SECURITY


def test_the_operations_guides_table_gives_each_admin_method_the_token_the_trainer_asks_for():
    lines = (ROOT / "docs" / "operations.md").read_text().splitlines()
    start = lines.index("| Admin method | `rlpipe` command | Token | Kubernetes role that can call it |")
    rows = itertools.takewhile(lambda line: line.startswith("|"), lines[start + 2 :])  # past the header's rule
    documented = {method.strip(" `"): token.strip() for method, _, token in (row.split("|")[1:4] for row in rows)}
    expected = {name: "read or admin" if access == Access.READ else "admin" for name, access in METHOD_ACCESS.items()}
    assert documented == expected


def test_a_read_token_rotated_to_equal_the_admin_token_only_reads_until_one_of_them_changes():
    """Refused at start, equality can still come from rotating either file: failing open would give every reader
    the admin's calls."""
    assert judge(f"{ADMIN_SERVICE}GetStatus", f"Bearer {ADMIN}", ADMIN, ADMIN) == Verdict.ADMITTED
    assert judge(f"{ADMIN_SERVICE}Pause", f"Bearer {ADMIN}", ADMIN, ADMIN) == Verdict.READ_ONLY
    assert judge(f"{ADMIN_SERVICE}Pause", f"Bearer {ADMIN}", ADMIN, READ) == Verdict.ADMITTED  # told apart again
