"""``rlhf-gateway``: an OpenAI-compatible HTTP front end whose calls the rollout workers serve.

Starlette under uvicorn, one asyncio loop. :class:`Gateway` joins a run and composes its parts:
the sessions (:mod:`gateway.sessions`), the calls to the workers and back
(:mod:`gateway.routing`), the rewards kept and appended (:mod:`gateway.settlement`) and the
endpoints (:mod:`gateway.handlers`); :func:`make_app` serves them, :class:`GatewayServer` under
uvicorn with bounded request heads. Design and a user's walk-through: docs/gateway.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from buffer import GatewayClient
from buffer.gateway import LIVE_TTL_S, drop_run, hold_run
from gateway.handlers import RECEIVED, Handlers, api_keys, redis_down
from gateway.openai_api import INVALID, NOT_FOUND, ApiError, served_name
from gateway.routing import REDIS_DOWN, CallRouter, ClientGone, cancel_tasks
from gateway.sessions import PLAIN_TEMPLATE, Sessions
from gateway.settlement import RewardSettlement
from rlhf_core import metric_names as M
from rlhf_core.cli import freeze_startup_heap, write_json
from rlhf_core.config import Config, ConfigError, response_budget, validate
from rlhf_core.errors import UserError
from rlhf_core.models import load_tokenizer, model_dir

log = logging.getLogger(__name__)


class Gateway:
    """One gateway of a run: what it serves (model, tokenizer, keys), the run it holds, and its
    parts, made by :meth:`start` once the run is known."""

    def __init__(self, cfg: Config, gateway_id: str | None = None) -> None:
        validate(cfg)
        if cfg.buffer.url is None or cfg.buffer.run_id == "auto":
            raise ConfigError("rlhf-gateway needs buffer.url=redis://host:port and buffer.run_id=<the run id rlhf-run "
                              "printed> of the run whose workers serve it")
        self.cfg, g = cfg, cfg.gateway
        self.gateway_id = gateway_id or f"gateway-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.model_name = served_name(cfg)
        self.keys_allowed = api_keys(cfg)
        self.tokenizer = load_tokenizer(cfg.model)
        if g.chat_template:
            self.tokenizer.chat_template = g.chat_template
        elif not getattr(self.tokenizer, "chat_template", None):
            self.tokenizer.chat_template = PLAIN_TEMPLATE
        config = json.loads((model_dir(cfg.model) / "config.json").read_text())
        # what the workers' engines hold (rollout.max_prompt_tokens + the response budget), at most the model's
        self.max_context = min(int(config.get("max_position_embeddings") or 1 << 30),
                               int(cfg.rollout.max_prompt_tokens) + response_budget(cfg.rollout))
        self.buffer = GatewayClient.connect(cfg.buffer.url, cfg.buffer.run_id, cfg.buffer)
        self.keys = self.buffer.keys
        self.sessions: Sessions | None = None  # the parts, made in start()
        self.router: CallRouter | None = None
        self.settlement: RewardSettlement | None = None
        self.http: Handlers | None = None
        self.holds_run = False  # the run's gateway record is this gateway's (claim)
        self._tasks: list[asyncio.Task] = []
        self.started = time.time()

    def claim(self) -> None:
        """Take the run for this gateway, or refuse to: one gateway per run. A dead gateway's record
        lapses within :data:`LIVE_TTL_S`, so this waits that long at most."""
        deadline, seen = time.monotonic() + LIVE_TTL_S + 1, None
        while (held := self.buffer.retry(hold_run, self.buffer.redis, self.keys, self.gateway_id)) is not None:
            if (seen is not None and held[0] == seen[0] and held[1] > seen[1]) or time.monotonic() > deadline:
                raise UserError(f"gateway {held[0]} serves run {self.cfg.buffer.run_id} (its record in Redis, "
                                f"{self.keys.gw_live}, is refreshed every second): one gateway per run; stop that one "
                                f"first (one that died frees the run within {LIVE_TTL_S:g} s)")
            if seen is None:
                log.info("gateway: run %s is held by gateway %s; waiting up to %g s for its record to be refreshed (it "
                         "is alive) or to lapse (it died)", self.cfg.buffer.run_id, held[0], LIVE_TTL_S)
            seen = held
            time.sleep(0.2)
        self.holds_run = True

    def release(self) -> None:
        """Free the run for the next gateway (a record that is not this gateway's stays)."""
        if not self.holds_run:
            return
        self.holds_run = False
        try:
            drop_run(self.buffer.redis, self.keys, self.gateway_id)
        except Exception as exc:  # noqa: BLE001  # Redis away: the record lapses by itself
            log.warning("gateway: could not free the run's gateway record (%s); it lapses within %g s", exc, LIVE_TTL_S)

    async def _hold(self) -> None:
        """Refresh this gateway's record of the run every second (it lapses :data:`LIVE_TTL_S` after the last)."""
        taken = False
        while True:
            await asyncio.sleep(1.0)
            try:
                held = await asyncio.to_thread(hold_run, self.buffer.redis, self.keys, self.gateway_id)
            except Exception:  # noqa: BLE001  # Redis away: taken again once it is back, unless another gateway took it
                continue
            if held is not None and not taken:
                log.error("gateway: gateway %s took run %s while this one could not refresh its record for %g s "
                          "(Redis away); both now serve it: stop one", held[0], self.cfg.buffer.run_id, LIVE_TTL_S)
            taken = held is not None

    async def start(self) -> None:
        """Wait for the run (its parameters), make the parts, take up the rewards kept before,
        subscribe to this gateway's channel, start the tasks."""
        while not await asyncio.to_thread(self.buffer.initialised):
            log.info("gateway: run %s is not initialised yet; waiting for the learner", self.cfg.buffer.run_id)
            await asyncio.sleep(0.5)
        params = await asyncio.to_thread(self.buffer.run_params)
        group_size = int(self.cfg.gateway.group_size or params["group_size"])
        if group_size > int(params["group_size"]):
            raise ConfigError(f"gateway.group_size={group_size} is larger than the run's group_size "
                              f"{params['group_size']}: a group of the buffer holds at most that many samples")
        room = int(params["max_response_tokens"])
        if room < self.cfg.gateway.max_tokens:
            log.warning("gateway: a session holds at most %d response tokens in all, every call's reply and what the "
                        "agent adds between them (rollout.max_episode_tokens; unset: rollout.max_new_tokens): set "
                        "rollout.max_episode_tokens to the episodes your agents run", room)
        self.sessions = sessions = Sessions(self.tokenizer, self.cfg.gateway.session_ttl_s, group_size, room)
        self.settlement = RewardSettlement(self.cfg, self.buffer, sessions)
        self.router = CallRouter(self.cfg, self.keys, self.gateway_id, sessions, self.max_context)
        self.http = Handlers(self.cfg, self.model_name, self.keys_allowed, self.tokenizer, sessions, self.router,
                             self.settlement, self.counts, self.started)
        await self.settlement.recover()
        await self.router.connect()
        self._tasks = [asyncio.create_task(self._housekeeping(), name="gateway-expiry"),
                       asyncio.create_task(self._hold(), name="gateway-hold")]

    async def stop(self) -> None:
        await cancel_tasks(self._tasks)
        if self.router is not None:
            await self.router.close()
        if self.sessions is not None:  # the last counts: a run's summary is taken after its children stop
            try:
                await asyncio.to_thread(self.buffer.publish_stats, M.GATEWAY_STATS, self.counts())
            except Exception as exc:  # noqa: BLE001  # Redis gone first: the counts of a second ago stay
                log.warning("gateway: its last counts could not be published: %s", exc)
        await asyncio.to_thread(self.release)
        self.buffer.close()

    async def _housekeeping(self) -> None:
        """Expire idle sessions, append groups that are due, drop old cancellation marks, publish the gateway's stats."""
        assert self.sessions is not None and self.router is not None and self.settlement is not None
        every = min(1.0, self.cfg.gateway.session_ttl_s / 4)
        while True:
            await asyncio.sleep(every)
            try:
                await self.router.send_cancels()
                self.sessions.expire()
                await self.settlement.append_due()
                await self.router.forget_old_cancels()
                await asyncio.to_thread(self.buffer.publish_stats, M.GATEWAY_STATS, self.counts())
            except Exception:  # noqa: BLE001  # Redis away for a moment: the next round retries
                log.exception("gateway: housekeeping failed")

    def counts(self) -> dict[str, Any]:
        """The counters since this gateway started and its levels now (what it publishes for the
        monitor, the run's exporter and summary)."""
        assert self.sessions is not None and self.router is not None
        return {**self.sessions.counters.as_dict(), "sessions_open": len(self.sessions.sessions),
                "groups_waiting": len(self.sessions.groups), "calls_running": len(self.router.pending)}


def make_app(gw: Gateway, on_ready: Any = None) -> Starlette:
    """The Starlette app; ``on_ready()`` runs once the gateway has joined its run (before the first request)."""
    async def handle(fn: Callable[[Handlers, Request], Awaitable[Response]], request: Request) -> Response:
        request.scope[RECEIVED] = time.time()
        http = gw.http  # made by gw.start(), which the lifespan runs before the first request
        assert http is not None
        try:
            return await fn(http, request)
        except ApiError as exc:
            err = exc
        except REDIS_DOWN as exc:  # Redis away for a moment (a restart): the client may retry, no traceback
            log.warning("gateway: %s %s: Redis did not answer: %s", request.method, request.url.path, exc)
            err = redis_down(exc)
        except ClientGone:
            http.count_error("client_gone")
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        http.count_error(err.code)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    def route(path: str, fn: Callable[[Handlers, Request], Awaitable[Response]], methods: list[str]) -> Route:
        async def endpoint(request: Request) -> Response:
            return await handle(fn, request)
        return Route(path, endpoint, methods=methods)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gw.start()
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            await gw.stop()

    routes = [route("/v1/chat/completions", Handlers.chat, ["POST"]),
              route("/v1/completions", Handlers.completions, ["POST"]),
              route("/v1/models", Handlers.models, ["GET"]), route("/health", Handlers.health, ["GET"]),
              route("/v1/rl/sessions/{session_id:path}/reward", Handlers.reward, ["POST"]),
              route("/v1/rl/stats", Handlers.stats, ["GET"])]
    app = Starlette(routes=routes, lifespan=lifespan)

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        return JSONResponse(ApiError(status, f"{request.method} {request.url.path} is not an endpoint of this gateway",
                                     NOT_FOUND if status == 404 else INVALID).body(), status_code=status)

    app.add_exception_handler(404, not_found)
    app.add_exception_handler(405, not_found)
    return app


#: the most bytes of a request's line and headers (uvicorn's h11 allows 16 KiB)
MAX_HEAD_BYTES = 64 * 1024
#: the most seconds from a connection's start, or a later request's first byte, to the end of its
#: request's headers (a client sends them at once; uvicorn sets no limit)
HEAD_TIMEOUT_S = 20.0


def _http_protocol() -> Any:
    """uvicorn's httptools protocol with the request head bounded (httptools buffers it without a
    limit): over :data:`MAX_HEAD_BYTES` it is answered 431, not in within :data:`HEAD_TIMEOUT_S` 408.
    Without httptools uvicorn speaks h11, which bounds the head's size itself."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "h11"

    class BoundedHead(HttpToolsProtocol):
        in_head, head_bytes = False, 0  # a request's head is being received, and its bytes so far
        refused = False  # answered 431 or 408: the connection is closing, nothing more of it is served
        head_timer: asyncio.TimerHandle | None = None  # until the head is in

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_late)

        def connection_lost(self, exc: Exception | None) -> None:
            self._head_in()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.in_head, self.head_bytes = True, 0
            if self.head_timer is None:  # a later request of the connection
                self.head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_late)

        def on_headers_complete(self) -> None:
            self.in_head = False
            self._head_in()
            # the whole head, parsed: the read that completed it (or brought all of it) is not in head_bytes
            if self.refused or len(self.url) + sum(len(k) + len(v) + 4 for k, v in self.headers) > MAX_HEAD_BYTES:
                self._too_large()
                return
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:  # what the parser still finds after a refusal is dropped
            if not self.refused:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if not self.refused:
                super().on_message_complete()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self.in_head or self.transport.is_closing():
                return
            self.head_bytes += len(data)  # what httptools holds of a head still incomplete
            if self.head_bytes > MAX_HEAD_BYTES:
                self._too_large()

        def _too_large(self) -> None:
            if not self.refused:
                self._refuse(b"431 Request Header Fields Too Large",
                             f"the request line and headers are over {MAX_HEAD_BYTES} bytes; send fewer or shorter headers")

        def _head_in(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def _head_late(self) -> None:
            self.head_timer = None
            if not self.transport.is_closing():
                self._refuse(b"408 Request Timeout", f"the request line and headers took over {HEAD_TIMEOUT_S:g} s")

        def _refuse(self, status: bytes, message: str) -> None:
            self.refused = True
            msg = message.encode()
            self.transport.write(b"HTTP/1.1 %s\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n"
                                 b"connection: close\r\n\r\n%s" % (status, len(msg), msg))
            self.transport.close()

    return BoundedHead


class GatewayServer:
    """The gateway under uvicorn, in this thread (:meth:`run`) or a background one (:meth:`start`)."""

    def __init__(self, cfg: Config, output_dir: str | Path | None = None) -> None:
        import uvicorn

        self.gateway = Gateway(cfg)
        self.gateway.claim()
        self.sock = socket.socket(socket.AF_INET6 if ":" in cfg.gateway.host else socket.AF_INET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((cfg.gateway.host, int(cfg.gateway.port)))
        except OSError as exc:
            self.sock.close()
            self.gateway.release()
            raise UserError(f"gateway: cannot listen on {cfg.gateway.host}:{cfg.gateway.port} ({exc.strerror}); "
                            "pick another gateway.port (0: any free one)") from None
        self.sock.listen(2048)  # a client connecting before uvicorn accepts waits in the backlog, not refused
        host, port = self.sock.getsockname()[:2]
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{port}/v1"
        config = uvicorn.Config(make_app(self.gateway, self._announce), log_level="warning", access_log=False,
                                timeout_graceful_shutdown=5, lifespan="on", http=_http_protocol())
        self.server = uvicorn.Server(config)
        self.output_dir = Path(output_dir) if output_dir else None
        self._thread: threading.Thread | None = None

    def _announce(self) -> None:
        # uvicorn takes uvloop when installed (the `gateway` extra): about a fifth less CPU a call
        log.info("gateway: serving %s (model '%s') for run %s, event loop %s", self.url, self.gateway.model_name,
                 self.gateway.cfg.buffer.run_id, type(asyncio.get_running_loop()).__module__)
        if self.output_dir is not None:
            write_json(self.output_dir / "gateway.json", {"url": self.url, "model": self.gateway.model_name,
                                                                 "pid": os.getpid()})

    def run(self) -> None:
        """Serve until SIGTERM/SIGINT; ``gateway.json`` is written once the run is joined."""
        try:
            self.server.run(sockets=[self.sock])
        finally:
            self.gateway.release()

    def start(self, timeout_s: float = 60.0) -> str:
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name="gateway",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start (is the run initialised? see the log)")
            time.sleep(0.02)
        return self.url

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15)
        self.sock.close()
        self.gateway.release()  # also when it never started serving


def run_gateway(cfg: Config, output_dir: str | Path | None = None) -> None:
    """Entry point body: serve until SIGTERM/SIGINT (uvicorn handles both)."""
    server = GatewayServer(cfg, output_dir)
    freeze_startup_heap()
    server.run()
