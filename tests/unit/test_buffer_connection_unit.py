"""URL handling and the retry policy, without a server."""

from __future__ import annotations

import logging

import pytest
import redis

from buffer import BufferAuthError, BufferUnavailable
from buffer import connection as C
from rlhf_core.config import BufferConfig


def test_redact_hides_only_the_password():
    assert C.redact("redis://alice:pa%3Ass@host:6380/2") == "redis://alice:***@host:6380/2"
    assert C.redact("rediss://:secret@h:1/0") == "rediss://:***@h:1/0"
    assert C.redact("redis://h:1/0") == "redis://h:1/0"


def test_address_and_start_hint():
    assert C.address("redis://h:6390/0") == ("h:6390", "redis-server --port 6390 --dir <its data dir> --appendonly yes")
    assert C.address("redis://h/0") == ("h:6379", "redis-server --port 6379 --dir <its data dir> --appendonly yes")
    assert C.address("unix:///tmp/r.sock")[0] == "unix socket /tmp/r.sock"
    assert "--tls-port 6390" in C.address("rediss://h:6390/0")[1]


def test_tls_options_reach_the_client_only_for_rediss():
    cfg = BufferConfig(ssl_ca_certs="/ca.pem", ssl_certfile="/c.pem", ssl_keyfile="/k.pem", connect_timeout_s=3)
    kw = C.client_kwargs("rediss://h:1/0", cfg)
    assert (kw["ssl_ca_certs"], kw["ssl_certfile"], kw["ssl_keyfile"]) == ("/ca.pem", "/c.pem", "/k.pem")
    assert kw["socket_connect_timeout"] == 3 and kw["retry"]._retries == 0  # redis-py's silent retries off
    assert "ssl_ca_certs" not in C.client_kwargs("redis://h:1/0", cfg)
    client = redis.Redis.from_url("rediss://u:p@h:1/0", **kw)
    conn = client.connection_pool.connection_kwargs
    assert (conn["username"], conn["password"], conn["ssl_ca_certs"]) == ("u", "p", "/ca.pem")


def test_bad_scheme_is_refused():
    with pytest.raises(BufferUnavailable, match="must start with redis://"):
        C.client_kwargs("http://h:1", BufferConfig())


def test_retrying_rides_out_transient_errors_and_logs(caplog, monkeypatch):
    monkeypatch.setattr(C.time, "sleep", lambda s: None)
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] < 3:
            raise redis.exceptions.ConnectionError("Connection refused")
        return "ok"

    r = C.Retrying("redis://h:7/0", max_retry_s=10)
    with caplog.at_level(logging.WARNING, logger="buffer"):
        assert r(flaky) == "ok"
    assert calls["n"] == 3 and r.reconnects == 2
    msgs = [rec.getMessage() for rec in caplog.records]
    assert "retrying in 0.05 s (attempt 1" in msgs[0] and "retrying in 0.10 s (attempt 2" in msgs[1]


def test_retrying_backoff_is_capped_and_bounded_in_time(monkeypatch):
    slept: list[float] = []
    clock = {"t": 0.0}
    monkeypatch.setattr(C.time, "sleep", lambda s: (slept.append(s), clock.__setitem__("t", clock["t"] + s)))
    monkeypatch.setattr(C.time, "monotonic", lambda: clock["t"])

    def down():
        raise redis.exceptions.BusyLoadingError("LOADING Redis is loading the dataset in memory")

    with pytest.raises(BufferUnavailable, match="did not come back within buffer.max_retry_s=10"):
        C.Retrying("redis://h:7/0", max_retry_s=10)(down)
    assert slept[:6] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6] and max(slept) == C.BACKOFF_CAP_S
    assert sum(slept) <= 10


def test_auth_errors_are_not_retried(monkeypatch):
    monkeypatch.setattr(C.time, "sleep", lambda s: pytest.fail("must not retry"))

    def refused():
        raise redis.exceptions.AuthenticationError("invalid username-password pair")

    with pytest.raises(BufferAuthError, match="refused the credentials of user 'bob'"):
        C.Retrying("redis://bob:pw@h:7/0", max_retry_s=10)(refused)
