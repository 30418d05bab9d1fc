#!/bin/sh
# The compose deployment's secrets, made once at first start into the `secrets` volume (the one-shot
# `secrets-init` service runs this in the cli image; later starts keep what is there):
#   tls/ca.pem, ca.key          a self-signed CA (the CA key never leaves this volume)
#   tls/nats.pem, nats.key      the broker's certificate (DNS:nats)
#   auth.conf                   the broker's per-role nkeys and permissions (services/common/transport/nats_auth.py)
#   <role>/nats.nk, ca.pem      one folder per role (trainer, rollout, reward, reference, operator):
#                               each container mounts only its own folder
#   trainer/admin.pem, .key     the Admin port's certificate (DNS:trainer)
#   <role>/env/                 that role's secrets as files named like their variable (each service mounts it at
#                               /run/secrets): RLPIPE_S3_ACCESS_KEY/SECRET_KEY, its own object-store user, which
#                               minio-init creates (deploy/minio/init.sh), and for the trainer and the rollouts
#                               RLPIPE_WEIGHTSYNC_TOKEN, the one token of WeightSync
# Rotation: docs/operations.md, "Security". usage: make-secrets.sh OUT CONFIG
set -eu
out=$1
config=$2
if [ -f "$out/.made" ]; then
    echo "secrets already in $out: kept"
    exit 0
fi
umask 077
mkdir -p "$out/tls"
tls=$out/tls
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 825 -subj "/CN=rlpipe CA" \
    -keyout "$tls/ca.key" -out "$tls/ca.pem" 2>/dev/null
certificate() {  # NAME: a server certificate for the host NAME signed by the CA
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$1" \
        -keyout "$tls/$1.key" -out "$tls/$1.csr" 2>/dev/null
    printf 'subjectAltName=DNS:%s,DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n' "$1" > "$tls/$1.ext"
    openssl x509 -req -in "$tls/$1.csr" -CA "$tls/ca.pem" -CAkey "$tls/ca.key" -CAcreateserial -days 825 \
        -extfile "$tls/$1.ext" -out "$tls/$1.pem" 2>/dev/null
    rm "$tls/$1.csr" "$tls/$1.ext"
}
certificate nats
certificate trainer
# A start that stopped half-way is redone whole: only .made, written last, marks the secrets as made.
python -m services.common.transport.nats_auth "$config" "$out"
for role in trainer rollout reward reference operator; do
    cp "$tls/ca.pem" "$out/$role/ca.pem"
done
weight_sync_token=$(openssl rand -hex 32)
for role in trainer rollout reward reference operator; do
    mkdir -p "$out/$role/env"
    printf 'rlpipe-%s' "$role" > "$out/$role/env/RLPIPE_S3_ACCESS_KEY"
    openssl rand -hex 32 | tr -d '\n' > "$out/$role/env/RLPIPE_S3_SECRET_KEY"
done
for role in trainer rollout; do
    printf '%s' "$weight_sync_token" > "$out/$role/env/RLPIPE_WEIGHTSYNC_TOKEN"
done
cp "$tls/trainer.pem" "$out/trainer/admin.pem"
cp "$tls/trainer.key" "$out/trainer/admin.key"
touch "$out/.made"
echo "made the CA, certificates, NATS keys, store users' keys and the weight-sync token in $out"
