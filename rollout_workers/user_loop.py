"""The event loop a worker runs users' coroutines on (async reward functions, async environments):
one asyncio loop on a daemon thread of its own, started on first use."""

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
        """Await ``awaitable`` on the loop; the returned future holds what it returned or raised
        (``SystemExit`` too: raised inside the loop it would end the loop's thread), or is
        cancelled when it ends in ``asyncio.CancelledError``."""
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
        """Cancel what runs on the loop, then stop it, so a thread waiting on a future of :meth:`submit`
        gets ``CancelledError`` instead of waiting for ever (and holding up the process's exit)."""
        with self._lock:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(_cancel_and_stop, self._loop)


def _cancel_and_stop(loop: asyncio.AbstractEventLoop) -> None:
    for task in asyncio.all_tasks(loop):
        task.cancel()
    loop.call_soon(loop.stop)  # after the cancelled tasks' next step: their futures are cancelled then
