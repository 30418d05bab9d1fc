"""A throwaway PostgreSQL cluster for the tuner's shared-study tests: ``initdb`` + ``pg_ctl`` on a free port.

The binaries come from PATH or Debian's /usr/lib/postgresql/<version>/bin (``deploy/install-postgresql.sh``
installs them; CI runs it). PostgreSQL refuses to run as root, so as root the cluster belongs to the
``postgres`` user the Debian package creates (else ``nobody``) and lives in a directory of its own under
the system temp dir: pytest's tmp_path sits below a root-only 0700 folder that user cannot enter.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.support.servers import free_port


def postgres_bin(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)
    if found is None:
        pytest.fail(
            f"no PostgreSQL {name}: the shared-study tests need a real server. "
            "Run `sh deploy/install-postgresql.sh` (Debian's postgresql package; .ci/run does)"
        )
    return found


def as_cluster_owner() -> tuple[list[str], int | None]:
    """The command prefix that runs a PostgreSQL binary as a user it accepts, and that user's uid (None: us)."""
    if os.geteuid() != 0:
        return [], None
    for name in ("postgres", "nobody"):
        try:
            uid = pwd.getpwnam(name).pw_uid
        except KeyError:
            continue
        runuser = shutil.which("runuser")
        if runuser is None:
            pytest.fail("running as root without runuser (util-linux): cannot start PostgreSQL as another user")
        return [runuser, "-u", name, "--"], uid
    pytest.fail("running as root and there is no postgres or nobody user to own the test PostgreSQL cluster")


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """``postgresql://tune@127.0.0.1:<port>/postgres`` of a cluster started for this test session."""
    prefix, uid = as_cluster_owner()
    home = Path(tempfile.mkdtemp(prefix="rlpipe-pg-"))
    data = home / "data"
    if uid is not None:
        os.chown(home, uid, -1)
    port = free_port()
    run = {"check": True, "capture_output": True, "text": True, "timeout": 120}
    subprocess.run(
        [*prefix, postgres_bin("initdb"), "-D", str(data), "-U", "tune", "--auth=trust", "-E", "UTF8"], **run
    )
    options = f"-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories='' -c fsync=off"
    pg_ctl = [*prefix, postgres_bin("pg_ctl"), "-D", str(data)]
    started = subprocess.run(
        [*pg_ctl, "-o", options, "-l", str(home / "server.log"), "-w", "start"], **{**run, "check": False}
    )
    if started.returncode != 0:
        log = (home / "server.log").read_text() if (home / "server.log").exists() else ""
        pytest.fail(f"pg_ctl start failed ({started.returncode}): {started.stderr}\n{log}")
    url = f"postgresql://tune@127.0.0.1:{port}/postgres"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                psycopg.connect(url, connect_timeout=2).close()
                break
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        yield url
    finally:
        subprocess.run([*pg_ctl, "-m", "immediate", "stop"], capture_output=True, timeout=60)
        shutil.rmtree(home, ignore_errors=True)
