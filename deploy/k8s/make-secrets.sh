#!/bin/sh
# The NATS keys of a Kubernetes deployment, made fresh and printed as Secret manifests, for kubectl apply:
#   sh deploy/k8s/make-secrets.sh deploy/config/prod.yaml | kubectl -n rlpipe apply -f -
#   sh deploy/k8s/make-secrets.sh deploy/config/prod.yaml smol2 | kubectl -n rlpipe-smol2 apply -f -   # another run
# Run it from a checkout where rlpipe is installed (`make install`; PYTHON names another interpreter), before
# the first apply: the pods wait in ContainerCreating until their Secrets exist.
#   rlpipe-nats-auth     auth.conf: every role's public key and permissions (services/common/transport/nats_auth.py),
#                        mounted by the NATS pods alone
#   rlpipe-nats-<role>   nats.nk: that role's seed (trainer, rollout, reward, reference, operator), each
#                        mounted by its own role alone; operator is for `rlpipe` commands run by a person
#   rlpipe-weightsync    token: the run's WeightSync token, read by the trainer and the rollouts alone
# Not made here: rlpipe-store-<role> (RLPIPE_S3_ACCESS_KEY, RLPIPE_S3_SECRET_KEY), one user per role that your
# object store creates with the policy in deploy/minio/ (docs/operations.md, "Security").
# The keys exist only in a private temporary folder, removed on exit, and in the manifests on stdout.
# Running it again makes new keys: that is their rotation (docs/operations.md, "Security").
# TLS certificates are not made here: the cert-manager component makes them (nats-tls, trainer-admin-tls,
# weightsync-tls), or you do (docs/operations.md, "Security").
# usage: make-secrets.sh CONFIG [RUN_ID]   (the deployment's run config; RUN_ID, the overlay's RLPIPE_RUN_ID, names
# the subjects the keys are allowed: by default the config's run_id)
set -eu
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
    echo "usage: $0 CONFIG [RUN_ID]   (e.g. deploy/config/prod.yaml arith)" >&2
    exit 2
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"${PYTHON:-python3}" - "$1" "$tmp" "${2:-}" <<'PY'
import base64
import re
import secrets
import sys
from pathlib import Path

import yaml

from services.common.transport.nats_auth import write_deployment_credentials
from services.common.transport.nats_connect import ROLES

config, folder, given = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
# Only run_id matters here: the one given (the overlay's RLPIPE_RUN_ID, which the pods run with), else the file's.
# The whole config cannot be loaded on a workstation: its model and data paths are the pods' volumes.
run_id = given or (yaml.safe_load(config.read_text()) or {}).get("run_id")
if not isinstance(run_id, str) or not run_id:
    sys.exit(f"{config}: no run_id (the streams and subjects the keys are allowed are named after it)")
if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", run_id):
    sys.exit(f"run id {run_id!r}: 1-64 letters, digits, _ or - (the config's rule for run_id)")
auth = write_deployment_credentials(run_id, folder)


def secret(name: str, key: str, value: bytes) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "rlpipe"}},
        "type": "Opaque",
        "data": {key: base64.b64encode(value).decode()},
    }


manifests = [secret("rlpipe-nats-auth", "auth.conf", auth.read_bytes())]
manifests += [secret(f"rlpipe-nats-{role}", "nats.nk", (folder / role / "nats.nk").read_bytes()) for role in ROLES]
manifests.append(secret("rlpipe-weightsync", "token", secrets.token_hex(32).encode()))
sys.stdout.write(yaml.safe_dump_all(manifests, sort_keys=False))
print(f"made the NATS keys of {', '.join(ROLES)} and the weight-sync token for run {run_id}", file=sys.stderr)
PY
