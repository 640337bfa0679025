"""Connections (auth, ACL, TLS, unreachable), run namespaces side by side, run parameters."""

from __future__ import annotations

import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import redis

import factories as T
from buffer import BufferAuthError, BufferUnavailable, LearnerClient, RunParamsMismatch, WorkerClient
from buffer_clients import Clients
from rlhf_core.config import BufferConfig
from servers import RedisServer, free_port

pytestmark = pytest.mark.integration


def test_wrong_password_gives_a_clear_error(tmp_path):
    server = RedisServer(tmp_path / "r", password="s3cret-pw").start()
    try:
        for url in (f"redis://:wrong-pw@127.0.0.1:{server.port}/0", f"redis://127.0.0.1:{server.port}/0"):
            with pytest.raises(BufferAuthError) as err:
                Clients.connect(url, "x", BufferConfig(connect_timeout_s=2.0))
            msg = str(err.value)
            assert f"Redis at 127.0.0.1:{server.port} refused the credentials" in msg
            assert "wrong-pw" not in msg and "s3cret-pw" not in msg  # never echo a password
        buf = Clients.connect(server.url, "x", BufferConfig(connect_timeout_s=2.0))
        buf.learner.init_run(batch_size=4, group_size=4, max_staleness=0)
    finally:
        server.stop()


def readme_acl_rule() -> list[str]:
    """The ACL rule docs/cluster.md gives for a run on a shared Redis."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "cluster.md").read_text()
    return shlex.split(text.split("`ACL SETUSER ", 1)[1].split("`", 1)[0])


def test_the_readmes_acl_user_runs_the_buffer_and_a_missing_permission_is_named(tmp_path):
    server = RedisServer(tmp_path / "r", password="admin").start()
    try:
        admin = Clients.connect(server.url, "acl", BufferConfig()).redis
        rule = readme_acl_rule()
        assert rule[0] == "rlhf" and "-@dangerous" in rule
        admin.execute_command("ACL", "SETUSER", *rule)
        admin.execute_command("ACL", "SETUSER", "outsider", "on", ">opw", "~elsewhere:*", "+@all")
        ok = Clients.connect(f"redis://rlhf:SECRET@127.0.0.1:{server.port}/0", "acl", BufferConfig())
        ok.learner.init_run(batch_size=4, group_size=4, max_staleness=0)
        ok.producer.enqueue_prompts(T.prompts(1))
        [lease] = ok.worker.claim("w", 1)
        assert ok.worker.complete(lease, T.group(lease.prompt, 4)) == "appended"
        batch = ok.learner.read_batch("learner-0", 0, 4, timeout_s=1.0)
        assert batch is not None and len(batch.samples) == 4
        ok.learner.commit(batch)
        assert ok.monitor.metrics()["counters"]["samples_appended"] == 4
        # the gateway's answers travel on a pub/sub channel of the run (RunKeys.gw_out): allowed too
        channel = ok.keys.gw_out("gateway-1")
        sub = ok.redis.pubsub()
        sub.subscribe(channel)
        assert sub.get_message(timeout=5)["type"] == "subscribe"  # subscribed before the publish
        assert ok.redis.publish(channel, b"chunk") == 1
        assert sub.get_message(timeout=5)["data"] == b"chunk"
        sub.close()
        with pytest.raises(redis.exceptions.NoPermissionError):  # not another run's or user's channel
            ok.redis.publish("elsewhere:channel", b"x")
        assert ok.monitor.delete_run() > 0
        denied = Clients.connect(f"redis://outsider:opw@127.0.0.1:{server.port}/0", "acl", BufferConfig())
        with pytest.raises(BufferAuthError, match="denied a command to this ACL user"):
            denied.learner.init_run(batch_size=4, group_size=4, max_staleness=0)
    finally:
        server.stop()


@pytest.mark.timeout(20)
def test_unreachable_redis_gives_a_clear_error_quickly():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(BufferUnavailable) as err:
        Clients.connect(f"redis://127.0.0.1:{port}/0", "x", BufferConfig(connect_timeout_s=0.5))
    assert time.monotonic() - t0 < 3
    msg = str(err.value)
    assert f"cannot reach Redis at 127.0.0.1:{port}" in msg
    assert "is redis-server running?" in msg and f"redis-server --port {port}" in msg


@pytest.mark.timeout(20)
def test_redis_gone_for_longer_than_max_retry_gives_a_clear_error(redis_server):
    buf = Clients.connect(redis_server.url, "gone", BufferConfig(max_retry_s=0.5))
    buf.learner.init_run(batch_size=4, group_size=4, max_staleness=0)
    redis_server.stop(signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(BufferUnavailable, match="did not come back within buffer.max_retry_s=0.5"):
        buf.worker.claim("w", 1)
    assert time.monotonic() - t0 < 2.5


def test_two_runs_side_by_side_do_not_touch_each_other(redis_url):
    a = Clients.connect(redis_url, "sweep/algo.max_staleness=0", BufferConfig())
    b = Clients.connect(redis_url, "sweep/algo.max_staleness=2", BufferConfig())
    a.redis.set("someone-elses:key", "keep me")
    a.learner.init_run(batch_size=8, group_size=4, max_staleness=0)
    b.learner.init_run(batch_size=16, group_size=4, max_staleness=2)
    a.producer.enqueue_prompts(T.prompts(5))
    b.producer.enqueue_prompts(T.prompts(3))
    for lease in a.worker.claim("w", 5):
        a.worker.complete(lease, T.group(lease.prompt))
    assert len(b.worker.claim("w", 10)) == 3 and b.learner.read_batch("L", 0, 16, timeout_s=0.05) is None
    assert len(a.learner.read_batch("L", 0, 8, timeout_s=0.5)) == 8
    ca, cb = a.monitor.metrics()["counters"], b.monitor.metrics()["counters"]
    assert (ca["prompts_enqueued"], ca["prompts_claimed"], ca["samples_appended"]) == (5, 2, 8)
    assert (cb["prompts_enqueued"], cb["prompts_claimed"], cb["samples_appended"]) == (3, 3, 0)
    assert b.store.run_params()["batch_size"] == 16 and a.store.run_params()["batch_size"] == 8

    b_keys = sorted(b.redis.scan_iter(match=b.keys.pattern()))
    a_keys = list(a.redis.scan_iter(match=a.keys.pattern()))
    assert len(a_keys) == 6 and len(b_keys) == 6  # params version counters prompts samples wake:prompts
    assert a.monitor.delete_run() == len(a_keys)
    assert list(a.redis.scan_iter(match=a.keys.pattern())) == []
    assert sorted(b.redis.scan_iter(match=b.keys.pattern())) == b_keys
    assert a.redis.get("someone-elses:key") == b"keep me"
    assert b.monitor.metrics()["counters"]["prompts_claimed"] == 3


def test_init_run_is_idempotent_and_refuses_other_parameters(redis_url):
    buf = Clients.connect(redis_url, "params", BufferConfig())
    first = buf.learner.init_run(batch_size=8, group_size=4, max_staleness=2, vocab_size=100)
    assert LearnerClient.connect(redis_url, "params", BufferConfig()).init_run(
        batch_size=8, group_size=4, max_staleness=2, vocab_size=100) == first
    with pytest.raises(RunParamsMismatch, match="batch_size: run has 8, you passed 16"):
        LearnerClient.connect(redis_url, "params", BufferConfig()).init_run(batch_size=16, group_size=4, max_staleness=2, vocab_size=100)
    worker = WorkerClient.connect(redis_url, "params", BufferConfig(max_reuse=5))  # a worker's own config does not matter
    assert worker.run_params() == first and first["mode"] == "fifo"


@pytest.mark.timeout(30)
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make certificates")
def test_rediss_with_a_private_ca(tmp_path):
    ca, cert, key = _make_certs(tmp_path)
    port = free_port()
    proc = subprocess.Popen(
        [shutil.which("redis-server"), "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca),
         "--tls-auth-clients", "no", "--dir", str(tmp_path), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        url = f"rediss://127.0.0.1:{port}/0"
        buf = Clients.connect(url, "tls", BufferConfig(ssl_ca_certs=str(ca), connect_timeout_s=5.0))
        buf.learner.init_run(batch_size=4, group_size=4, max_staleness=0)
        buf.producer.enqueue_prompts(T.prompts(1))
        (lease,) = buf.worker.claim("w", 1)
        assert buf.worker.complete(lease, T.group(lease.prompt)) == "appended"
        with pytest.raises(BufferUnavailable, match="TLS"):  # a client that does not trust the CA
            Clients.connect(url, "tls", BufferConfig(connect_timeout_s=2.0))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)


def _make_certs(d):
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=test-ca")
    run("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "1", "-extfile", "san.ext")
    return d / "ca.crt", d / "server.crt", d / "server.key"
