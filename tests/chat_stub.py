"""A stub of an OpenAI-compatible chat API on a random loopback port, for the remote-reward tests.

``POST /v1/chat/completions``; the request's ``model`` picks the behaviour (none: ``length``):

* ``length``: replies ``"I'd say <n>/10"`` where n is the length of the last user message;
* ``match``: the user message is ``<reference>|<response>`` (the test's template); replies the
  number of leading characters the two share;
* ``slow``: sleeps ``slow_s`` first, then answers like ``length``;
* ``flaky``: HTTP ``flaky_status`` (503; with a ``Retry-After: <retry_after>`` header when given)
  for the first two requests carrying a given message, then like ``length``;
* ``stall``: for a message starting with ``stall``, HTTP 503 whose headers promise a body that
  does not come for ``slow_s``; other messages like ``length``;
* ``garbage``: HTTP 200 with a body that is not JSON; ``wordy``: a chat reply without a number;
  ``echo``: the user message as the reply;
* ``together``: waits until ``together`` requests are inside at once (a barrier), then like ``length``.

A request whose ``Authorization`` differs from ``Bearer <api_key>`` (when the stub has a key) gets
HTTP 401. Every request is recorded (``requests``: path, headers, body).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class ChatStub:
    def __init__(self, api_key: str | None = None, slow_s: float = 2.0, together: int = 4, flaky_status: int = 503,
                 retry_after: str | None = None) -> None:
        self.api_key, self.slow_s = api_key, slow_s
        self.flaky_status, self.retry_after = flaky_status, retry_after
        self.requests: list[dict[str, Any]] = []
        self.seen: dict[str, int] = {}
        self.barrier = threading.Barrier(together, timeout=10)
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub.lock:
                    stub.requests.append({"path": self.path, "headers": dict(self.headers), "body": body,
                                          "at": time.monotonic()})
                stub.answer(self, body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.handle_error = lambda request, address: None  # a client that gave up on a slow reply
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, name="chat-stub", daemon=True)

    def __enter__(self) -> ChatStub:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)

    def answer(self, handler: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
        if self.api_key is not None and handler.headers.get("Authorization") != f"Bearer {self.api_key}":
            return self.send(handler, 401, {"error": {"message": "invalid api key"}})
        if handler.path != "/v1/chat/completions":
            return self.send(handler, 404, {"error": {"message": f"no route {handler.path}"}})
        model, user = body.get("model", "length"), body["messages"][-1]["content"]
        if model == "slow":
            time.sleep(self.slow_s)
        elif model == "flaky":
            with self.lock:
                self.seen[user] = self.seen.get(user, 0) + 1
                if self.seen[user] <= 2:
                    headers = {"Retry-After": self.retry_after} if self.retry_after is not None else {}
                    return self.send(handler, self.flaky_status, {"error": {"message": "overloaded"}}, headers)
        elif model == "stall" and user.startswith("stall"):
            handler.send_response(503)
            handler.send_header("Content-Length", "100")
            handler.end_headers()
            handler.wfile.flush()
            time.sleep(self.slow_s)
            return None
        elif model == "garbage":
            return self.send(handler, 200, b"<html>not json at all</html>")
        elif model == "wordy":
            return self.reply(handler, "An excellent answer!")
        elif model == "echo":
            return self.reply(handler, user)
        elif model == "together":
            self.barrier.wait()
        if model == "match":
            reference, _, response = user.partition("|")
            shared = next((i for i, (a, b) in enumerate(zip(reference, response)) if a != b), min(len(reference), len(response)))
            return self.reply(handler, f"{shared}")
        return self.reply(handler, f"I'd say {len(user)}/10")

    def reply(self, handler: BaseHTTPRequestHandler, content: str) -> None:
        self.send(handler, 200, {"id": "stub", "object": "chat.completion", "model": "stub",
                                 "choices": [{"index": 0, "finish_reason": "stop",
                                              "message": {"role": "assistant", "content": content}}]})

    @staticmethod
    def send(handler: BaseHTTPRequestHandler, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        handler.send_response(status)
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)
