"""Every ZeroMQ context the weight server's components make is closed, and closing never hangs:
not by ``close()``, not by a constructor that fails half-way, not by the garbage collector."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch
import zmq

from rlhf_core.config import ConfigError, WeightServerConfig
from weight_server import WeightPublisher, WeightServer, WeightSubscriber
from weight_server.sockets import Context

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

# Each component is made on a thread that then ends, inside an object that refers to itself, so
# only the cycle collector can free it: the collector runs the context's finalizer with the
# sockets still open.
LEFT_TO_THE_COLLECTOR = """
import gc, sys, threading, time
from rlhf_core.config import WeightServerConfig
from weight_server import WeightPublisher, WeightServer, WeightSubscriber

gc.disable()
cfg = WeightServerConfig()
server = WeightServer(cfg)  # never started nor stopped: its sockets stay open
makers = {
    "server": lambda: WeightServer(cfg),
    "subscriber": lambda: WeightSubscriber(server.address, server.pub_address, cfg),
    "publisher": lambda: WeightPublisher(server.address, cfg),
}
for name, make in makers.items():
    def leave():
        holder = {"component": make()}
        holder["self"] = holder
    t = threading.Thread(target=leave)
    t.start()
    t.join()
    t0 = time.monotonic()
    gc.collect()
    print(f"{name} collected in {time.monotonic() - t0:.2f} s", flush=True)
"""


def test_components_left_to_the_garbage_collector_do_not_hang_it(tmp_path):
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        proc = subprocess.Popen([sys.executable, "-c", LEFT_TO_THE_COLLECTOR], stdout=f, stderr=subprocess.STDOUT)
    try:
        assert proc.wait(120) == 0, out.read_text()[-3000:]
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"garbage collection hung (a context terminated before its sockets closed); after:\n{out.read_text()}")
    assert [line.split()[0] for line in out.read_text().splitlines()] == ["server", "subscriber", "publisher"]


def _terminates(ctx: zmq.Context, timeout_s: float = 5.0) -> bool:
    """Whether ``ctx.term()`` returns in time, i.e. every socket made from ``ctx`` was closed."""
    term = threading.Thread(target=ctx.term, daemon=True)
    term.start()
    term.join(timeout_s)
    return not term.is_alive()


def test_close_leaves_no_socket_open_and_no_thread_running():
    ctx = zmq.Context()  # a plain one: it closes nothing by itself
    cfg = WeightServerConfig()
    srv = WeightServer(cfg, ctx=ctx).start()
    with WeightPublisher(srv.address, cfg, ctx=ctx) as pub, \
            WeightSubscriber(srv.address, srv.pub_address, cfg, ctx=ctx) as sub:
        pub.publish(1, {"w": torch.ones(4)})
        assert sub.pull()[0] == 1
    srv.stop()
    assert not srv._thread.is_alive()
    assert _terminates(ctx), "a socket was left open"


@pytest.mark.parametrize("component", ["server", "subscriber", "publisher"])
def test_a_constructor_that_fails_half_way_closes_the_sockets_it_made(component, tmp_path):
    ctx = zmq.Context()
    (tmp_path / "file").write_text("")
    if component == "server":  # fails after binding: the address file's folder cannot be made
        with pytest.raises(OSError):
            WeightServer(WeightServerConfig(address_file=str(tmp_path / "file" / "ws.json")), ctx=ctx)
    else:  # fails after making its first socket: CURVE without the client's keys
        cfg = WeightServerConfig(auth="curve")
        make = {"subscriber": lambda: WeightSubscriber("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", cfg, ctx=ctx),
                "publisher": lambda: WeightPublisher("tcp://127.0.0.1:1", cfg, ctx=ctx)}[component]
        with pytest.raises(ConfigError, match="curve_server_public"):
            make()
    assert _terminates(ctx), "a socket was left open"


def test_context_close_closes_its_sockets_and_waits_a_bounded_time_for_others(caplog):
    ctx = Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect("tcp://127.0.0.1:1")
    monitor = sock.get_monitor_socket()  # made by pyzmq through ctx.socket
    assert ctx.close() and ctx.closed and sock.closed and monitor.closed

    ctx = Context()
    behind_its_back = zmq.Socket(ctx, zmq.DEALER)
    t0 = time.monotonic()
    assert ctx.close(timeout_s=0.5) is False
    assert 0.5 <= time.monotonic() - t0 < 5 and "did not terminate within 0.5 s" in caplog.text
    behind_its_back.close()
