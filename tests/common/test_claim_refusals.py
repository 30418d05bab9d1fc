"""A claim store that refuses us (credentials, a policy, TLS, DNS) is told apart from one that is down: both hold the
message, the refusal alerts at once."""

from __future__ import annotations

import asyncio
import socket
import ssl
from types import SimpleNamespace

import pytest
import urllib3
from minio.error import S3Error, ServerError

from services.common.config import CheckpointConfig
from services.common.transport.breaker import DependencyRefused
from services.common.transport.claims import StoreRefused, StoreUnavailable, read_claimed, store_claimed
from services.common.transport.messages import ClaimCheck
from services.common.transport.storage import S3Store

pytestmark = pytest.mark.unit

CLAIM = ClaimCheck(key="rlpipe-claims/run/rollouts/g1-0", size=3, sha256="0" * 64)


def s3_error(status: int, code: str) -> S3Error:
    return S3Error(SimpleNamespace(status=status), code, "said the store", "/bucket/key", "req", "host")


def wrapped(cause: BaseException) -> BaseException:
    """As urllib3 raises it once its retries are spent: the socket's error as the reason."""
    return urllib3.exceptions.MaxRetryError(None, "/bucket/key", reason=cause)


class Failing:
    """A store whose every call raises ``error``."""

    def __init__(self, error: BaseException):
        self.error = error

    def get(self, key: str, limit: int | None = None) -> bytes:
        raise self.error

    def put(self, key: str, data: bytes, tags: dict | None = None) -> None:
        raise self.error


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (s3_error(403, "AccessDenied"), "s3_AccessDenied"),
        (s3_error(403, "InvalidAccessKeyId"), "s3_InvalidAccessKeyId"),
        (s3_error(403, "SignatureDoesNotMatch"), "s3_SignatureDoesNotMatch"),
        (ServerError("forbidden", 403), "http_403"),
        (wrapped(ssl.SSLError(1, "wrong version number")), "tls"),
        (wrapped(socket.gaierror(-2, "Name or service not known")), "dns"),
        (s3_error(503, "SlowDown"), ""),
        (ServerError("bad gateway", 502), ""),
        (wrapped(ConnectionRefusedError(111, "refused")), ""),
        (TimeoutError("timed out"), ""),
    ],
)
def test_a_refusing_store_is_a_refusal_and_a_store_that_is_down_an_outage(error, kind):
    for call in (read_claimed(Failing(error), CLAIM), store_claimed(Failing(error), "run", "rollouts", "g1", b"abc")):
        with pytest.raises(StoreUnavailable) as held:
            asyncio.run(call)
        assert isinstance(held.value, StoreRefused) == bool(kind)
        if kind:
            assert isinstance(held.value, DependencyRefused) and held.value.kind == kind


@pytest.mark.integration
def test_a_store_spoken_to_in_tls_that_answers_plain_http_is_refused_as_tls(s3_env):
    # moto answers plain HTTP: the handshake fails on a real socket, as against a misconfigured endpoint.
    store = S3Store("claims", "run", CheckpointConfig(s3_endpoint=s3_env, s3_secure=True))
    with pytest.raises(StoreRefused) as held:
        asyncio.run(read_claimed(store, CLAIM))
    assert held.value.kind == "tls"
