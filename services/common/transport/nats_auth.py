"""Who may do what on the bus: one NATS identity per role, each allowed only its own subjects.

Every role connects with its own nkey (``nats.nkey_seed_file``); the broker holds the public keys
with the permissions below and refuses anything else with a permissions violation. What each role
may publish follows what it does in ``transport.bus`` and ``stage``, ``live_config`` and ``presence``:

    role       publishes to                      consumes (durable)   config bucket    presence bucket
    rollout    ROLLOUTS, dead.rollout             PROMPTS (rollout)    read             read; write rollout.*
    reward     SCORED, dead.reward                ROLLOUTS (reward)    read             read; write reward.*
    reference  EXPERIENCE, dead.reference         SCORED (reference)   read             read; write reference.*
    trainer    PROMPTS, dead.trainer              reads every stream   read and write   read and write any key
               creates and updates the streams and buckets, purges EXPERIENCE
    operator   re-injected dead letters,          reads every stream   read             read
               dead.operator; deletes single messages

A role writes its dead letters to DEAD on its own subject ``rlpipe.<run>.dead.<role>`` only, and the operator its
re-inject records to ``dead.operator`` only (``streams.dead_subject``): nobody publishes to the bare DEAD subject an
older build used. So the subject a DEAD message came on says who wrote it, and its readers trust a letter for the
stream its role reads and no other, and a re-inject record from the operator alone
(``services.common.transport.dead_letters.forged``).

Only the trainer, the run's owner, creates and updates the run's streams and buckets (and restores
the streams after a broker lost its store, see ``Bus.ensure_streams``); it alone, with the admin API
it serves, writes the config bucket and PROMPTS. The stages only look the streams and buckets up,
waiting while one is missing (``Bus.await_streams``), and create their own durable consumer. A stage
writes (and the launcher, with that stage's key, deletes) only presence entries keyed ``<role>.*``,
its own role's (services/common/transport/presence.py): it cannot overwrite, delete or forge another
role's, and the bucket's stream refuses the rollup that would wipe them all. The trainer, the run's
owner, may write any entry: it prunes the entries of replicas gone for long
(``supervision.presence_retention_s``), of every role. Nobody may delete a stream, and none may
purge one but the trainer's purge of EXPERIENCE. Replies come to a per-role inbox prefix
(``_INBOX_<role>``), so one role cannot read the answers another gets (a pulled batch, a config read).

Pure: ``permissions`` and ``server_authorization`` decide, ``write_run_credentials`` writes files.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import nkeys

from services.common.transport import lease_bucket, live_config, presence
from services.common.transport.nats_connect import ROLES, RUN_OWNER, SERVICE_ROLES, inbox_prefix
from services.common.transport.streams import (
    DEAD,
    EDGES,
    EXPERIENCE,
    OPERATOR,
    PROMPTS,
    ROLLOUTS,
    SCORED,
    WORK_QUEUES,
    dead_subject,
)
from services.common.transport.streams import stream_name as _stream
from services.common.transport.streams import subject as _subject

# The work queue each stage consumes (its durable consumer is named after the role) and the edge each role feeds.
CONSUMES = {role: edge for edge, role in WORK_QUEUES.items()}
PRODUCES = {"trainer": PROMPTS, "rollout": ROLLOUTS, "reward": SCORED, "reference": EXPERIENCE}


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


def _watch(stream: str) -> list[str]:
    """Reading a stream in order with an ephemeral ordered consumer (a bucket's history or keys, a tail of DEAD)."""
    return [
        f"$JS.API.CONSUMER.CREATE.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}.>",
        f"$JS.API.CONSUMER.DELETE.{stream}.>",
        f"$JS.API.CONSUMER.INFO.{stream}.>",
        f"$JS.FC.{stream}.>",
    ]


def _bucket_read(bucket: str, watch: bool) -> list[str]:
    stream = f"KV_{bucket}"
    read = [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.DIRECT.GET.{stream}.>", f"$JS.API.STREAM.MSG.GET.{stream}"]
    return read + _watch(stream) if watch else read


def permissions(run_id: str, role: str) -> Permissions:
    """The subjects ``role`` may publish to and subscribe on in run ``run_id``."""
    if role not in ROLES:
        raise ValueError(f"unknown NATS role {role!r}: one of {list(ROLES)}")
    config, services = live_config.bucket_name(run_id), presence.bucket_name(run_id)
    publish: list[str] = []
    if role in SERVICE_ROLES:
        # A stage writes its own role's presence entries only (a key's first token is its role); the trainer any
        # (it prunes gone replicas of every role, and an older build's bare keys: presence.upgrade_bucket).
        entries = f"$KV.{services}.>" if role == RUN_OWNER else f"$KV.{services}.{role}.>"
        publish += [_subject(run_id, PRODUCES[role]), dead_subject(run_id, role), entries]
    if (
        role == RUN_OWNER
    ):  # the others wait for what it creates (services.common.transport.nats_connect.await_run_state)
        for edge in EDGES:
            stream = _stream(run_id, edge)
            publish += [f"$JS.API.STREAM.CREATE.{stream}", f"$JS.API.STREAM.UPDATE.{stream}"]
        publish += [f"$JS.API.STREAM.CREATE.KV_{config}", f"$JS.API.STREAM.CREATE.KV_{services}"]
        # An older build's presence bucket made to refuse rollups (presence.upgrade_bucket).
        publish += [f"$JS.API.STREAM.UPDATE.KV_{services}"]
        # The run's lease (services/trainer/lease.py): only the trainer takes, renews and reads it.
        lease = lease_bucket.bucket_name(run_id)
        publish += [f"$JS.API.STREAM.CREATE.KV_{lease}", f"$KV.{lease}.>", *_bucket_read(lease, watch=False)]
    publish += [f"$JS.API.STREAM.INFO.{_stream(run_id, edge)}" for edge in EDGES]
    watches = role in ("trainer", "operator")
    publish += _bucket_read(config, watches) + _bucket_read(services, watches)
    if role in CONSUMES:
        stream, durable = _stream(run_id, CONSUMES[role]), role
        publish += [
            f"$JS.API.CONSUMER.INFO.{stream}.{durable}",
            f"$JS.API.CONSUMER.CREATE.{stream}.{durable}",
            f"$JS.API.CONSUMER.CREATE.{stream}.{durable}.>",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{durable}",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}",
            f"$JS.ACK.{stream}.{durable}.>",
        ]
    if role == RUN_OWNER:
        publish += [f"$KV.{config}.>", f"$JS.API.STREAM.PURGE.{_stream(run_id, EXPERIENCE)}"]
    if role in ("trainer", "operator"):  # status, lag and dead-letter counts: reading any stream and consumer
        publish += [f"$JS.API.STREAM.MSG.GET.{_stream(run_id, edge)}" for edge in EDGES]
        publish += [f"$JS.API.DIRECT.GET.{_stream(run_id, edge)}" for edge in (EXPERIENCE, DEAD)]  # StreamReader
        publish += [f"$JS.API.CONSUMER.INFO.{_stream(run_id, edge)}.{r}" for r, edge in CONSUMES.items()]
    if role == "operator":
        # Tailing the streams that keep their messages (work queues allow no second consumer anyway).
        publish += ["$JS.API.STREAM.NAMES"] + [rule for e in (EXPERIENCE, DEAD) for rule in _watch(_stream(run_id, e))]
        # `rlpipe dead-letters --reinject`: a dead letter goes back to the stream it came from, and a record of
        # that goes to DEAD on the operator's own subject (which reopens the group); an operator may also take a
        # single bad message out of any stream (never purge one, nor write config).
        publish += [_subject(run_id, edge) for edge in (PROMPTS, ROLLOUTS, SCORED, EXPERIENCE)]
        publish += [dead_subject(run_id, OPERATOR)]
        publish += [f"$JS.API.STREAM.MSG.DELETE.{_stream(run_id, edge)}" for edge in EDGES]
    return Permissions(publish=tuple(publish), subscribe=(f"{inbox_prefix(role)}.>",))


@dataclass(frozen=True)
class RoleKey:
    role: str
    public_key: str
    seed_file: Path


def server_authorization(run_id: str, keys: list[RoleKey]) -> str:
    """The ``authorization`` block of a nats-server config that admits ``keys``, each with its role's permissions."""
    users = []
    for key in keys:
        allowed = permissions(run_id, key.role)
        users.append(
            f"    {{nkey: {json.dumps(key.public_key)}, permissions: {{"
            f"publish: {{allow: {json.dumps(list(allowed.publish))}}}, "
            f"subscribe: {{allow: {json.dumps(list(allowed.subscribe))}}}}}}}"
        )
    return "authorization {\n  users: [\n" + ",\n".join(users) + "\n  ]\n}\n"


def new_role_key(role: str, folder: Path, name: str = "") -> RoleKey:
    """A fresh user nkey for ``role``: its seed in ``folder/<name>`` (``<role>.nk``), readable by this user only."""
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    path = folder / (name or f"{role}.nk")
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as out:
        out.write(seed + b"\n")
    # (nkeys is untyped: its public_key is the encoded key, bytes)
    return RoleKey(role, nkeys.from_seed(seed).public_key.decode(), path)  # pyright: ignore[reportAttributeAccessIssue]


def write_run_credentials(folder: Path) -> dict[str, RoleKey]:
    """One fresh nkey per role under ``folder`` (mode 0700), for a broker that this run starts."""
    return {role: new_role_key(role, _private_folder(folder)) for role in ROLES}


def write_deployment_credentials(run_id: str, folder: Path) -> Path:
    """Keys for a broker run by a deployment (compose, Kubernetes): ``folder/<role>/nats.nk`` per role, one folder
    per role so each container mounts only its own, and ``folder/auth.conf`` for the broker to include."""
    keys = [new_role_key(role, _private_folder(folder / role), "nats.nk") for role in ROLES]
    auth = folder / "auth.conf"
    auth.write_text(server_authorization(run_id, keys))
    return auth


def _private_folder(folder: Path) -> Path:
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.chmod(0o700)
    return folder


def main(argv: list[str] | None = None) -> None:
    """``python -m services.common.transport.nats_auth CONFIG OUT``: the one-shot secrets step of compose and k8s."""
    import argparse

    from services.common.config import load_config

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("config", type=Path, help="the run's config (its run_id names the subjects)")
    parser.add_argument("out", type=Path, help="folder for auth.conf and one folder of keys per role")
    args = parser.parse_args(argv)
    auth = write_deployment_credentials(load_config(args.config).run_id, _private_folder(args.out))
    print(f"wrote {auth} and the keys of {', '.join(ROLES)}")


if __name__ == "__main__":
    main()
