"""The test fixtures themselves: a real redis-server with AOF, and ZeroMQ that cannot hang."""

from __future__ import annotations

import os
import signal

import pytest
import redis
import zmq

from servers import RedisServer, free_port, recv_with_timeout

pytestmark = pytest.mark.integration


def test_redis_fixture_is_real_and_durable_across_a_crash(redis_server):
    r = redis.Redis.from_url(redis_server.url)
    assert r.config_get("appendonly")["appendonly"] == "yes"
    r.set("k", "v")
    pid = redis_server.pid
    redis_server.restart(signal.SIGKILL)  # no chance to save: only the AOF keeps the key
    assert redis_server.pid != pid
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    r = redis.Redis.from_url(redis_server.url)
    assert r.get("k") == b"v"


def test_redis_with_password(tmp_path):
    server = RedisServer(tmp_path, password="s3cret").start()
    try:
        assert redis.Redis.from_url(server.url).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port, password="wrong").ping()
    finally:
        server.stop()
    assert server.proc is None


def test_zmq_receive_times_out_instead_of_hanging(zmq_ctx):
    sock = zmq_ctx.socket(zmq.PULL)
    sock.bind(f"tcp://127.0.0.1:{free_port()}")
    with pytest.raises(TimeoutError, match="no message within 50 ms"):
        recv_with_timeout(sock, 50)
    assert sock.getsockopt(zmq.LINGER) == 0
    sock.close()
