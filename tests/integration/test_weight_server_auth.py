"""Weight-server authentication over real sockets: CURVE keys and HMAC secrets, right and wrong."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch

from rlhf_core.config import ConfigError, WeightServerConfig
from weight_server import WeightAuthError, WeightPublisher, WeightServer, WeightSubscriber, generate_keys
from weight_server.cli import gen_keys

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
SECRET = "correct horse battery staple, 2024"
# "big" spans 16 chunks of 64 KiB, so signed and encrypted data frames are exercised, not only headers.
DATA = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.tensor([7, 8], dtype=torch.int64),
        "big": torch.arange(256 * 1024, dtype=torch.float32)}


def _cfg(**kw) -> WeightServerConfig:
    return WeightServerConfig(chunk_bytes=64 * 1024, request_timeout_s=2.0, retry_timeout_s=3.0, announce_interval_s=0.1, **kw)


def _roundtrip(server: WeightServer, cfg: WeightServerConfig, version: int) -> None:
    with WeightPublisher(server.address, cfg) as pub, WeightSubscriber(server.address, server.pub_address, cfg) as sub:
        pub.publish(version, DATA)
        got_version, got = sub.pull()
        assert got_version == version
        assert all(torch.equal(got[n], DATA[n]) for n in DATA)


@pytest.fixture
def keys(tmp_path) -> tuple[dict[str, str], dict[str, str]]:
    return generate_keys(tmp_path / "keys"), generate_keys(tmp_path / "other")


def _curve_server_cfg(k: dict[str, str], **kw) -> WeightServerConfig:
    return _cfg(auth="curve", curve_server_secret=k["curve_server_secret"], curve_client_public=k["curve_client_public"], **kw)


def _curve_client_cfg(server_public: str, client: dict[str, str]) -> WeightServerConfig:
    return _cfg(auth="curve", curve_server_public=server_public, curve_client_public=client["curve_client_public"],
                curve_client_secret=client["curve_client_secret"])


def test_curve_authorised_client_publishes_and_pulls_on_an_exposed_bind(keys):
    good, _ = keys
    server = WeightServer(_curve_server_cfg(good, host="0.0.0.0")).start()
    try:
        assert server.address.startswith("tcp://127.0.0.1:")
        _roundtrip(server, _curve_client_cfg(good["curve_server_public"], good), 1)
    finally:
        server.stop()


def test_curve_unauthorised_client_key_is_refused_and_logged(keys, caplog):
    good, other = keys
    server = WeightServer(_curve_server_cfg(good)).start()
    caplog.set_level(logging.WARNING, logger="weight_server")
    try:
        t0 = time.monotonic()
        with WeightPublisher(server.address, _curve_client_cfg(good["curve_server_public"], other)) as pub:
            with pytest.raises(WeightAuthError, match="refused our CURVE client key"):
                pub.latest_version()
        assert time.monotonic() - t0 < 2.0  # seen in the handshake, not after a timeout
        assert server.metrics()["counters"]["auth_refused"] >= 1
        assert any("refused CURVE client from 127.0.0.1" in r.getMessage() and "not authorised" in r.getMessage()
                   for r in caplog.records)
        _roundtrip(server, _curve_client_cfg(good["curve_server_public"], good), 1)  # others still served
    finally:
        server.stop()


def test_the_refusals_remembered_for_rate_limited_logging_are_only_the_recent_ones(keys, zmq_ctx, monkeypatch):
    # A refused handshake is logged at most once per REFUSAL_LOG_S for its (address, key); what
    # was logged when was kept for good, one entry per key any client ever tried (anyone who can
    # reach the port picks them). An entry older than REFUSAL_LOG_S holds nothing back: it goes.
    import zmq

    from weight_server import auth

    monkeypatch.setattr(auth, "REFUSAL_LOG_S", 0.0, raising=False)  # every refusal's entry is at once old
    good, _ = keys
    server = WeightServer(_curve_server_cfg(good)).start()
    socks, n = [], 20
    try:
        for _ in range(n):  # n clients, each with a key of its own
            sock = zmq_ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.curve_serverkey = auth.load_key(good["curve_server_public"], "curve_server_public")
            sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
            sock.connect(server.address)
            socks.append(sock)
        deadline = time.monotonic() + 20
        while server.metrics()["counters"]["auth_refused"] < n:
            assert time.monotonic() < deadline, "the handshakes were not all refused"
            time.sleep(0.02)
        assert len(server.zap._last_log) <= 2
    finally:
        for sock in socks:
            sock.close(linger=0)
        server.stop()


def test_curve_wrong_server_key_is_a_clear_error(keys):
    good, other = keys
    server = WeightServer(_curve_server_cfg(good)).start()
    try:
        with WeightSubscriber(server.address, server.pub_address, _curve_client_cfg(other["curve_server_public"], good)) as sub:
            with pytest.raises(WeightAuthError, match="curve_server_public does not match the server's key"):
                sub.pull()
    finally:
        server.stop()


def test_hmac_right_secret_works_and_wrong_or_missing_secret_is_refused(caplog):
    server = WeightServer(_cfg(auth="hmac", secret=SECRET)).start()
    caplog.set_level(logging.WARNING, logger="weight_server")
    try:
        _roundtrip(server, _cfg(auth="hmac", secret=SECRET), 1)
        wrong = _cfg(auth="hmac", secret="not the right secret at all")
        with WeightPublisher(server.address, wrong) as pub:
            with pytest.raises(WeightAuthError, match="refused our HMAC: weight_server.secret differs"):
                pub.publish(2, DATA)
        with WeightSubscriber(server.address, server.pub_address, wrong) as sub:
            with pytest.raises(WeightAuthError, match="secret differs"):
                sub.pull()
        with WeightPublisher(server.address, _cfg()) as pub:  # auth=none against an hmac server
            with pytest.raises(WeightAuthError, match="requires authentication"):
                pub.latest_version()
        assert server.metrics()["counters"]["auth_refused"] == 3
        assert any("HMAC check failed" in r.getMessage() for r in caplog.records)
        assert server.metrics()["held"] == {"policy": [1]}  # the refused publish changed nothing
        _roundtrip(server, _cfg(auth="hmac", secret=SECRET), 2)
    finally:
        server.stop()


def test_exposed_bind_without_auth_and_weak_secret_are_config_errors():
    with pytest.raises(ConfigError, match="exposes the weight server beyond this machine"):
        WeightServer(_cfg(host="0.0.0.0"))
    with pytest.raises(ConfigError, match="at least 16 characters"):
        WeightServer(_cfg(auth="hmac", secret="short"))
    with pytest.raises(ConfigError, match="needs the clients' public keys"):
        WeightServer(_cfg(auth="curve", curve_server_secret="x" * 40))


def test_gen_keys_command_writes_key_pairs(tmp_path, capsys):
    assert gen_keys(["--gen-keys", str(tmp_path / "k")]) == 0
    names = sorted(p.name for p in (tmp_path / "k").iterdir())
    assert names == ["client.key", "client.key_secret", "server.key", "server.key_secret"]
    assert (Path(tmp_path / "k" / "server.key_secret").stat().st_mode & 0o777) == 0o600
    out = capsys.readouterr().out
    assert f"weight_server.curve_server_secret={(tmp_path / 'k' / 'server.key_secret').resolve()}" in out
    assert gen_keys(["--gen-keys"]) == 2


def test_a_signed_chunk_notice_is_not_taken_for_chunk_data(zmq_ctx):
    # once: under HMAC a follower on shared memory read the notice's MAC into its slab view; the
    # next reply then began with a stray frame ("unreadable reply ... malformed msgpack (32 bytes)")
    # and the worker crashed, again and again, in every launcher=ray run (HMAC is on there)
    import zmq

    from weight_server import protocol as P
    from weight_server.auth import Signer
    from weight_server.client import Channel

    cfg = _cfg(auth="hmac", secret=SECRET)
    router = zmq_ctx.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    channel = Channel(f"tcp://127.0.0.1:{port}", cfg, zmq_ctx)
    try:
        rid = channel.send(P.FETCH, name="policy", version=1, chunk=0, shm=True)
        assert router.poll(5000), "the fetch did not arrive"
        ident = router.recv_multipart()[0]
        sign = Signer(SECRET).sign
        notice = P.encode(P.CHUNK, rid=rid, version=1, chunk=0, offset=0, shm=True)
        committed = P.encode(P.COMMITTED, rid=rid + 1, name="policy", version=1, content_hash=b"\0" * 16)
        router.send_multipart([ident, notice, sign([notice])])
        router.send_multipart([ident, committed, sign([committed])])
        slab = bytearray(64)  # where the chunk's bytes already are
        got = channel.recv(5.0, into=lambda header: [memoryview(slab)])
        assert got["kind"] == P.CHUNK and got["shm"] is True and slab == bytearray(64)
        assert channel.recv(5.0)["kind"] == P.COMMITTED  # the MAC was consumed with its message
    finally:
        channel.close()
        router.close(0)
