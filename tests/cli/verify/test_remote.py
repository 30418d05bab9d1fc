"""rlpipe verify's reachability probe of remote reward and environment services, against real sockets."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from services.cli.verify.health import probe_remote, remote_services_check
from tests.support.servers import free_port

pytestmark = pytest.mark.integration


def test_a_listening_service_is_reachable_and_a_closed_port_is_named_with_the_reason():
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        up = f"http://127.0.0.1:{server.server_address[1]}/score"
        down = f"http://127.0.0.1:{free_port()}"
        results = {"reward.http.url": (up, probe_remote(up)), "rollout.environment_url": (down, probe_remote(down))}
    finally:
        server.shutdown()
        server.server_close()
    assert results["reward.http.url"][1] is None
    check = remote_services_check(results)
    assert check.status == "fail"
    assert check.detail.startswith(f"rollout.environment_url ({down}): 127.0.0.1:{down.rsplit(':', 1)[1]}: ")
    assert "refused" in check.detail
