#!/bin/sh
# The object store's users, made at every compose start by the one-shot `minio-init` (mc image): the bucket,
# one policy per kind of role (deploy/minio/*.json) and one user per role with the key secrets-init made into
# that role's folder of the `secrets` volume (<role>/env/RLPIPE_S3_ACCESS_KEY, RLPIPE_S3_SECRET_KEY), so no
# rlpipe service holds MinIO's root user:
#   trainer                       trainer.json   checkpoints, claims and fences under rlpipe/checkpoints/, and
#                                                the checkpoint mirror under rlpipe-mirror/checkpoints/
#   rollout, reward, reference    stage.json     claim-checked bodies only (rlpipe/checkpoints/<run>/claims/)
#   operator                      operator.json  reads checkpoints and their mirror (rlpipe checkpoint verify, report)
# The buckets' lifecycle rules (deploy/minio/lifecycle.json, imported whole into both, replacing any before; the
# tags are services/common/transport/lifecycle_tags.py's): work-queue claim-checked bodies a stage could not
# delete once consumed (rlpipe-claim=work-queue) expire after 21 days, a week past DEAD's 14-day
# nats.dead_letter_max_age_s, so a dead letter's body outlives its letter; checkpoint objects
# (rlpipe-kind=checkpoint), which the trainer prunes to checkpoint.keep_last while a run goes on, expire 180 days
# after they were written, so what a run left idle goes (export a model to keep it: docs/operations.md); a run's
# archived record (rlpipe-kind=archive) after a year. EXPERIENCE bodies are untagged: the trainer purges them.
# MinIO speaks HTTPS only, with the certificate secrets-init made (DNS:minio); mc trusts the deployment's CA alone.
# Re-running it is harmless: policies, users and the lifecycle are overwritten with the same content.
# usage: init.sh SECRETS POLICIES   (MinIO's root user from SECRETS/minio-root, made by secrets-init)
set -eu
secrets=$1
policies=$2
export MC_CONFIG_DIR="${MC_CONFIG_DIR:-/tmp/mc}"
mkdir -p "$MC_CONFIG_DIR/certs/CAs"
cp "$secrets/ca/ca.pem" "$MC_CONFIG_DIR/certs/CAs/rlpipe-ca.pem"
# The alias from the environment, not mc's arguments: the password stays out of the process list (it is hex).
export MC_HOST_rlpipe="https://$(cat "$secrets/minio-root/MINIO_ROOT_USER"):$(cat "$secrets/minio-root/MINIO_ROOT_PASSWORD")@minio:9000"
mc mb --ignore-existing rlpipe/rlpipe
mc mb --ignore-existing rlpipe/rlpipe-mirror  # checkpoint.mirror_url of deploy/config/prod.yaml
for bucket in rlpipe rlpipe-mirror; do
    mc ilm rule import "rlpipe/$bucket" <"$policies/lifecycle.json"
done
for policy in trainer stage operator; do
    mc admin policy create rlpipe "rlpipe-$policy" "$policies/$policy.json"
done
for role in trainer rollout reward reference operator; do
    case $role in
        trainer | operator) policy=$role ;;
        *) policy=stage ;;
    esac
    user=$(cat "$secrets/$role/env/RLPIPE_S3_ACCESS_KEY")
    mc admin user add rlpipe "$user" "$(cat "$secrets/$role/env/RLPIPE_S3_SECRET_KEY")"
    # attach refuses a policy the user already has: a restart finds it attached, which is what is wanted.
    mc admin policy attach rlpipe "rlpipe-$policy" --user "$user" || mc admin user info rlpipe "$user" | grep -q "rlpipe-$policy"
done
echo "made the bucket, its lifecycle rules, the policies and one user per role"
