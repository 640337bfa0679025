"""One run from start to exit code over a :class:`Backend` that places and watches its roles:
child processes on this machine (:mod:`rlhf_run.local_backend`) or Ray actors
(:mod:`rlhf_run.ray_backend`). The supervisor decides, the backend does (docs/architecture.md,
The run app). Supervision never waits on Redis, so a Redis outage cannot stop it restarting roles.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import threading
import time
import uuid
from contextlib import closing
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from omegaconf import OmegaConf

from buffer.connection import BufferDiskError, redact
from buffer.datasets import data_path
from gateway.openai_api import served_name
from rlhf_core.config import Config, ConfigError
from rlhf_core.errors import STOPPED_EARLY_EXIT, UserError, free_space
from rlhf_core.model_paths import pin_model_paths, pin_reward_model_paths
from rlhf_run.progress import Progress
from rlhf_run.summary import write_report
from rollout_workers.user_code import check_reward_targets, import_env_target

log = logging.getLogger(__name__)

RESOLVED_CONFIG = "run_config"
#: the run's config as given (run id filled in, addresses of a private Redis and weight server
#: not): what ``resume=`` starts from
LAUNCH_CONFIG = "launch_config.yaml"
REDIS_DIR = "redis"  # the private redis-server's data, inside the output folder
PIDS_FILE = "children.json"
REDIS_DOWN_HINT_S = 10.0  # Redis unreachable this long: print how to restart it on the same data


class RoleKind(StrEnum):
    LEARNER = "learner"
    WORKER = "worker"
    EVALUATOR = "evaluator"
    GATEWAY = "gateway"


@dataclass
class Role:
    """One role of the run as the supervisor sees it; ``handle`` is the backend's (a child
    process, the Ray actors of the learner's ranks)."""

    name: str
    kind: RoleKind
    log_path: Path
    restarts: int = 0
    exit_code: int | None = None  # set once it ended for good
    retiring_since: float | None = None  # scaled down: asked to leave at this time.monotonic()
    handle: Any = None


@dataclass(frozen=True)
class RoleExit:
    """A role that ended, as its backend saw it."""

    role: Role
    code: int
    error: str  # its error line, quoted when the run fails on it
    log_path: Path  # the log of what ended (a learner rank's own)
    note: str = ""  # what the backend knows beside the log, said in the exit's log line
    lost: bool = False  # its process or node was lost: nothing released its leases


class Backend(Protocol):
    """Where the roles run and how they are watched: the mechanics, none of the decisions. No call
    waits on Redis, and only ``stop_all`` waits on the roles."""

    redis: Any  # the private redis-server (workdir, restart_command()); None with buffer.url
    weight_server: Any  # the run's weight server (metrics()); None with weight_server.address
    max_restarts: int  # how often a worker (the evaluator, the gateway) is restarted
    restart_note: str  # what the log line of a worker's restart says after its count
    scales: bool  # it follows the run's worker target (rlhf-monitor workers=N)
    runs_gateway: bool  # the gateway is one of its roles (else it is started by hand)

    def start_infrastructure(self) -> None: ...  # Redis and the weight server where the config names none
    def start(self, role: Role) -> None: ...
    def poll(self, roles: list[Role]) -> list[RoleExit]: ...  # what ended since the last poll, one exit a role
    def infrastructure_lost(self) -> str: ...  # why Redis or the weight server is gone; "" while they answer
    def restart(self, role: Role, ended: RoleExit) -> None: ...
    def stop(self, role: Role) -> bool: ...  # SIGTERM (it drains); False: it never ran, nothing to drain
    def kill(self, role: Role) -> None: ...
    def check_fits(self, workers: int) -> None: ...  # a ConfigError naming what that many workers lack
    def tail(self, ended: RoleExit) -> str: ...
    def write_pids(self, roles: list[Role]) -> None: ...
    def stop_all(self, roles: list[Role], grace_s: float) -> None: ...  # SIGTERM, SIGKILL after grace_s
    def running(self, roles: list[Role]) -> bool: ...
    def shutdown(self) -> None: ...  # the weight server and the private Redis stopped (its data stays)


@dataclass
class Supervisor:
    """Owns one run; ``run()`` returns the process exit code."""

    cfg: Config
    output_dir: Path
    backend: Backend
    roles: list[Role] = field(default_factory=list)
    worker_target: int = 0
    exit_reason: str = ""
    failure: str = ""  # set when a role or the infrastructure failed in a way that fails the run
    _redis_hint_given: bool = False
    _expiring: list[threading.Thread] = field(default_factory=list)

    def run(self) -> int:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        interrupted: list[int] = []

        def on_signal(signum: int, _frame: Any) -> None:
            interrupted.append(signum)

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        code = 1
        try:
            check_before_start(self.cfg)
            save_launch_config(self.cfg, self.output_dir)
            self.cfg.run.output_dir = str(self.output_dir)
            if self.cfg.buffer.url is None and (self.output_dir / REDIS_DIR).is_dir():
                log.info("continuing on the run's Redis data in %s", self.output_dir / REDIS_DIR)
            self.backend.start_infrastructure()
            write_resolved_config(self.cfg, self.output_dir)
            self.start_roles()
            progress = Progress(self.cfg, self.output_dir, self.backend.weight_server).start()
            url = self.cfg.buffer.url or ""  # the backend's Redis, or the user's
            shown = redact(url)
            where = f"; the password is buffer.url in {RESOLVED_CONFIG}.yaml" if shown != url else ""
            print(f"run {self.cfg.buffer.run_id}: output in {self.output_dir}  "
                  f"(monitor: rlhf-monitor url={shown} run_id={self.cfg.buffer.run_id}{where})", flush=True)
            while not interrupted and self.supervise_once() and not self.check_progress(progress):
                time.sleep(0.5)
            if interrupted:
                self.exit_reason = f"interrupted by signal {interrupted[0]}"
                log.info("%s: stopping children", self.exit_reason)
            self.backend.stop_all(self.roles, self.cfg.rollout.shutdown_grace_s + 20)
            progress.close()
            print(write_report(self.cfg, self.output_dir, progress, self.exit_reason), flush=True)
            if interrupted:
                code = 130
            elif self.failure:
                print(f"run failed: {self.failure}", file=sys.stderr, flush=True)
            else:
                code = 0 if self.roles[0].exit_code == 0 else 1  # roles[0]: the learner
            return code
        finally:
            if self.backend.running(self.roles):
                self.backend.stop_all(self.roles, 5)
            self.shutdown(clean=code == 0)
            for s, h in old.items():
                signal.signal(s, h)

    # ------------------------------------------------------------------ start

    def start_roles(self) -> None:
        """The learner, ``rollout.num_workers`` workers, the gateway (``gateway.enabled``, where the
        backend runs it) and the evaluator (``eval.every`` > 0)."""
        cfg, logs = self.cfg, self.output_dir / "logs"
        self.add(Role("learner", RoleKind.LEARNER, logs / "learner.log"))
        for i in range(cfg.rollout.num_workers):
            self.add_worker(i)
        if cfg.gateway.enabled and self.backend.runs_gateway:  # the workers serve its calls
            self.add(Role("gateway", RoleKind.GATEWAY, logs / "gateway.log"))
        if cfg.eval.every:
            self.add(Role("evaluator", RoleKind.EVALUATOR, logs / "evaluator.log"))
        self.worker_target = cfg.rollout.num_workers
        if self.backend.scales:  # the target the run starts with, where `rlhf-monitor workers=N` changes it
            from buffer import MonitorClient

            with closing(MonitorClient.connect(cfg.buffer.url, cfg.buffer.run_id, cfg.buffer)) as buf:
                buf.set_worker_target(self.worker_target)
        self.backend.write_pids(self.roles)

    def add(self, role: Role) -> None:
        self.roles.append(role)
        self.backend.start(role)

    def add_worker(self, i: int) -> None:
        self.add(Role(f"worker-{i}", RoleKind.WORKER, self.output_dir / "logs" / f"worker-{i}.log"))

    # ------------------------------------------------------------------ supervise

    def supervise_once(self) -> bool:
        """Check the roles and the infrastructure once; False when the run is over."""
        lost = self.backend.infrastructure_lost()
        if lost:
            self.failure = self.exit_reason = lost
            return False
        for ended in self.backend.poll(self.roles):
            if not (self.on_learner_exit(ended) if ended.role.kind == RoleKind.LEARNER else self.on_exit(ended)):
                return False
        self.end_retired()
        return True

    def on_learner_exit(self, ended: RoleExit) -> bool:
        """Exit codes decide: 0 ends the run, 2 (a ``UserError``) fails it, any other restarts it from
        its checkpoint, up to ``run.learner_restarts``."""
        learner, code = ended.role, ended.code
        if code != 0:
            how = "was stopped by a signal" if code == STOPPED_EARLY_EXIT else "crashed"
            log.error("learner %s (exit %d%s); last lines of %s:\n%s", how, code, f": {ended.note}" if ended.note else "",
                      ended.log_path, self.backend.tail(ended))
        if code not in (0, UserError.exit_code) and learner.restarts < self.cfg.run.learner_restarts:
            learner.restarts += 1
            log.info("restarting the learner from its last checkpoint (restart %d of %d)", learner.restarts,
                     self.cfg.run.learner_restarts)
            try:
                self.backend.restart(learner, ended)
            except UserError as exc:
                self.failure = self.exit_reason = f"the learner could not be restarted: {exc}"
                return False
            self.backend.write_pids(self.roles)
            return True
        learner.exit_code = code
        if code == 0:
            self.exit_reason = "learner finished"
        else:
            self.failure = self.exit_reason = f"learner exited with code {code}: {ended.error}"
        return False

    def on_exit(self, ended: RoleExit) -> bool:
        """A worker, the evaluator or the gateway ended: retired, a user error, restarted, or gone."""
        role, code = ended.role, ended.code
        if role.retiring_since is not None:
            self.drop(role)  # before the line that says so: the pids files no longer list it once it is read
            log.info("%s left (scaled down; exit %d)", role.name, code)
            return True
        if role.kind == RoleKind.WORKER and ended.lost:  # nothing heartbeats its leases now
            self.expire_leases(role.name)
        log.error("%s exited with code %d%s; last lines of %s:\n%s", role.name, code, f" ({ended.note})" if ended.note
                  else "", ended.log_path, self.backend.tail(ended))
        if code == UserError.exit_code:  # a config, data or state error: a restart would only repeat it
            role.exit_code = code
            self.failure = self.exit_reason = f"{role.name} stopped: {ended.error}"
            return False
        if self.cfg.rollout.restart_on_crash and role.restarts < self.backend.max_restarts:
            role.restarts += 1
            log.info("restarting %s (restart %d%s)", role.name, role.restarts, self.backend.restart_note)
            self.backend.restart(role, ended)
            self.backend.write_pids(self.roles)
            return True
        role.exit_code = code
        self.backend.kill(role)
        if role.kind == RoleKind.WORKER and not any(r.kind == RoleKind.WORKER and r.exit_code is None for r in self.roles):
            self.failure = self.exit_reason = f"no worker left: {role.name} exited with code {code} ({ended.error})"
            return False
        return True

    def expire_leases(self, name: str) -> None:
        """``name``'s process or node was lost: the other workers take its leases over now
        (:meth:`buffer.MonitorClient.expire_leases`) instead of after ``buffer.lease_timeout_s``; on a
        thread, as supervision never waits on Redis."""
        from buffer import MonitorClient

        def expire() -> None:
            try:
                with closing(MonitorClient.connect(self.cfg.buffer.url, self.cfg.buffer.run_id, self.cfg.buffer)) as buf:
                    n = buf.expire_leases(name)
            except Exception as exc:  # then they come back after the lease timeout, as any dead worker's
                log.warning("%s's leases could not be expired (%s): they come back after buffer.lease_timeout_s",
                            name, first_line(exc))
                return
            log.info("%s's %d lease(s) expired: the other workers take them over now", name, n)

        self._expiring = [t for t in self._expiring if t.is_alive()]
        self._expiring.append(threading.Thread(target=expire, name=f"expire-{name}", daemon=True))
        self._expiring[-1].start()

    def check_progress(self, progress: Any) -> bool:
        """True when the run must end on what the progress thread met; says how to bring back the
        run's Redis when it stays unreachable; follows the worker target."""
        redis = self.backend.redis
        if progress.error is not None:
            self.failure = self.exit_reason = str(progress.error)
            if isinstance(progress.error, BufferDiskError) and redis is not None:  # its data is this run's
                self.failure = self.exit_reason = f"{progress.error} ({redis.workdir}: {free_space(redis.workdir)})"
            log.error("%s", self.failure)
            return True
        since = progress.unreachable_since
        if since is not None and redis is not None and time.time() - since > REDIS_DOWN_HINT_S \
                and not self._redis_hint_given:
            self._redis_hint_given = True
            log.error("Redis of this run has been unreachable for %.0f s. It keeps the run's state in its append-only "
                      "file; restart it on the same data with:\n  %s", time.time() - since, redis.restart_command())
        target = ((progress.latest or {}).get("control") or {}).get("workers")
        if self.backend.scales and target is not None and int(target) != self.worker_target:
            self.scale_to(int(target))
        return False

    # ------------------------------------------------------------------ scale

    def scale_to(self, target: int) -> None:
        """Add workers (the backend places them) or retire the newest (SIGTERM: they drain and leave)."""
        active = sorted((r for r in self.roles if r.kind == RoleKind.WORKER and r.retiring_since is None
                         and r.exit_code is None), key=_index)
        log.info("scaling the workers from %d to %d (the run's worker target changed)", len(active), target)
        self.worker_target = target
        if target > len(active):
            try:
                self.backend.check_fits(target)
            except ConfigError as exc:
                log.error("rlhf-monitor workers=%d is refused, the run keeps its %d: %s", target, len(active), exc)
                return
            used = {_index(r) for r in self.roles if r.kind == RoleKind.WORKER}
            for _ in range(target - len(active)):
                i = next(i for i in range(len(used) + 1) if i not in used)
                used.add(i)
                self.add_worker(i)
        for role in active[target:]:
            role.retiring_since = time.monotonic()
            if not self.backend.stop(role):  # never placed: nothing to drain
                self.drop(role)
        self.backend.write_pids(self.roles)

    def end_retired(self) -> None:
        grace = self.cfg.rollout.shutdown_grace_s + 20
        for role in [r for r in self.roles if r.retiring_since is not None and time.monotonic() - r.retiring_since > grace]:
            log.warning("%s did not leave within %.0f s: killing it", role.name, grace)
            self.drop(role)

    def drop(self, role: Role) -> None:
        self.backend.kill(role)
        self.roles.remove(role)
        self.backend.write_pids(self.roles)

    # ------------------------------------------------------------------ stop

    def shutdown(self, clean: bool) -> None:
        """Let go of the backend. A private Redis's data goes when the run finished cleanly
        (``clean``); otherwise it stays for ``resume=``."""
        for t in self._expiring:  # before Redis stops; one waiting on an unreachable Redis is left behind
            t.join(timeout=5)
        for role in self.roles:
            self.backend.kill(role)
        redis = self.backend.redis
        self.backend.shutdown()
        if redis is None:
            return
        if clean:
            shutil.rmtree(redis.workdir, ignore_errors=True)
        else:  # after `run failed: ...`, if it failed
            what = "fix what the error above says, then continue" if self.failure else "continue"
            print(f"the run's Redis data is kept in {redis.workdir}; {what} the run with:\n"
                  f"  rlhf-run resume={self.output_dir}", file=sys.stderr, flush=True)


def check_before_start(cfg: Config) -> None:
    """What would fail a role after it started fails the run before anything starts: reward
    targets, the environment, data files, LoRA targets, a teacher that does not fit the student.
    Hub ids are pinned to their folders."""
    check_reward_targets(cfg.reward)
    import_env_target(cfg.rollout)
    for name, data in (("data", cfg.data), ("eval.data", cfg.eval.data if cfg.eval.every else None)):
        if data is not None and data.source not in ("builtin", "none"):
            data_path(data, name)  # a missing file: here, not in the learner's log once it has started
    pin_paths(cfg)
    if cfg.model.lora.r:
        from rlhf_core.models import check_lora  # torch and transformers: only when there is something to check

        check_lora(cfg.model)  # LoRA targets on a weightless copy of the model: a typo stops here
    if cfg.distill.enabled:
        from rlhf_core.models import check_teacher

        cfg.distill.teacher.path = str(check_teacher(cfg).absolute())  # its files against the student's; a Hub id pinned


def pin_paths(cfg: Config) -> None:
    """Hub ids become their cached snapshot folders: one download at most, the same files everywhere.
    The gateway's model id is named first, from the path as given."""
    if cfg.gateway.enabled:
        cfg.gateway.model_name = served_name(cfg)
    cfg.model = pin_model_paths(cfg.model)
    pin_reward_model_paths(cfg.reward.models)


def save_launch_config(cfg: Config, output_dir: Path) -> None:
    """Fix the run id and keep the config as given, before addresses are filled in: what
    ``resume=`` starts from."""
    if cfg.buffer.run_id in ("", "auto"):
        cfg.buffer.run_id = time.strftime("run-%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:4]
    write_private(output_dir / LAUNCH_CONFIG, OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    hydra_dir = output_dir / ".hydra"  # Hydra's copy of the config and the command line's overrides
    if hydra_dir.is_dir():
        hydra_dir.chmod(0o700)


def write_resolved_config(cfg: Config, output_dir: Path) -> Path:
    """The config every role loads (typed by the `base_config` schema)."""
    doc = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    path = output_dir / f"{RESOLVED_CONFIG}.yaml"
    write_private(path, "defaults:\n  - base_config\n  - _self_\n\n" + OmegaConf.to_yaml(doc))
    return path


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, readable by this user only from its first byte (a run's configs hold secrets)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a file that was there keeps its mode otherwise
    with os.fdopen(fd, "w") as f:
        f.write(text)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _index(role: Role) -> int:
    return int(role.name.rsplit("-", 1)[1])
