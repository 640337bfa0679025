"""The event loop a worker runs users' coroutines on (async reward functions, async environments).

One asyncio loop on a daemon thread of its own, started on first use. :meth:`UserLoop.submit`
returns a :class:`concurrent.futures.Future` holding what the awaitable returned or raised,
``SystemExit`` and ``KeyboardInterrupt`` included: raised inside the loop they would end its
``run_forever``, and with its thread every later call would hang. A coroutine that ends in
``asyncio.CancelledError`` leaves its future cancelled.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable
from concurrent.futures import Future
from typing import Any


class UserLoop:
    def __init__(self, name: str) -> None:
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()  # several threads may start it (scoring threads, a pool's)

    def _running(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name=self.name, daemon=True).start()
                self._loop = loop
            return self._loop

    def submit(self, awaitable: Awaitable[Any]) -> Future:
        """Await ``awaitable`` on the loop; its outcome comes back in the returned future."""
        out: Future = Future()

        async def run() -> None:
            try:
                out.set_result(await awaitable)
            except asyncio.CancelledError:
                out.cancel()
            except BaseException as exc:  # noqa: BLE001 - kept from the loop: a SystemExit would end its thread
                out.set_exception(exc)

        asyncio.run_coroutine_threadsafe(run(), self._running())
        return out

    def stop(self) -> None:
        """Cancel what runs on the loop, then stop it: a thread waiting on a future of
        :meth:`submit` (an environment's pool thread) gets ``CancelledError``; with the loop
        merely stopped it would wait for ever, and the process's exit, which joins such threads, with it."""
        with self._lock:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(_cancel_and_stop, self._loop)


def _cancel_and_stop(loop: asyncio.AbstractEventLoop) -> None:
    for task in asyncio.all_tasks(loop):
        task.cancel()
    loop.call_soon(loop.stop)  # after the cancelled tasks' next step: their futures are cancelled then
