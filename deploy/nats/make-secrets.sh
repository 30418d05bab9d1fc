#!/bin/sh
# The compose deployment's secrets, made once at first start into the `secrets` volume (the one-shot
# `secrets-init` service runs this in the cli image; later starts keep what is there), so that
# `docker compose up` needs no secret from anyone:
#   tls/ca.pem, ca.key          a self-signed CA (the CA key never leaves this volume)
#   tls/<name>.pem, <name>.key  server certificates signed by it: nats (DNS:nats), admin (DNS:trainer, the Admin
#                               port), weights (DNS:trainer, WeightSync and the rollouts' relay ports), minio
#                               (DNS:minio); each also names localhost and 127.0.0.1, for the containers' probes
#   ca/ca.pem                   the CA alone, for containers that hold no other secret (archive)
#   auth.conf                   the broker's per-role nkeys and permissions (services/common/transport/nats_auth.py)
#   <role>/nats.nk, ca.pem      one folder per role (trainer, rollout, reward, reference, operator):
#                               each container mounts only its own folder
#   trainer/admin.pem, .key     the Admin port's certificate; trainer/admin.token its bearer token
#   trainer/, rollout/ weights.pem, .key   the weight-sync certificate (the rollouts serve it on their relay ports)
#   <role>/env/                 that role's secrets as files named like their variable (each service mounts it at
#                               /run/secrets): RLPIPE_S3_ACCESS_KEY/SECRET_KEY, its own object-store user, which
#                               minio-init creates (deploy/minio/init.sh); for the trainer and the rollouts
#                               RLPIPE_WEIGHTSYNC_TOKEN, the one token of WeightSync; for the operator (the cli
#                               service) RLPIPE_ADMIN_TOKEN, the same token as trainer/admin.token
#   minio/public.crt, private.key, CAs/ca.pem   MinIO's --certs-dir: it serves HTTPS only
#   minio-root/MINIO_ROOT_USER, MINIO_ROOT_PASSWORD   MinIO's root user, for minio and minio-init alone
# Rotation: docs/operations.md, "Security". usage: make-secrets.sh OUT CONFIG
set -eu
out=$1
config=$2
# What this script makes; a volume made by an older one (another layout) is made anew, whole: every service
# restarts with the new secrets as `docker compose up` recreates it, and minio-init sets the new store keys.
layout=4  # 4: DEAD subjects per role (a stage writes dead letters only on its own); 3: presence grants per role
if [ -f "$out/.made" ] && [ "$(cat "$out/.made")" = "$layout" ]; then
    echo "secrets already in $out: kept"
    exit 0
fi
umask 077
mkdir -p "$out/tls"
tls=$out/tls
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 825 -subj "/CN=rlpipe CA" \
    -keyout "$tls/ca.key" -out "$tls/ca.pem" 2>/dev/null
certificate() {  # NAME HOST: tls/NAME.pem and .key, a server certificate for HOST signed by the CA
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$2" \
        -keyout "$tls/$1.key" -out "$tls/$1.csr" 2>/dev/null
    printf 'subjectAltName=DNS:%s,DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n' "$2" > "$tls/$1.ext"
    openssl x509 -req -in "$tls/$1.csr" -CA "$tls/ca.pem" -CAkey "$tls/ca.key" -CAcreateserial -days 825 \
        -extfile "$tls/$1.ext" -out "$tls/$1.pem" 2>/dev/null
    rm "$tls/$1.csr" "$tls/$1.ext"
}
certificate nats nats
certificate admin trainer
certificate weights trainer
certificate minio minio
# A start that stopped half-way is redone whole: only .made, written last, marks the secrets as made.
python -m services.common.transport.nats_auth "$config" "$out"
for role in trainer rollout reward reference operator; do
    cp "$tls/ca.pem" "$out/$role/ca.pem"
done
mkdir -p "$out/ca"
cp "$tls/ca.pem" "$out/ca/ca.pem"
token() { openssl rand -hex 32 | tr -d '\n'; }
weight_sync_token=$(token)
for role in trainer rollout reward reference operator; do
    mkdir -p "$out/$role/env"
    printf 'rlpipe-%s' "$role" > "$out/$role/env/RLPIPE_S3_ACCESS_KEY"
    token > "$out/$role/env/RLPIPE_S3_SECRET_KEY"
done
for role in trainer rollout; do
    printf '%s' "$weight_sync_token" > "$out/$role/env/RLPIPE_WEIGHTSYNC_TOKEN"
    cp "$tls/weights.pem" "$out/$role/weights.pem"
    cp "$tls/weights.key" "$out/$role/weights.key"
done
cp "$tls/admin.pem" "$out/trainer/admin.pem"
cp "$tls/admin.key" "$out/trainer/admin.key"
token > "$out/trainer/admin.token"
cp "$out/trainer/admin.token" "$out/operator/env/RLPIPE_ADMIN_TOKEN"
mkdir -p "$out/minio/CAs" "$out/minio-root"
cp "$tls/minio.pem" "$out/minio/public.crt"
cp "$tls/minio.key" "$out/minio/private.key"
cp "$tls/ca.pem" "$out/minio/CAs/ca.pem"
printf 'rlpipe-root' > "$out/minio-root/MINIO_ROOT_USER"
token > "$out/minio-root/MINIO_ROOT_PASSWORD"
printf '%s' "$layout" > "$out/.made"
echo "made the CA, certificates, NATS keys, store users' keys, MinIO's root user, the admin and weight-sync tokens in $out"
