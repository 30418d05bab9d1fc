"""Serve an environment over HTTP, as ``rollout.environment_url`` expects (schema in ``http_environment``).

    python -m services.rollout.environment_server --environment calculator --port 8090

Any environment works, a plugin's ``module:Class`` too: one instance per ``episode_id``, made at its reset and
forgotten when a step answers ``done``, or when the client ends the episode itself (a turn or token budget, a
failure, the model's own end of answer) and POSTs ``/close``. A reference for writing one's own service, and
what the tests run against.
"""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Callable
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from services.common.episodes.environments import Environment, Task, Turn, environment_factory


class EnvironmentServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        port: int,
        make_environment: Callable[[], Environment],
        host: str = "127.0.0.1",
        handler: type[EnvironmentHandler] | None = None,
    ):
        super().__init__((host, port), handler or EnvironmentHandler)
        self.make_environment = make_environment
        self.episodes: dict[str, Environment] = {}
        self.lock = threading.Lock()


class EnvironmentHandler(BaseHTTPRequestHandler):
    server: EnvironmentServer

    def do_POST(self) -> None:
        try:
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            episode_id = str(request["episode_id"])
            if self.path == "/reset":
                environment = self.server.make_environment()
                task = Task(str(request["prompt_id"]), request["prompt"], request["answer"], request.get("info", {}))
                prompt = environment.reset(task)
                with self.server.lock:
                    self.server.episodes[episode_id] = environment
                self.answer(200, {"prompt": prompt})
            elif self.path == "/close":
                with self.server.lock:
                    self.server.episodes.pop(episode_id, None)
                self.answer(200, {})
            elif self.path == "/step":
                with self.server.lock:
                    environment = self.server.episodes[episode_id]
                result = environment.step(Turn(request["text"], tuple(request["token_ids"])))
                if result.done:
                    with self.server.lock:
                        self.server.episodes.pop(episode_id, None)
                self.answer(200, asdict(result))
            else:
                self.answer(404, {"error": f"no endpoint {self.path}"})
        except (KeyError, TypeError, ValueError) as error:  # a request off the schema, or an unknown episode
            self.answer(400, {"error": repr(error)})
        except Exception as error:  # the environment's own failure: the client retries it, then ends the episode
            self.answer(500, {"error": repr(error)})

    def answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        pass  # one line per request would drown the service's own log


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--environment", default="calculator", help="a built-in name or a 'module:Class' plugin")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8090)
    args = parser.parse_args(argv)
    EnvironmentServer(args.port, environment_factory(args.environment), args.host).serve_forever()


if __name__ == "__main__":
    main()
