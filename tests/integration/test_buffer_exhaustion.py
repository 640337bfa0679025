"""A Redis out of memory (maxmemory reached under noeviction) and a Redis that evicts keys.

Under ``maxmemory-policy noeviction`` Redis refuses writes (and every command queued in a
MULTI) with ``OOM command not allowed when used memory > 'maxmemory'``. The buffer's scripts
are flagged (``#!lua``), so Redis refuses them before their first write: nothing is half done.
"""

from __future__ import annotations

import logging
import threading

import pytest
import redis

import factories as T
from buffer import BufferOutOfMemory, LearnerClient
from buffer import keys as K
from buffer_clients import Clients
from rlhf_core.config import BufferConfig
from rlhf_core.errors import UserError

pytestmark = pytest.mark.integration


def _buffer(url: str, max_retry_s: float) -> Clients:
    buf = Clients.connect(url, "oom", BufferConfig(lease_timeout_s=30.0, max_retry_s=max_retry_s, lookahead=None))
    buf.learner.init_run(batch_size=8, group_size=4, max_staleness=4)
    return buf


def _fill_up(admin: redis.Redis) -> None:
    """maxmemory far under what Redis uses: every write from here on is refused (a limit just under
    the usage shown may not be: Redis does not count its AOF buffer)."""
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)


def _state(buf: Clients) -> tuple[int, int, int]:
    """(groups in the sample stream, prompts still leased, prompts acked), straight from Redis."""
    leased = buf.redis.xpending(buf.keys.prompts, K.WORKERS_GROUP)["pending"]
    return buf.redis.xlen(buf.keys.samples), leased, buf.monitor.metrics()["counters"]["prompts_acked"]


def test_redis_out_of_memory_is_ridden_out_and_logged(redis_url):
    buf = _buffer(redis_url, max_retry_s=60.0)
    buf.producer.enqueue_prompts(T.prompts(1))
    (lease,) = buf.worker.claim("w1", 1)
    admin = redis.Redis.from_url(redis_url)
    _fill_up(admin)
    seen = T.LogSeen("out of memory")
    logging.getLogger("buffer").addHandler(seen)
    result: list = []
    done = threading.Thread(target=lambda: result.append(buf.worker.complete(lease, T.group(lease.prompt))))
    try:
        done.start()
        assert seen.event.wait(30), "no log line says Redis is out of memory"
        assert buf.redis.xlen(buf.keys.samples) == 0  # refused whole: nothing appended, the prompt still leased
        assert buf.redis.xpending(buf.keys.prompts, K.WORKERS_GROUP)["pending"] == 1
        admin.config_set("maxmemory", 0)  # the operator raises the limit
        done.join(30)
    finally:
        logging.getLogger("buffer").removeHandler(seen)
        admin.config_set("maxmemory", 0)
    assert result == ["appended"]
    assert _state(buf) == (1, 0, 1)  # exactly one group, acked once


def test_redis_out_of_memory_past_max_retry_s_stops_with_one_line_and_writes_nothing(redis_url):
    buf = _buffer(redis_url, max_retry_s=0.3)
    buf.producer.enqueue_prompts(T.prompts(2))
    leases = buf.worker.claim("w1", 2)
    buf.worker.complete(leases[1], T.group(leases[1].prompt))
    batch = buf.learner.read_batch("learner", 0, 4, timeout_s=5.0)
    assert batch is not None
    admin = redis.Redis.from_url(redis_url)
    _fill_up(admin)
    calls = {
        "complete": lambda: buf.worker.complete(leases[0], T.group(leases[0].prompt)),
        "heartbeat": lambda: buf.worker.heartbeat("w1", 0, {"version": 0}),
        "enqueue": lambda: buf.producer.enqueue_prompts(T.prompts(1, start=5)),
        "set_learner_version": lambda: buf.learner.set_learner_version(1),
        "commit": lambda: buf.learner.commit(batch),
        "metrics": buf.monitor.metrics,
    }
    try:
        for name, call in calls.items():
            with pytest.raises(BufferOutOfMemory) as err:
                call()
            assert isinstance(err.value, UserError), name  # one line and exit 2, not a traceback
            msg = str(err.value)
            assert "out of memory" in msg and "maxmemory" in msg and "buffer.max_retry_s=0.3" in msg, (name, msg)
            assert "\n" not in msg
    finally:
        admin.config_set("maxmemory", 0)
    assert _state(buf) == (1, 1, 1)  # nothing changed: the group uncommitted, the other prompt leased
    assert buf.learner.learner_version() == 0
    # memory back: each call goes through, once
    assert buf.worker.complete(leases[0], T.group(leases[0].prompt)) == "appended"
    assert buf.learner.commit(batch) == 1
    assert _state(buf) == (1, 0, 2)


@pytest.mark.parametrize("policy", ["allkeys-lru", "allkeys-lfu", "allkeys-random"])
def test_a_redis_that_evicts_any_key_is_refused(redis_url, policy):
    admin = redis.Redis.from_url(redis_url)
    admin.config_set("maxmemory", 512 * 1024 * 1024)
    admin.config_set("maxmemory-policy", policy)
    with pytest.raises(UserError) as err:
        Clients.connect(redis_url, "evict", BufferConfig())
    msg = str(err.value)
    assert f"maxmemory-policy {policy}" in msg and "noeviction" in msg


def test_a_redis_that_evicts_only_keys_with_a_ttl_or_has_no_limit_is_accepted(redis_url):
    admin = redis.Redis.from_url(redis_url)
    admin.config_set("maxmemory", 512 * 1024 * 1024)
    admin.config_set("maxmemory-policy", "volatile-lru")  # the run's keys have no TTL: never evicted
    LearnerClient.connect(redis_url, "evict", BufferConfig()).init_run(batch_size=4, group_size=4, max_staleness=0)
    admin.config_set("maxmemory", 0)
    admin.config_set("maxmemory-policy", "allkeys-lru")  # no limit: nothing is evicted
    LearnerClient.connect(redis_url, "evict", BufferConfig()).init_run(batch_size=4, group_size=4, max_staleness=0)


@pytest.fixture
def full_disk(tmp_path):
    """A redis-server whose data folder is a 4 MiB tmpfs (mounting needs root: skipped otherwise),
    and a function that fills that disk (returns the filler file; delete it to make room)."""
    import subprocess

    from servers import redis_server

    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}): a full disk needs root")

    def fill():
        filler = disk / "filler"
        with open(filler, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
            except OSError:
                pass
        return filler

    try:
        # everysec, as rlhf-run's own Redis: under `always` Redis exits on an AOF write error
        with redis_server(disk / "redis", fsync="everysec") as server:
            yield server.url, fill
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_redis_unable_to_write_its_full_disk_is_ridden_out_then_stops_with_one_line(full_disk):
    # Redis refuses every write with MISCONF once its append-only file cannot be written; the
    # first refusal ended workers and the learner with a traceback (exit 1), and rlhf-run
    # restarted them into the same refusals
    url, fill = full_disk
    buf, patient = _buffer(url, max_retry_s=0.3), _buffer(url, max_retry_s=60.0)
    buf.producer.enqueue_prompts(T.prompts(2))
    leases = buf.worker.claim("w1", 2)
    admin = redis.Redis.from_url(url)
    filler = fill()

    def refused() -> bool:
        try:
            admin.set("probe", b"\0" * 65536)  # more than the room left in the file's last page
        except redis.exceptions.ResponseError as exc:
            return str(exc).startswith("MISCONF")
        return False

    from servers import wait_for

    wait_for(refused, 30, "Redis to refuse writes on its full disk", 0.1)
    with pytest.raises(UserError) as err:
        buf.worker.complete(leases[0], T.group(leases[0].prompt))
    msg = str(err.value)
    assert "cannot write its data to disk and refused writes for buffer.max_retry_s=0.3 s" in msg, msg
    assert "No space left on device" in msg and "make room on the disk of its data folder" in msg and "\n" not in msg
    assert _state(buf) == (0, 2, 0)  # refused whole: nothing appended, both prompts still leased
    # ridden out while within the budget: room comes back, Redis writes again, the call goes through once
    seen = T.LogSeen("make room on the disk of its data folder")
    logging.getLogger("buffer").addHandler(seen)
    result: list = []
    done = threading.Thread(target=lambda: result.append(patient.worker.complete(leases[1], T.group(leases[1].prompt))))
    try:
        done.start()
        assert seen.event.wait(30), "no log line says Redis cannot write to its disk"
        filler.unlink()
        done.join(60)
    finally:
        logging.getLogger("buffer").removeHandler(seen)
    assert result == ["appended"]
    assert _state(buf) == (1, 1, 1)
