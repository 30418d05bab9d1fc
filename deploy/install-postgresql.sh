#!/bin/sh
# PostgreSQL's server binaries (initdb, pg_ctl, postgres) for the tuner's shared-study tests:
# tests/tuner/conftest.py starts a throwaway cluster of its own on a free port, so no server needs to
# run. Debian's `postgresql` package, installed only when initdb is neither on PATH nor under
# /usr/lib/postgresql/<version>/bin (where Debian puts it). CI (.ci/run) runs this.
#
# usage: deploy/install-postgresql.sh
set -eu

if command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    sudo=sudo
else
    sudo=
fi
$sudo apt-get update
# The package's post-install script creates and starts a default cluster where it can; the tests do not use it.
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y --no-install-recommends postgresql
ls /usr/lib/postgresql/*/bin/initdb
