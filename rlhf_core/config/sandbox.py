"""``sandbox``: where a policy's programs run (the ``code_tests`` reward, the ``PythonTool``
environment) and the limits each execution runs under (``rollout_workers/sandbox.py``).

``rlhf-run sandbox=none`` runs them as plain child processes of the worker, with the same
limits but no isolation (warned at start); the default, ``bwrap``, runs each in bubblewrap.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from rlhf_core.choices import SandboxBackend
from rlhf_core.errors import ConfigError


@dataclass
class SandboxConfig:
    # bwrap: bubblewrap namespaces (no network, its own PIDs, a read-only minimal root, a private
    # tmpfs); none: a child process of the worker with the limits below and nothing else
    backend: SandboxBackend = SandboxBackend.bwrap
    python: str = "/usr/bin/python3"  # the interpreter programs run with (its folder is bound read-only)
    cpu_s: int = 2  # CPU seconds per process (RLIMIT_CPU: SIGXCPU, SIGKILL a second later)
    wall_s: float = 5.0  # wall-clock seconds per execution; the whole sandbox is killed past it
    memory_mb: int = 512  # address space per process (RLIMIT_AS)
    processes: int = 16  # processes and threads inside (RLIMIT_NPROC)
    output_bytes: int = 1 << 20  # stdout + stderr together; the sandbox is killed past it
    tmpfs_mb: int = 64  # the private /tmp, the only writable place (each file also <= this: RLIMIT_FSIZE)
    pool_size: int = 4  # executions at once per worker (a bounded pool beside the generation loop)
    ro_paths: list[str] = field(default_factory=list)  # more host folders bound read-only where they are
    uid: int = 65534  # a worker running as root runs bwrap as this user (nobody), so RLIMIT_NPROC holds

    def check(self) -> None:
        """Every limit positive and finite."""
        ints = {"cpu_s": self.cpu_s, "memory_mb": self.memory_mb, "processes": self.processes,
                "output_bytes": self.output_bytes, "tmpfs_mb": self.tmpfs_mb, "pool_size": self.pool_size}
        bad = [f"sandbox.{k}={v}" for k, v in ints.items() if v < 1]
        if not 0 < self.wall_s < math.inf:
            bad.append(f"sandbox.wall_s={self.wall_s}")
        if bad:
            raise ConfigError(f"{', '.join(bad)}: every sandbox limit must be a positive number (they bound what a "
                              "policy's program may use; sandbox=none turns off the isolation, not the limits)")
        if not self.python.startswith("/"):
            raise ConfigError(f"sandbox.python={self.python!r} must be an absolute path (the sandbox has no PATH of the "
                              "worker's), e.g. /usr/bin/python3")

    @classmethod
    def of(cls, value: Any) -> SandboxConfig:
        """The settings a reward or environment node passes as ``sandbox`` (``${sandbox}`` in
        ``conf/``: a SandboxConfig, or a mapping of its fields; None: the defaults)."""
        if isinstance(value, SandboxConfig):
            return value
        if value is None:
            return cls()
        if not isinstance(value, Mapping):
            raise ConfigError(f"sandbox settings must be a mapping of sandbox.* keys (write sandbox: ${{sandbox}}), "
                              f"got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(map(str, value)) - known)
        if unknown:
            raise ConfigError(f"{', '.join(unknown)} is no sandbox setting; the settings are {', '.join(sorted(known))}")
        cfg = cls(**{str(k): v for k, v in value.items()})
        try:
            cfg.backend = SandboxBackend(cfg.backend)
        except ValueError:
            raise ConfigError(f"sandbox.backend={cfg.backend!r} is not one of "
                              f"{', '.join(b.value for b in SandboxBackend)}") from None
        cfg.check()
        return cfg
