"""Running a policy's programs: one execution in bubblewrap, its limits, a typed result, and a
bounded pool of executions beside the generation loop.

An execution (``sandbox.backend=bwrap``, the default) is::

    bwrap --unshare-all --unshare-user --disable-userns --cap-drop ALL --die-with-parent --new-session
          --ro-bind /usr /usr (and /bin, /lib, /lib64, /sbin as the host has them: links or read-only binds)
          --proc /proc --dev /dev --size <tmpfs_mb> --tmpfs /tmp --ro-bind-data <memfd> /src/main.py
          --chdir /tmp --clearenv --remount-ro /
          -- prlimit --cpu --as --nproc --fsize --nofile --core=0 -- <python> -I /src/main.py

so the program has no network (a namespace with only a loopback nobody listens on), its own PID
namespace (the worker and every other process are invisible; when the program's first process
exits, or the sandbox is killed, the kernel kills whatever it left behind), no capabilities, a
root holding only ``/usr`` (read-only), a fresh ``/proc``, ``/dev`` and a private ``/tmp`` of
``sandbox.tmpfs_mb``, and nothing of the worker's environment, files or folders: not the run's
``run_config.yaml`` (the Redis password, the weight server's key), not ``/proc/<worker>/environ``.
A worker running as root starts bwrap as ``sandbox.uid`` (nobody), so the program is an
unprivileged user outside too and ``RLIMIT_NPROC`` holds (the kernel exempts root from it).

The limits: CPU seconds per process (RLIMIT_CPU), address space per process (RLIMIT_AS),
processes and threads (RLIMIT_NPROC), file size (RLIMIT_FSIZE), open files, no core dumps, all
set by ``prlimit`` inside before the program starts, so nothing the program does (``ctypes``
calling ``setrlimit``) can raise them: raising a hard limit needs a capability it has not. The
worker enforces the wall clock (``sandbox.wall_s``) and the output (``sandbox.output_bytes``, stdout
and stderr together) and kills the sandbox past either. cgroups are not used: they need a
delegated hierarchy the worker cannot count on; the per-process limits times ``sandbox.processes``
bound what one execution can take.

``sandbox.backend=none`` runs the same command line without bwrap: the limits hold, the isolation
does not (the program runs as the worker's user, sees its files and the network). It is for code
the user trusts; ``rlhf-run`` warns at start.

:class:`Sandbox` is built once per worker and configuration (:func:`shared_sandbox`);
:meth:`Sandbox.run_all` runs executions ``sandbox.pool_size`` at a time on its own threads.
:meth:`Sandbox.check` runs a trivial program through the whole pipeline: where bwrap is missing or
cannot create its namespaces it raises one :class:`~rlhf_core.errors.ConfigError` line saying what
to install or enable (``rlhf-run`` calls it before anything starts).
"""

from __future__ import annotations

import logging
import os
import select
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import astuple, dataclass
from enum import StrEnum

from rlhf_core.choices import SandboxBackend
from rlhf_core.config import ConfigError
from rlhf_core.config.sandbox import SandboxConfig

log = logging.getLogger(__name__)

#: where the program's files are inside the sandbox (read-only)
SRC = "/src"
#: the host's top-level folders the interpreter may need besides /usr (a link to usr/... on merged-/usr systems)
_ROOT_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_MEMORY_SIGNS = ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory")
_READ = 65536
#: once the program has exited, how long what it wrote may take to arrive (its pipes close with its namespace)
_DRAIN_S = 1.0


class SandboxStatus(StrEnum):
    """How an execution ended."""

    ok = "ok"  # exited 0
    failed = "failed"  # exited with another code (an exception, a failed assert)
    timeout = "timeout"  # past sandbox.wall_s, or a process past sandbox.cpu_s of CPU
    memory = "memory"  # ran out of its address space (sandbox.memory_mb)
    output_limit = "output_limit"  # wrote more than sandbox.output_bytes
    crashed = "crashed"  # killed by a signal (a segfault, an abort, a kill of its own)
    error = "error"  # the sandbox itself failed to start: not the program's doing


@dataclass(frozen=True)
class SandboxResult:
    """One execution: how it ended, its exit code (None when the worker killed it; 128 + the
    signal when a signal ended it), what it wrote (decoded, cut at the output limit) and its
    wall-clock seconds."""

    status: SandboxStatus
    exit_code: int | None
    stdout: str
    stderr: str
    wall_s: float

    @property
    def reason(self) -> str:
        """One line: the status and what it means."""
        last = self.stderr.strip().splitlines()[-1][:200] if self.stderr.strip() else ""
        detail = {
            SandboxStatus.ok: "exited 0",
            SandboxStatus.failed: f"exited {self.exit_code}" + (f": {last}" if last else ""),
            SandboxStatus.timeout: (f"killed after {self.wall_s:.1f} s (sandbox.wall_s)" if self.exit_code is None
                                    else "a process used up its CPU time (sandbox.cpu_s)"),
            SandboxStatus.memory: f"out of memory: {last}",
            SandboxStatus.output_limit: "wrote more than the output limit",
            SandboxStatus.crashed: f"killed by signal {signal_name(_signal_of(self.exit_code))}",
            SandboxStatus.error: f"the sandbox failed: {last}",
        }[self.status]
        return f"{self.status.value}: {detail}"


def _signal_of(code: int | None) -> int:
    """The signal an exit code of 128 + n says ended the program (0: none)."""
    return code - 128 if code is not None and 128 < code < 128 + 65 else 0


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


class Sandbox:
    """Executions under one :class:`SandboxConfig` (see the module docstring)."""

    def __init__(self, cfg: SandboxConfig) -> None:
        cfg.check()
        self.cfg = cfg
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._checked = False
        self.bwrap = shutil.which("bwrap")  # found on the worker's PATH; run by this path
        prlimit = shutil.which("prlimit") or "/usr/bin/prlimit"
        mb = 1 << 20
        self._limits = [os.path.realpath(prlimit), f"--cpu={cfg.cpu_s}:{cfg.cpu_s + 1}", f"--as={cfg.memory_mb * mb}",
                        f"--nproc={cfg.processes}", f"--fsize={cfg.tmpfs_mb * mb}", "--nofile=64", "--core=0", "--"]

    @property
    def isolated(self) -> bool:
        return self.cfg.backend == SandboxBackend.bwrap

    # ------------------------------------------------------------------ one execution

    def run(self, program: str, stdin: str = "") -> SandboxResult:
        """Run ``program`` (Python source) with ``stdin``; never raises for anything the program does."""
        fd = os.memfd_create("program", 0)  # the source, read by bwrap (or the interpreter) through the descriptor
        try:
            os.write(fd, program.encode("utf-8", errors="surrogatepass"))
            os.lseek(fd, 0, os.SEEK_SET)
            if self.isolated:
                return self._execute(self._bwrap(fd), stdin, fd, cwd=None)
            with tempfile.TemporaryDirectory(prefix="rlhf-unsandboxed-") as cwd:
                return self._execute([*self._limits, self.cfg.python, "-I", f"/dev/fd/{fd}"], stdin, fd, cwd=cwd)
        finally:
            os.close(fd)

    def _bwrap(self, fd: int) -> list[str]:
        cfg = self.cfg
        argv = [self.bwrap or "bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--cap-drop", "ALL", "--die-with-parent",
                "--new-session", "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
        for path in _ROOT_DIRS:
            if os.path.islink(path):
                argv += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                argv += ["--ro-bind", path, path]
        for path in self._extra_paths():
            argv += ["--ro-bind", path, path]
        argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(cfg.tmpfs_mb << 20), "--tmpfs", "/tmp",
                 "--dir", SRC, "--ro-bind-data", str(fd), f"{SRC}/main.py", "--chdir", "/tmp", "--clearenv",
                 "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8",
                 "--remount-ro", "/", "--", *self._limits, cfg.python, "-I", f"{SRC}/main.py"]
        return argv

    def _extra_paths(self) -> list[str]:
        """``sandbox.ro_paths`` and the interpreter's folder when it lies outside what is bound."""
        bound = ("/usr/", *(p + "/" for p in _ROOT_DIRS))
        real = os.path.dirname(os.path.realpath(self.cfg.python)) + "/"
        extra = [] if real.startswith(bound) else [real.rstrip("/")]
        return [*extra, *(p for p in self.cfg.ro_paths if p not in extra)]

    def _execute(self, argv: list[str], stdin: str, fd: int, cwd: str | None) -> SandboxResult:
        cfg, t0 = self.cfg, time.monotonic()
        drop = os.geteuid() == 0 and self.isolated  # root runs bwrap as sandbox.uid
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}  # the worker's environment (its secrets) never reaches the program
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    pass_fds=(fd,), start_new_session=True, cwd=cwd, env=env, user=cfg.uid if drop else None,
                                    group=cfg.uid if drop else None, extra_groups=[] if drop else None)
        except OSError as exc:
            return SandboxResult(SandboxStatus.error, None, "", f"cannot start {argv[0]}: {exc}", 0.0)
        try:
            out, err, killed = _exchange(proc, stdin.encode("utf-8", errors="replace"), t0 + cfg.wall_s, cfg.output_bytes)
        finally:
            if proc.returncode is None:  # an exception above: nothing may outlive the call
                _kill(proc)
        wall = time.monotonic() - t0
        code = 128 - proc.returncode if proc.returncode < 0 else proc.returncode  # a signal as a shell (and bwrap) says it
        text_out, text_err = out.decode("utf-8", errors="replace"), err.decode("utf-8", errors="replace")
        status = killed or self._status(code, text_err)
        return SandboxResult(status, None if killed else code, text_out, text_err, wall)

    def _status(self, code: int, stderr: str) -> SandboxStatus:
        sig = _signal_of(code)
        if code == 0:
            return SandboxStatus.ok
        if sig == signal.SIGXCPU:
            return SandboxStatus.timeout
        tail = stderr[-2000:]
        if any(sign in tail for sign in _MEMORY_SIGNS):
            return SandboxStatus.memory
        if self.isolated and code == 1 and stderr.startswith("bwrap: "):
            return SandboxStatus.error
        return SandboxStatus.crashed if sig else SandboxStatus.failed

    # ------------------------------------------------------------------ many, and the start-up check

    def run_all(self, jobs: Sequence[tuple[str, str]]) -> list[SandboxResult]:
        """``[(program, stdin), ...]`` run ``sandbox.pool_size`` at a time; results in order."""
        if not jobs:
            return []
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.cfg.pool_size, thread_name_prefix="sandbox")
        return list(self._pool.map(lambda job: self.run(*job), jobs))

    def check(self) -> None:
        """Run ``print(1)`` through the whole pipeline once (per process and configuration);
        :class:`ConfigError` saying what to install or enable when it fails. With
        ``backend=none``, a warning instead: the policy's code runs unisolated."""
        if self._checked:
            return
        cfg = self.cfg
        if not self.isolated:
            log.warning("sandbox=none: the policy's programs run WITHOUT isolation, as this user (%s), able to read the "
                        "run's config and secrets and to reach the network; only the limits hold. Use the default "
                        "sandbox (bubblewrap) unless you trust the code", _user())
        elif self.bwrap is None:
            raise ConfigError("the sandbox needs bubblewrap (bwrap), which is not installed: apt-get install -y bubblewrap "
                              "(or dnf install bubblewrap); sandbox=none runs the policy's code without isolation")
        for need, what in ((cfg.python, "sandbox.python"), (self._limits[0], "prlimit (util-linux)")):
            if not os.access(need, os.X_OK):
                raise ConfigError(f"{what} {need!r} is not an executable file; install it or point sandbox.python at "
                                  "an interpreter (outside /usr: add its folder to sandbox.ro_paths)")
        result = self.run("print(1)")
        if result.status != SandboxStatus.ok or result.stdout.strip() != "1":
            raise ConfigError(_diagnosis(result, self.isolated))
        self._checked = True


def _user() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.geteuid()).pw_name
    except (ImportError, KeyError):
        return str(os.geteuid())


def _diagnosis(result: SandboxResult, isolated: bool) -> str:
    """The one line a failed start-up check says."""
    said = " ".join(result.stderr.split())[:300] or result.reason
    if isolated and any(s in said for s in ("namespace", "uid map", "Operation not permitted", "Permission denied")):
        return (f"bubblewrap cannot create its namespaces here ({said}): enable unprivileged user namespaces "
                "(sysctl -w kernel.unprivileged_userns_clone=1 user.max_user_namespaces=15000; in a container, "
                "start it with --security-opt seccomp=unconfined --security-opt apparmor=unconfined), or set "
                "sandbox=none to run the policy's code without isolation")
    return f"the sandbox cannot run a trivial program ({said}); fix what it says, or set sandbox=none (no isolation)"


def _exchange(proc: subprocess.Popen, stdin: bytes, deadline: float, cap: int) -> tuple[bytes, bytes, SandboxStatus | None]:
    """Feed stdin, collect stdout and stderr up to ``cap`` bytes together, until the process has
    exited (its pidfd) and its pipes are closed, or the deadline; then kills what is left and
    reaps it (``proc.returncode``). Returns what it wrote and the status of a kill (None: it
    ended by itself)."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    out_fd, err_fd, in_fd = proc.stdout.fileno(), proc.stderr.fileno(), proc.stdin.fileno()
    pidfd = os.pidfd_open(proc.pid)
    sel = selectors.DefaultSelector()
    chunks = {out_fd: bytearray(), err_fd: bytearray()}
    for fd in (out_fd, err_fd, pidfd):
        sel.register(fd, selectors.EVENT_READ)
    if stdin:
        sel.register(in_fd, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    sent, total, killed = 0, 0, None
    exited_at: float | None = None
    try:
        while sel.get_map() and killed is None:
            # once it has exited, what is left in its pipes may take a moment (never past the deadline)
            end = deadline if exited_at is None else min(deadline, exited_at + _DRAIN_S)
            left = end - time.monotonic()
            if left <= 0:
                killed = SandboxStatus.timeout if exited_at is None else None
                break
            for key, _ in sel.select(left):
                fd = key.fd
                if fd == pidfd:
                    sel.unregister(pidfd)
                    exited_at = time.monotonic()
                elif fd == in_fd:
                    try:
                        sent += os.write(fd, stdin[sent:sent + select.PIPE_BUF])
                    except OSError:  # it closed its stdin, or exited
                        sent = len(stdin)
                    if sent >= len(stdin):
                        sel.unregister(fd)
                        proc.stdin.close()
                else:
                    data = os.read(fd, _READ)
                    if not data:
                        sel.unregister(fd)
                        continue
                    chunks[fd] += data[:max(0, cap - total)]
                    total += len(data)
                    if total > cap:
                        killed = SandboxStatus.output_limit
                        break
    finally:
        sel.close()
        os.close(pidfd)
        _kill(proc)  # past a limit; or after its exit, whatever it left in its process group
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            stream.close()
    return bytes(chunks[out_fd]), bytes(chunks[err_fd]), killed


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the execution's process group (bwrap's first process: its namespace goes with it;
    after a clean exit, only what the program left in its group, the exited process being a zombie
    that holds the group until it is reaped), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


_shared: dict[tuple, Sandbox] = {}
_shared_lock = threading.Lock()


def shared_sandbox(cfg: SandboxConfig) -> Sandbox:
    """The process's :class:`Sandbox` for ``cfg`` (rewards and environments share its pool, so
    ``sandbox.pool_size`` bounds the executions of a worker, and the start-up check runs once)."""
    key = tuple(map(str, astuple(cfg)))
    with _shared_lock:
        if key not in _shared:
            _shared[key] = Sandbox(cfg)
        return _shared[key]
