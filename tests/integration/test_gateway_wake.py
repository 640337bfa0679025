"""How a gateway call reaches a worker and is ended, on real Redis. An idle worker serving the gateway waits
for prompts while its taker thread fetches gateway calls (the worker's BackgroundChannel over a
WorkerChannel): a call fetched during that wait must end it (before, it sat unstarted until the
wait's cap, 0.2 s, seen as 250-300 ms turns for one agent whose turns took 40 ms). The gateway's
CallQueue sends calls submitted together in one round trip, in order, and the calls that arrive
together ask Redis for the live workers once."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis.asyncio as aioredis

import test_buffer_gateway_groups
from buffer import prompts
from buffer.gateway import CallChunk, CallQueue, GatewayCall, LiveWorkers, WorkerChannel
from buffer_clients import Clients
from rollout_workers.gateway_calls import BackgroundChannel

pytestmark = pytest.mark.integration
buf = test_buffer_gateway_groups.buf  # the fixture: a run of groups of 2 on the test's own Redis


def test_a_claim_whose_interrupt_says_so_returns_without_waiting(buf, monkeypatch):
    monkeypatch.setattr(prompts, "WAIT_CAP_S", 60.0)  # one wait would outlast the test's timeout
    asked = []
    assert buf.worker.claim("w0", max_prompts=1, block_s=600, interrupt=lambda: asked.append(1) or True) == []
    assert asked == [1]  # asked once, after the claim found nothing


def blocked_in_xread(buf: Clients, timeout_s: float = 10.0) -> None:
    """Until a connection of the worker's waits in ``XREAD`` (the claim's wait for a wake-up)."""
    deadline = time.monotonic() + timeout_s
    while not any(c.get("cmd") == "xread" for c in buf.redis.client_list()):
        assert time.monotonic() < deadline, "the idle claim never waited"
        time.sleep(0.01)


@pytest.mark.timeout(60)
def test_a_call_the_taker_fetches_while_the_worker_waits_for_prompts_ends_the_wait(buf, monkeypatch):
    # Waits are capped at WAIT_CAP_S; made longer than the test's timeout, only the taker's wake
    # can end this one (the gateway's own wake for the call was consumed before the wait began).
    monkeypatch.setattr(prompts, "WAIT_CAP_S", 600.0)
    ch = BackgroundChannel(WorkerChannel(buf.redis, buf.keys))
    try:
        assert ch.take(1, wait_s=0) == []  # the taker now waits for a call (BRPOP)
        entered, ended, out = threading.Event(), threading.Event(), {}

        def idle_worker() -> None:
            with ch.waiting() as interrupt:
                entered.set()
                out["leases"] = buf.worker.claim("w0", max_prompts=1, block_s=600, interrupt=interrupt)
            ended.set()

        threading.Thread(target=idle_worker, daemon=True).start()
        assert entered.wait(10)
        blocked_in_xread(buf)  # past its last look at the inbox
        wakes = buf.redis.xlen(buf.keys.wake_prompts)
        buf.redis.lpush(buf.keys.gw_calls, b"call")  # as the gateway pushes it, without its wake-up
        assert ended.wait(30), "the idle claim went on waiting with a call fetched"
        assert out["leases"] == [] and [raw for raw, _ in ch.inbox] == [b"call"] and not ch.main_waiting
        assert buf.redis.xlen(buf.keys.wake_prompts) == wakes + 1  # the taker's
    finally:
        ch.close()


def _call(i: int) -> GatewayCall:
    return GatewayCall(call_id=f"c{i}", reply_to="g", prompt_ids=[1, 2, i], max_tokens=4, temperature=1.0, top_p=1.0,
                       stop=[], stream=False)


def test_calls_submitted_together_go_in_one_round_trip_in_order(buf, redis_url):
    # 20 agents' turns submitted at once: asyncio runs every submit up to its wait before the
    # sender task's first step, so one LPUSH and one wake-up carry them all; workers pop (RPOP)
    # them in submission order. A later lone call takes a round trip of its own.
    async def go() -> int:
        client = aioredis.Redis.from_url(redis_url)
        try:
            queue = CallQueue(client, buf.keys)
            await asyncio.gather(*(queue.submit([_call(2 * i), _call(2 * i + 1)]) for i in range(10)))
            await queue.submit([_call(20)])
            return queue.round_trips
        finally:
            await client.aclose()

    wakes = buf.redis.xlen(buf.keys.wake_prompts)
    assert asyncio.run(go()) == 2
    assert buf.redis.xlen(buf.keys.wake_prompts) == wakes + 2
    popped = [GatewayCall.decode(buf.redis.rpop(buf.keys.gw_calls)).call_id for _ in range(21)]
    assert popped == [f"c{i}" for i in range(21)] and buf.redis.llen(buf.keys.gw_calls) == 0


def test_a_failed_round_trip_fails_every_call_in_it(buf):
    async def go() -> list:
        client = aioredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=1)  # nothing listens there
        try:
            queue = CallQueue(client, buf.keys)
            return await asyncio.gather(*(queue.submit([_call(i)]) for i in range(3)), return_exceptions=True)
        finally:
            await client.aclose()

    out = asyncio.run(go())
    assert len(out) == 3 and all(isinstance(e, aioredis.ConnectionError) for e in out), out


def hgetalls(buf: Clients) -> int:
    """HGETALL commands the test's Redis has served (its own command statistics)."""
    return int(buf.redis.info("commandstats").get("cmdstat_hgetall", {}).get("calls", 0))


def test_calls_arriving_together_count_the_live_workers_once(buf, redis_url):
    # 64 agents' turns arrive together and each needs a live worker: one HGETALL of the consumers'
    # records serves them all; within max_age_s the count is reused; with no worker it is counted
    # again at every ask (a worker that starts is seen at once).
    async def go() -> list[int]:
        client = aioredis.Redis.from_url(redis_url)
        try:
            workers = LiveWorkers(client, buf.keys, within_s=5.0, max_age_s=60.0)
            before = hgetalls(buf)
            assert await asyncio.gather(*(workers.count() for _ in range(64))) == [0] * 64
            none_yet = hgetalls(buf) - before  # nobody heartbeated yet: counted once for the 64
            assert await workers.count() == 0  # 0 is counted again
            zero_again = hgetalls(buf) - before - none_yet
            buf.worker.heartbeat("w0")  # (its first heartbeat also sweeps dead consumers: an HGETALL of its own)
            before = hgetalls(buf)
            first = await asyncio.gather(*(workers.count() for _ in range(64)))
            counted = hgetalls(buf) - before
            again = await asyncio.gather(*(workers.count() for _ in range(64)))
            reused = hgetalls(buf) - before - counted
            return [none_yet, zero_again, counted, reused, *set(first), *set(again)]
        finally:
            await client.aclose()

    assert asyncio.run(go()) == [1, 1, 1, 0, 1, 1]


def test_a_worker_aborts_the_calls_cancelled_or_left_by_their_gateway_and_clears_their_marks(buf):
    # A running call is aborted when its client gave up (the gateway's mark in P gw:cancel) or its
    # gateway is gone (nobody listens on its channel: a gateway stopped or died, and the one started
    # after it has an id of its own). The final chunk of an aborted call takes its mark with it:
    # marks whose gateway died before reading that chunk stayed in the hash for good.
    listener = buf.redis.pubsub()
    listener.subscribe(buf.keys.gw_out("alive"))
    try:
        assert listener.get_message(timeout=5)["type"] == "subscribe"
        buf.redis.hset(buf.keys.gw_cancel, mapping={"c-cancelled": "1.0", "c-orphan-cancelled": "1.0"})
        ch = WorkerChannel(buf.redis, buf.keys)
        running = [("c-cancelled", "alive"), ("c-running", "alive"), ("c-orphan", "gone"), ("c-orphan-cancelled", "gone")]
        assert ch.send([], running) == ["c-cancelled", "c-orphan", "c-orphan-cancelled"]
        finals = [(g, CallChunk(c, [], final=True, finish_reason="abort")) for c, g in running if c != "c-running"]
        assert ch.send(finals, [("c-running", "alive")]) == []
        assert buf.redis.hlen(buf.keys.gw_cancel) == 0
        got = listener.get_message(timeout=5)
        assert got["type"] == "message" and CallChunk.decode(got["data"]).call_id == "c-cancelled"
        assert listener.get_message(timeout=0.2) is None  # the gone gateway's chunks reached nobody
    finally:
        listener.close()
