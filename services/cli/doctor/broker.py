"""``rlpipe doctor``'s broker rows: a configured NATS server reached and its streams compared with what the bus
would create (``stream_differences``), or, for ``rlpipe run``'s embedded broker, the nats-server binary it starts."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import subprocess
from typing import Any

from services.common.config import RunConfig
from services.common.startup_checks import CheckResult, shorten
from services.common.transport.nats_connect import connect_options, message_limit_refusal
from services.common.transport.nats_server import nats_server_binary
from services.common.transport.streams import stream_name

# A doctor run must not hang on an unreachable broker.
NETWORK_TIMEOUT_S = 3.0


def _shown(value: Any) -> str:
    value = getattr(value, "value", value)  # enums as the server spells them
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _same(want: Any, have: Any) -> bool:
    if have is None:
        return False
    if isinstance(want, (int, float)) and not isinstance(want, bool) and isinstance(have, (int, float)):
        # Durations travel as nanoseconds and come back as float seconds.
        return math.isclose(float(want), float(have), rel_tol=1e-9)
    if isinstance(want, list) and isinstance(have, list):
        return sorted(map(str, want)) == sorted(map(str, have))
    if isinstance(want, dict) and isinstance(have, dict):
        return all(have.get(key) == value for key, value in want.items())  # the server adds its own metadata
    return want == have


def stream_differences(expected: Any, actual: Any) -> list[tuple[str, str, str]]:
    """(setting, expected, found) for each setting ``Bus.stream_config`` chooses that the live stream does not have.

    A setting the bus leaves at the client default is the server's to choose, so it is not compared.
    """
    from nats.js import api

    defaults = api.StreamConfig()
    differences = []
    for field in dataclasses.fields(api.StreamConfig):
        want = getattr(expected, field.name)
        if want is None or want == getattr(defaults, field.name):
            continue
        have = getattr(actual, field.name)
        if not _same(want, have):
            differences.append((field.name, _shown(want), _shown(have)))
    return differences


async def _probe_nats(cfg: RunConfig) -> list[CheckResult]:
    import nats
    from nats.js.errors import NotFoundError

    from services.common.transport.bus import Bus
    from services.common.transport.streams import EDGES

    url = cfg.nats.url
    errors: list[BaseException] = []

    async def remember(error: BaseException) -> None:
        # Reported once in the row, not logged per attempt.
        errors.append(error)

    try:
        nc = await asyncio.wait_for(
            nats.connect(
                url,
                connect_timeout=NETWORK_TIMEOUT_S,
                allow_reconnect=False,
                max_reconnect_attempts=1,
                reconnect_time_wait=0.1,
                error_cb=remember,
                name="rlpipe-doctor",
                **connect_options(cfg.nats, "operator"),
            ),
            NETWORK_TIMEOUT_S,
        )
    except Exception as error:  # refused, unresolvable, timed out: all mean no broker
        cause = errors[-1] if errors else error
        hint = "a config for rlpipe run, which starts its own broker, is checked with --embedded"
        return [
            CheckResult("nats", "fail", f"cannot connect to {url}: {shorten(cause)} ({hint})"),
            CheckResult("streams", "skip", "no broker to ask"),
        ]
    try:
        js = nc.jetstream(timeout=NETWORK_TIMEOUT_S)
        try:
            await js.account_info()
        except Exception as error:  # no responders, timeout or an API error: all mean no usable JetStream
            return [
                CheckResult("nats", "fail", f"{url}: JetStream is not enabled for this account: {shorten(error)}"),
                CheckResult("streams", "skip", "no JetStream to ask"),
            ]
        nats_row = CheckResult("nats", "ok", f"{url}: nats-server {nc.connected_server_version}, JetStream enabled")
        refusal = message_limit_refusal(cfg.nats.max_message_bytes, nc.max_payload)
        if refusal:  # every service would refuse to start against this broker
            nats_row = CheckResult("nats", "fail", f"{url}: {refusal}")
        bus = Bus(cfg, "doctor")
        found, problems = [], []
        for edge in EDGES:
            name, expected = stream_name(cfg.run_id, edge), bus.stream_config(edge)
            try:
                actual = (await js.stream_info(name)).config
            except NotFoundError:
                continue
            found.append(name)
            for setting, want, have in stream_differences(expected, actual):
                problems.append(f"{name}: {setting} expected {want}, found {have}")
        if problems:
            streams_row = CheckResult("streams", "fail", "; ".join(problems))
        elif found:
            streams_row = CheckResult(
                "streams", "ok", f"{len(found)} of the run's {len(EDGES)} streams exist and match the config"
            )
        else:
            streams_row = CheckResult(
                "streams", "ok", f"none of the run's {len(EDGES)} streams exist yet: they are created at start"
            )
        return [nats_row, streams_row]
    finally:
        await nc.close()


def nats_rows(cfg: RunConfig) -> list[CheckResult]:
    return asyncio.run(_probe_nats(cfg))


def embedded_broker_rows(cfg: RunConfig) -> list[CheckResult]:
    streams = CheckResult("streams", "skip", "rlpipe run creates the embedded broker's streams")
    try:
        binary = nats_server_binary()
        out = subprocess.run([binary, "--version"], check=False, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as error:
        return [CheckResult("nats", "fail", f"rlpipe run cannot start its broker: {shorten(error)}"), streams]
    if out.returncode != 0:
        return [
            CheckResult("nats", "fail", f"{binary} --version exited with {out.returncode}: {shorten(out.stderr)}"),
            streams,
        ]
    return [
        CheckResult(
            "nats", "ok", f"rlpipe run starts its own broker, {out.stdout.strip()} ({binary}); nats.url is not used"
        ),
        streams,
    ]
