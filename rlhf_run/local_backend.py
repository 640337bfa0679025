"""The one-machine backend (``launcher=local``, the default): the roles as child processes
(``python -m <module>`` with the resolved config, SIGKILLed when the launcher dies), a private
redis-server when no ``buffer.url`` is given and the weight server embedded in this process.
docs/architecture.md (The run app) describes the placement.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.openai_api import served_name
from rlhf_core.cli import WORKER_ID_ENV, die_with_parent, say_once_when_full, write_json
from rlhf_core.config import Config
from rlhf_run.supervisor import PIDS_FILE, REDIS_DIR, RESOLVED_CONFIG, Role, RoleExit, RoleKind

log = logging.getLogger(__name__)

MAX_RESTARTS = 5  # per worker
MODULES = {RoleKind.LEARNER: "learner", RoleKind.WORKER: "rollout_workers", RoleKind.GATEWAY: "gateway.cli",
           RoleKind.EVALUATOR: "rollout_workers.evaluator"}


@dataclass
class Child:
    """One role's process."""

    cmd: list[str]
    log_path: Path
    env: dict[str, str]
    proc: subprocess.Popen | None = None

    def start(self) -> subprocess.Popen:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logf = open(self.log_path, "ab")
        # SIGKILL when the launcher dies: no child trains on unsupervised; resume restarts them
        self.proc = proc = subprocess.Popen(self.cmd, stdout=logf, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True, preexec_fn=die_with_parent(signal.SIGKILL))
        logf.close()
        return proc

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def last_error(self) -> str:
        """The child's last ``error:`` line (what a user error prints), else its last log line."""
        lines = [line.strip() for line in self.tail(200).splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("error: ")]
        return (errors or lines or ["(no output)"])[-1]

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)  # the child and anything it started
            except ProcessLookupError:
                pass


@dataclass
class LocalBackend:
    """The roles as child processes of this one (see the module docstring)."""

    cfg: Config
    output_dir: Path
    redis: Any = None
    weight_server: Any = None
    max_restarts: int = MAX_RESTARTS
    restart_note: str = ""
    scales: bool = False  # the run keeps rollout.num_workers; more join by hand (rlhf-worker)
    runs_gateway: bool = True
    _weight_server_log: Any = None  # undoes own_log_file for the in-process weight server

    def start_infrastructure(self) -> None:
        cfg = self.cfg
        if cfg.buffer.url is None:
            from buffer.local_server import RedisServer

            workdir = self.output_dir / REDIS_DIR
            # everysec: at most one second of appends is at risk if the machine dies
            self.redis = RedisServer(workdir, fsync="everysec", die_with_parent=True).start()
            cfg.buffer.url = self.redis.url
            log.info("started private redis-server pid %d at %s (data in %s)", self.redis.pid, self.redis.url, workdir)
        if cfg.weight_server.address is None:
            from weight_server import WeightServer

            self._weight_server_log = own_log_file("weight_server", self.output_dir / "logs" / "weight-server.log")
            self.weight_server = WeightServer(cfg.weight_server)
            self.weight_server.start()
            cfg.weight_server.address = self.weight_server.address
            cfg.weight_server.pub_address = self.weight_server.pub_address
            log.info("weight server at %s (announcements %s)", self.weight_server.address, self.weight_server.pub_address)

    def child(self, role: Role) -> Child:
        """The role's process, with its command and environment (not started). Worker i gets
        ``rollout.devices[i % len]``; the evaluator runs on worker 0's."""
        cfg, out = self.cfg, self.output_dir.resolve()
        cmd = [sys.executable, "-m", MODULES[role.kind], "--config-path", str(out), "--config-name", RESOLVED_CONFIG,
               f"hydra.run.dir={out / 'logs' / role.name}", "hydra.output_subdir=null"]
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // max(1, cfg.rollout.num_workers + 1))))
        env["PYTHONUNBUFFERED"] = "1"
        devices = cfg.rollout.devices
        if role.kind == RoleKind.LEARNER and cfg.learner.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(int(d)) for d in cfg.learner.devices)
            if len(cfg.learner.devices) > 1:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc_per_node={len(cfg.learner.devices)}", *cmd[1:]]
        elif role.kind == RoleKind.WORKER:
            env[WORKER_ID_ENV] = role.name
            if devices is not None:
                env["CUDA_VISIBLE_DEVICES"] = str(int(devices[int(role.name.rsplit("-", 1)[1]) % len(devices)]))
        elif role.kind == RoleKind.EVALUATOR and devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(int(devices[0]))
        elif role.kind == RoleKind.GATEWAY:
            g = cfg.gateway
            log.info("gateway: %s (model '%s'; its address also in %s)",
                     f"http://{g.host}:{g.port}/v1" if g.port else "a free port", served_name(cfg),
                     self.output_dir / "gateway.json")
        return Child(cmd, role.log_path, env)

    def start(self, role: Role) -> None:
        role.handle = child = self.child(role)
        log.info("started %s (pid %d), log %s", role.name, child.start().pid, role.log_path)

    def poll(self, roles: list[Role]) -> list[RoleExit]:
        return [RoleExit(r, r.handle.proc.returncode, r.handle.last_error(), r.log_path) for r in roles
                if r.exit_code is None and r.handle.proc is not None and not r.handle.alive()]

    def infrastructure_lost(self) -> str:
        return ""  # Redis down: the progress thread sees it (and the supervisor says how to restart it)

    def restart(self, role: Role, ended: RoleExit) -> None:
        role.handle.start()

    def stop(self, role: Role) -> bool:
        role.handle.signal(signal.SIGTERM)
        return True

    def kill(self, role: Role) -> None:
        role.handle.signal(signal.SIGKILL)

    def check_fits(self, workers: int) -> None:
        """One machine runs what it is given (it does not scale: ``scales`` is False)."""

    def tail(self, ended: RoleExit) -> str:
        return ended.role.handle.tail()

    def write_pids(self, roles: list[Role]) -> None:
        """children.json: which processes belong to this run (what ``resume=`` checks, for operators and tests)."""
        pids = {"launcher": os.getpid(), **{r.name: r.handle.proc.pid for r in roles if r.handle.proc is not None}}
        if self.redis is not None:
            pids["redis"] = self.redis.pid
        write_json(self.output_dir / PIDS_FILE, pids)

    def stop_all(self, roles: list[Role], grace_s: float) -> None:
        for role in roles:
            role.handle.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for role in roles:
            child = role.handle
            while child.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if child.alive():
                log.warning("%s did not stop within %.0f s: killing it", role.name, grace_s)
                child.signal(signal.SIGKILL)
                child.proc.wait(timeout=10)
            if child.proc is not None and role.exit_code is None:
                role.exit_code = child.proc.returncode

    def running(self, roles: list[Role]) -> bool:
        return any(r.handle.alive() for r in roles)

    def shutdown(self) -> None:
        if self.weight_server is not None:
            self.weight_server.stop()
        if self._weight_server_log is not None:
            self._weight_server_log()
            self._weight_server_log = None
        if self.redis is not None:
            self.redis.stop()


def own_log_file(logger_name: str, path: Path) -> Callable[[], None]:
    """Send ``logger_name``'s records to ``path`` instead of the console, warnings and errors to
    both, as a child's go to its log. Returns the function that undoes it."""
    logger = logging.getLogger(logger_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    to_file = say_once_when_full(logging.FileHandler(path))
    to_file.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    warnings = logging.Handler(logging.WARNING)
    warnings.emit = lambda record: logging.getLogger().handle(record)  # type: ignore[method-assign]
    before = logger.propagate
    logger.addHandler(to_file)
    logger.addHandler(warnings)
    logger.propagate = False

    def undo() -> None:
        logger.removeHandler(to_file)
        logger.removeHandler(warnings)
        logger.propagate = before
        to_file.close()

    return undo
