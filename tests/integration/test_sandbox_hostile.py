"""Hostile programs in the sandbox, each scored by reward=code_tests as a policy's response would
be: contained (reward 0 with its reason), the worker (this process) unharmed, nothing left
running, within the limits. Skipped, saying why, where bubblewrap is missing or cannot start."""

from __future__ import annotations

import os
import socket
import time

import pytest

from rollout_workers.code_reward import CodeTests
from rollout_workers.sandbox import SandboxStatus
from sandbox_helpers import LIMITS, left_behind, working_sandbox

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SECRET = "hunter2-redis-password"


@pytest.fixture(scope="module")
def sandbox():
    return working_sandbox()


@pytest.fixture(scope="module")
def reward(sandbox):
    return CodeTests(sandbox=LIMITS)


def contained(reward, program: str, reason: str, expected: str = "a value it never prints") -> None:
    """The program, as a response with one stdin/stdout test, scores 0 for ``reason``, within its
    limits, and leaves nothing running."""
    before, t0, since = reward.counters(), time.monotonic(), time.time()
    (score,) = reward([f"```python\n{program}\n```"], tests=[[{"input": "", "output": expected}]])
    took = time.monotonic() - t0
    counted = {k: v - before.get(k, 0) for k, v in reward.counters().items() if v != before.get(k, 0)}
    assert score == 0.0
    assert counted == {reason: 1}
    assert took < LIMITS["wall_s"] + 10  # the wall clock, and the kill and reaping after it on a loaded machine
    assert left_behind(since) == []


def test_a_fork_bomb_is_held_to_its_processes_and_killed_whole(reward, sandbox):
    contained(reward, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", "timeout")
    # how far it gets: forks fail once the sandbox holds sandbox.processes processes
    counted = sandbox.run("import os\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            import time\n"
                          "            time.sleep(30)\n        n += 1\nexcept OSError as exc:\n    print(n, exc.errno)")
    n, errno = counted.stdout.split()
    assert int(n) < LIMITS["processes"] and int(errno) == 11  # EAGAIN: RLIMIT_NPROC


def test_an_infinite_loop_is_stopped_by_its_cpu_or_wall_limit(reward):
    contained(reward, "while True:\n    pass", "timeout")


def test_allocating_10_gb_fails_inside(reward, sandbox):
    contained(reward, "x = bytearray(10 * 2**30)\nprint('got it')", "memory")
    grown = sandbox.run("chunks = []\nwhile True:\n    chunks.append(bytearray(2**24))")  # 16 MiB at a time, touched
    assert grown.status == SandboxStatus.memory


def test_writing_outside_its_tmpfs_fails_and_the_tmpfs_is_bounded(reward, sandbox, tmp_path):
    host_file = tmp_path / "outside.txt"
    program = f"""
import os
wrote = []
for path in ["/usr/evil", "/evil", "/src/main.py", "/etc/passwd", {str(host_file)!r}, "/proc/sys/kernel/hostname"]:
    try:
        with open(path, "w") as f:
            f.write("x")
        wrote.append(path)
    except OSError:
        pass
print(wrote)
"""
    contained(reward, program, "wrong_output", expected="['/usr/evil']")
    assert sandbox.run(program).stdout.strip() == "[]"
    assert not host_file.exists()
    # /tmp is writable, up to sandbox.tmpfs_mb (a file of 64 MiB fails at 16)
    filled = sandbox.run("f = open('/tmp/big', 'wb')\ntry:\n    f.write(b'x' * (64 << 20))\n    f.flush()\n"
                         "    print('wrote it all')\nexcept OSError as exc:\n    print('refused', exc.errno)")
    assert filled.stdout.startswith("refused") or filled.status == SandboxStatus.crashed  # ENOSPC/EFBIG, or SIGXFSZ
    assert sandbox.run("open('/tmp/a', 'w').write('ok')\nprint(open('/tmp/a').read())").stdout == "ok\n"


def test_the_runs_secrets_cannot_be_read(reward, sandbox, tmp_path, monkeypatch):
    run_config = tmp_path / "run_config.yaml"
    run_config.write_text(f"buffer:\n  url: redis://:{SECRET}@127.0.0.1:6379\n")
    run_config.chmod(0o644)  # readable by anyone on the host: only the sandbox's view hides it
    monkeypatch.setenv("RLHF_TEST_SECRET", SECRET)  # in this process's /proc/<pid>/environ
    program = f"""
import os
found = []
for path in [{str(run_config)!r}, "/proc/{os.getpid()}/environ", "/proc/1/environ", "/proc/self/environ"]:
    try:
        text = open(path, "rb").read().decode(errors="replace")
        if {SECRET!r} in text:
            found.append(path)
    except OSError:
        pass
print(found, dict(os.environ))
"""
    contained(reward, program, "wrong_output", expected=SECRET)
    out = sandbox.run(program).stdout
    assert out.startswith("[] ") and SECRET not in out


def test_the_runs_ports_cannot_be_reached(reward, sandbox):
    listeners = []
    for host in ("127.0.0.1", "0.0.0.0"):  # Redis on loopback, the weight server on every interface
        s = socket.socket()
        s.bind((host, 0))
        s.listen()
        s.setblocking(False)
        listeners.append(s)
    ports = [s.getsockname()[1] for s in listeners]
    hosts = ["127.0.0.1", socket.gethostbyname(socket.gethostname())]
    try:
        program = f"""
import socket
reached = []
for host in {hosts!r}:
    for port in {ports!r}:
        try:
            socket.create_connection((host, port), timeout=2).close()
            reached.append((host, port))
        except OSError:
            pass
print(reached)
"""
        contained(reward, program, "wrong_output", expected="connected")
        assert sandbox.run(program).stdout.strip() == "[]"
        for s in listeners:  # nothing ever knocked
            with pytest.raises(BlockingIOError):
                s.accept()
    finally:
        for s in listeners:
            s.close()


def test_a_gigabyte_on_stdout_is_cut_at_the_output_limit(reward, sandbox):
    program = "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(chunk)"
    contained(reward, program, "output_limit")
    flood = sandbox.run(program)
    assert flood.status == SandboxStatus.output_limit and len(flood.stdout) <= LIMITS["output_bytes"]


def test_killing_its_parent_or_the_worker_hurts_neither(reward, sandbox):
    program = f"""
import os, signal
for pid in (os.getppid(), 1, {os.getpid()}, -1):
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
print("still here")
"""
    contained(reward, program, "wrong_output")
    assert os.getpid() > 0 and sandbox.run("print('the sandbox still works')").status == SandboxStatus.ok


def test_a_background_process_does_not_outlive_its_program(reward, sandbox):
    program = """
import os, subprocess
subprocess.Popen(["/usr/bin/sleep", "4242"], start_new_session=True, stdin=subprocess.DEVNULL,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)
if os.fork() == 0:  # and a double fork, the classic daemon
    os.setsid()
    if os.fork() == 0:
        os.execv("/usr/bin/sleep", ["sleep", "4243"])
    os._exit(0)
print("left them running")
"""
    contained(reward, program, "wrong_output")
    import psutil

    assert not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] and p.info["cmdline"][-1] in ("4242", "4243")]


def test_ctypes_cannot_lift_the_limits_or_escape(reward, sandbox):
    program = """
import ctypes, ctypes.util, os, resource
libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
class RLimit(ctypes.Structure):
    _fields_ = [("cur", ctypes.c_ulong), ("max", ctypes.c_ulong)]
done = []
for name, res in (("nproc", resource.RLIMIT_NPROC), ("as", resource.RLIMIT_AS), ("cpu", resource.RLIMIT_CPU)):
    if libc.setrlimit(res, ctypes.byref(RLimit(2**63, 2**63))) == 0:
        done.append(name)
if libc.setuid(0) == 0:
    done.append("setuid")
if libc.unshare(0x10000000) == 0:  # CLONE_NEWUSER: a namespace of its own to be root in
    done.append("unshare")
if libc.prctl(38, 0, 0, 0, 0) == 0 and libc.setgid(0) == 0:  # PR_SET_NO_NEW_PRIVS, then root's group
    done.append("setgid")
print(done)
x = bytearray(1 << 30)  # still held to sandbox.memory_mb
print("allocated")
"""
    contained(reward, program, "memory")
    out = sandbox.run(program)
    assert out.stdout.strip() == "[]" and out.status == SandboxStatus.memory
