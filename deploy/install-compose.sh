#!/bin/sh
# Docker Compose v2, for tests/deploy/test_compose_config.py: `docker compose config` renders the root compose.yaml
# (its `include` of deploy/compose.yaml) for both profiles. `config` reads files only, so no Docker engine is needed.
# Machines here have the docker CLI without its compose plugin, and Debian 12's docker-compose is v1 (no `include`);
# Debian 13's package holds the static v2 binary, taken from its .deb without installing it. `make install` and CI
# (.ci/run) run this; the tests use build/tools/bin/docker-compose when it is there.
#
# usage: deploy/install-compose.sh [DEST]   (default: build/tools/bin)
set -eu

dest=${1:-build/tools/bin}
version=2.26.1
if [ -x "$dest/docker-compose" ] && "$dest/docker-compose" version 2>/dev/null | grep -q "version $version"; then
    exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
deb="docker-compose_${version}-4_amd64.deb"
sha256=47681197cb2b1ab88206b42a1a92fc75f50d9530a6322d03494a473eed0408ea
if curl -fsS -o "$tmp/$deb" "http://deb.debian.org/debian/pool/main/d/docker-compose/$deb" \
    && echo "$sha256  $tmp/$deb" | sha256sum -c --quiet; then
    :
else
    # The pinned build left the archive (a Debian point release replaced it): the current one, checked by apt
    # against Debian's signed index instead of the hash above.
    echo "the pinned $deb is gone from deb.debian.org; taking Debian 13's current docker-compose" >&2
    rm -f "$tmp/$deb"
    mkdir -p "$tmp/lists/partial"
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main" \
        > "$tmp/sources.list"
    apt_dirs="-o Dir::Etc::sourcelist=$tmp/sources.list -o Dir::Etc::sourceparts=- -o Dir::State::Lists=$tmp/lists"
    # shellcheck disable=SC2086 # the options are one word each
    apt-get -q $apt_dirs update > /dev/null
    # shellcheck disable=SC2086
    (cd "$tmp" && apt-get -q $apt_dirs download docker-compose > /dev/null 2>&1)
    version=$(dpkg-deb -f "$tmp"/docker-compose_*.deb Version | cut -d- -f1)
fi
dpkg-deb -x "$tmp"/docker-compose_*.deb "$tmp/x"
mkdir -p "$dest"
install -m 0755 "$tmp/x/usr/libexec/docker/cli-plugins/docker-compose" "$dest/docker-compose"
"$dest/docker-compose" version | grep -q "version $version"
echo "installed $("$dest/docker-compose" version) at $dest/docker-compose"
