"""Helpers of the sandbox tests: a sandbox that works here (or a clean skip saying what is
missing), and the checks that an execution left nothing behind."""

from __future__ import annotations

import os
import shutil
import time

import psutil
import pytest

from rlhf_core.config import ConfigError
from rlhf_core.config.sandbox import SandboxConfig
from rollout_workers.sandbox import Sandbox

#: the limits of the tests: small, so a hostile program hits them fast, and a wall clock that a
#: loaded 2-core machine still starts Python within
LIMITS = {"wall_s": 10.0, "cpu_s": 1, "memory_mb": 256, "processes": 8, "output_bytes": 1 << 20, "tmpfs_mb": 16, "pool_size": 2}


def working_sandbox(**overrides) -> Sandbox:
    """A bubblewrap sandbox with :data:`LIMITS`; skips the test where bwrap is missing or cannot
    start, with the reason (./quickstart.sh installs bubblewrap when run as root)."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed: apt-get install -y bubblewrap (./quickstart.sh installs it as root)")
    sandbox = Sandbox(SandboxConfig.of({**LIMITS, **overrides}))
    try:
        sandbox.check()
    except ConfigError as exc:
        pytest.skip(f"the sandbox cannot start on this machine: {exc}")
    return sandbox


def left_behind(since: float, uid: int = SandboxConfig().uid) -> list[str]:
    """Processes an execution may have left: this process's children, and (as root) processes of
    the sandbox's user started since ``since``. Waits up to 5 s for the kernel to reap a killed
    namespace's processes."""
    deadline = time.monotonic() + 5.0
    while True:
        found = [f"child {p.pid} {p.name()}" for p in psutil.Process().children(recursive=True) if _alive(p)]
        if os.geteuid() == 0:
            for p in psutil.process_iter(["uids", "create_time", "name"]):
                if p.info["uids"] and p.info["uids"].real == uid and p.info["create_time"] >= since - 1 and _alive(p):
                    found.append(f"{p.pid} {p.info['name']} (uid {uid})")
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
