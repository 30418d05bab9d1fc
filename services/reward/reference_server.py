"""A reference remote reward service: the schema of docs/rewards.md, scored by one of rlpipe's rule functions.

    python -m services.reward.reference_server --port 8900 [--function exact_match] [--delay-s 0]

``POST /score`` with ``{"items": [{"prompt", "completion", "answer", "metadata"}, ...]}`` answers
``{"scores": [float, ...]}``, one per item in order. A request whose body does not fit answers
400 with ``{"error": ...}``. ``--delay-s`` holds every answer back that long (a slow service, for
tests), and ``--token`` requires ``Authorization: Bearer <token>`` (401 otherwise). Start your own
service from this one: only ``score_items`` needs to change.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import services.common.model.reward_rules  # noqa: F401  # registers the built-in functions
from services.common.registry import reward_function

RuleFunction = Callable[[str, str, str], float]


def score_items(items: list[dict], function: RuleFunction) -> list[float]:
    """One score per item: ``function(completion, answer, "stop")``. ValueError says what is wrong with the body."""
    scores = []
    for index, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("completion"), str):
            raise ValueError(f"items[{index}] must be an object with a string completion")
        scores.append(float(function(item["completion"], str(item.get("answer", "")), "stop")))
    return scores


def make_handler(function: RuleFunction, delay_s: float, token: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            if self.path != "/score":
                self._answer(404, {"error": f"no such path {self.path!r}; POST /score"})
                return
            if token and self.headers.get("Authorization") != f"Bearer {token}":
                self._answer(401, {"error": "missing or wrong Authorization header"})
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if not isinstance(body, dict) or not isinstance(body.get("items"), list):
                    raise ValueError("the body must be an object with a list of items")
                scores = score_items(body["items"], function)
            except ValueError as error:  # JSONDecodeError is one too
                self._answer(400, {"error": str(error)})
                return
            time.sleep(delay_s)
            self._answer(200, {"scores": scores})

        def _answer(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:  # one line per request is noise in tests
            pass

    return Handler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8900)
    parser.add_argument("--function", default="exact_match", help="a reward function name or module:function")
    parser.add_argument("--delay-s", type=float, default=0.0, help="seconds every answer is held back")
    parser.add_argument("--token", default="", help="require Authorization: Bearer <token>")
    args = parser.parse_args(argv)
    handler = make_handler(reward_function(args.function), args.delay_s, args.token)
    server = ThreadingHTTPServer((args.host, args.port), handler)
    print(json.dumps({"event": "listening", "url": f"http://{args.host}:{server.server_port}/score"}), flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
