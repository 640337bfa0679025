"""The one-machine launcher: a private redis-server, the weight server (embedded, in this
process), the learner and ``rollout.num_workers`` workers as child processes, and their
supervision (see :mod:`rlhf_run.launch` for the command, and :class:`Launcher`).

Starts a private redis-server when no ``buffer.url`` is given (random port, AOF on, its data in
``redis/`` of the output folder, stopped by PID at exit), the weight server, the learner and the
workers with their logs under the output folder. SIGINT/SIGTERM are forwarded, so everything
shuts down cleanly with a final checkpoint; the children and Redis die with the launcher even
when it is SIGKILLed. A crashed worker is reported with its log tail and restarted (per config);
a crashed learner is restarted from its checkpoint. At the end: a summary, ``summary.json`` and
plots; the Redis data is removed when the run finished cleanly and kept otherwise.

The launcher starts workers as processes and loads no model: of ``rollout_workers`` it imports only
``user_code``, to import the user's rewards and environment before anything starts.
:class:`Launcher.run` is also the flow of ``launcher=ray`` (:mod:`rlhf_run.ray_launcher`), which
places the same roles as Ray actors.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from omegaconf import OmegaConf

from buffer.connection import BufferDiskError, redact
from buffer.datasets import data_path
from gateway.openai_api import served_name
from rlhf_core.cli import WORKER_ID_ENV, die_with_parent, say_once_when_full, write_json
from rlhf_core.config import Config
from rlhf_core.errors import STOPPED_EARLY_EXIT, free_space
from rlhf_core.model_paths import pin_model_paths, pin_reward_model_paths
from rollout_workers.user_code import check_reward_targets, import_env_target

log = logging.getLogger(__name__)

RESOLVED_CONFIG = "run_config"
#: the run's config as given (run id filled in, addresses of a private Redis and weight server
#: not): what ``resume=`` starts from
LAUNCH_CONFIG = "launch_config.yaml"
REDIS_DIR = "redis"  # the private redis-server's data, inside the output folder
PIDS_FILE = "children.json"


#: the exit code of a process that stopped on a UserError (rlhf_core.cli): never restarted
USER_ERROR_EXIT = 2
MAX_RESTARTS = 5  # per worker
REDIS_DOWN_HINT_S = 10.0  # Redis unreachable this long: print how to restart it on the same data


@dataclass
class Child:
    name: str
    kind: str  # learner | worker | evaluator | gateway
    cmd: list[str]
    log_path: Path
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    restarts: int = 0
    exit_code: int | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logf = open(self.log_path, "ab")
        # SIGKILL when the launcher dies: no child trains on unsupervised; resume restarts them
        self.proc = subprocess.Popen(self.cmd, stdout=logf, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True, preexec_fn=die_with_parent(signal.SIGKILL))
        logf.close()

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
        if self.alive():
            try:
                os.killpg(self.proc.pid, sig)  # the child and anything it started
            except ProcessLookupError:
                pass


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, readable by this user only from its first byte (a run's configs
    may hold the weight server's secret, API keys and the Redis password)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a file that was there keeps its mode otherwise
    with os.fdopen(fd, "w") as f:
        f.write(text)


def generate_run_id() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:4]


def pin_paths(cfg: Config) -> None:
    """Hub ids become their cached snapshot folders: one download at most, the same files
    everywhere. The gateway's model id is named first, from the path as given (not the
    snapshot folder, named by a commit hash)."""
    if cfg.gateway.enabled:
        cfg.gateway.model_name = served_name(cfg)
    cfg.model = pin_model_paths(cfg.model)
    pin_reward_model_paths(cfg.reward.models)


@dataclass
class Launcher:
    """Owns the processes of one run; ``run()`` returns the process exit code."""

    cfg: Config
    output_dir: Path
    children: list[Child] = field(default_factory=list)
    redis: Any = None
    weight_server: Any = None
    stopping: bool = False
    exit_reason: str = ""
    failure: str = ""  # set when a child failed in a way that fails the run
    _redis_hint_given: bool = False
    _weight_server_log: Any = None  # undoes own_log_file for the in-process weight server

    # ------------------------------------------------------------------ start

    def save_launch_config(self) -> None:
        """Fix the run id and keep the config as given, before addresses are filled in: what
        ``resume=`` starts from."""
        if self.cfg.buffer.run_id in ("", "auto"):
            self.cfg.buffer.run_id = generate_run_id()
        write_private(self.output_dir / LAUNCH_CONFIG, OmegaConf.to_yaml(OmegaConf.structured(self.cfg)))
        hydra_dir = self.output_dir / ".hydra"  # Hydra's copy of the config and the command line's overrides
        if hydra_dir.is_dir():
            hydra_dir.chmod(0o700)

    def start_infrastructure(self) -> None:
        cfg = self.cfg
        if cfg.buffer.url is None:
            from buffer.local_server import RedisServer

            workdir = self.output_dir / REDIS_DIR
            if workdir.is_dir():
                log.info("continuing on the run's Redis data in %s", workdir)
            # everysec: at most one second of appends is at risk if the machine dies; the test
            # fixture uses `always`
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
        cfg.run.output_dir = str(self.output_dir)

    def write_resolved_config(self) -> Path:
        """Children load exactly this config (typed by the `base_config` schema)."""
        node = OmegaConf.structured(self.cfg)
        doc = OmegaConf.to_container(node, resolve=True)
        text = "defaults:\n  - base_config\n  - _self_\n\n" + OmegaConf.to_yaml(doc)
        path = self.output_dir / f"{RESOLVED_CONFIG}.yaml"
        write_private(path, text)
        return path

    def child_cmd(self, module: str, name: str) -> list[str]:
        return [
            sys.executable, "-m", module,
            "--config-path", str(self.output_dir.resolve()), "--config-name", RESOLVED_CONFIG,
            f"hydra.run.dir={self.output_dir.resolve() / 'logs' / name}", "hydra.output_subdir=null",
        ]

    def start_children(self) -> None:
        self.children.extend(self.plan_children())
        for child in self.children:
            child.start()
            log.info("started %s (pid %d), log %s", child.name, child.proc.pid, child.log_path)
        self.write_pids()

    def plan_children(self) -> list[Child]:
        """The learner, the workers and (``eval.every`` > 0) the evaluator, each with its command
        and environment (not started).

        Placement: ``learner.devices`` / ``rollout.devices`` set each child's
        ``CUDA_VISIBLE_DEVICES`` (worker i gets ``rollout.devices[i % len]``, so several workers
        may share a GPU, or share the learner's); a learner with more than one GPU runs under
        ``torchrun`` with one process per GPU.
        """
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // max(1, self.cfg.rollout.num_workers + 1))))
        env["PYTHONUNBUFFERED"] = "1"
        logs = self.output_dir / "logs"
        learner_devices = self.cfg.learner.devices
        learner_cmd = self.child_cmd("learner", "learner")
        learner_env = dict(env)
        if learner_devices is not None:
            learner_env["CUDA_VISIBLE_DEVICES"] = ",".join(str(int(d)) for d in learner_devices)
            if len(learner_devices) > 1:
                learner_cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc_per_node={len(learner_devices)}", *learner_cmd[1:]]
        children = [Child("learner", "learner", learner_cmd, logs / "learner.log", learner_env)]
        worker_devices = self.cfg.rollout.devices
        for i in range(self.cfg.rollout.num_workers):
            wenv = dict(env, **{WORKER_ID_ENV: f"worker-{i}"})
            if worker_devices is not None:
                wenv["CUDA_VISIBLE_DEVICES"] = str(int(worker_devices[i % len(worker_devices)]))
            children.append(
                Child(f"worker-{i}", "worker", self.child_cmd("rollout_workers", f"worker-{i}"), logs / f"worker-{i}.log", wenv)
            )
        if self.cfg.gateway.enabled:  # the OpenAI-compatible front end; the workers serve its calls
            children.append(Child("gateway", "gateway", self.child_cmd("gateway.cli", "gateway"), logs / "gateway.log", env))
            g = self.cfg.gateway
            log.info("gateway: %s (model '%s'; its address also in %s)",
                     f"http://{g.host}:{g.port}/v1" if g.port else "a free port", served_name(self.cfg),
                     self.output_dir / "gateway.json")
        if self.cfg.eval.every:  # periodic evaluation: its own engine, on worker 0's GPU when placed
            eenv = dict(env)
            if worker_devices is not None:
                eenv["CUDA_VISIBLE_DEVICES"] = str(int(worker_devices[0]))
            children.append(Child("evaluator", "evaluator", self.child_cmd("rollout_workers.evaluator", "evaluator"),
                                  logs / "evaluator.log", eenv))
        return children

    def write_pids(self) -> None:
        """children.json: which processes belong to this run (for operators and tests)."""
        pids = {"launcher": os.getpid(), **{c.name: c.proc.pid for c in self.children if c.proc is not None}}
        if self.redis is not None:
            pids["redis"] = self.redis.pid
        write_json(self.output_dir / PIDS_FILE, pids)

    # ------------------------------------------------------------------ supervise

    def supervise_once(self) -> bool:
        """Check the children; return False when the run is over."""
        for child in self.children:
            if child.alive() or child.proc is None or child.exit_code is not None:
                continue
            code = child.proc.returncode
            if child.kind == "learner":
                if code not in (0, USER_ERROR_EXIT) and not self.stopping and child.restarts < self.cfg.run.learner_restarts:
                    # an OOM kill, a crash, a signal to the learner alone: the learner resumes from its
                    # last checkpoint, the buffer re-delivers what it had read and not committed
                    how = "was stopped by a signal" if code == STOPPED_EARLY_EXIT else "crashed"
                    log.error("learner %s (exit %d); last lines of %s:\n%s", how, code, child.log_path, child.tail())
                    child.restarts += 1
                    log.info("restarting the learner from its last checkpoint (restart %d of %d)", child.restarts,
                             self.cfg.run.learner_restarts)
                    child.start()
                    self.write_pids()
                    continue
                child.exit_code = code
                if code == 0:
                    self.exit_reason = "learner finished"
                else:
                    self.failure = self.exit_reason = f"learner exited with code {code}: {child.last_error()}"
                    log.error("learner crashed (exit %d); last lines of %s:\n%s", code, child.log_path, child.tail())
                return False
            if self.stopping:
                child.exit_code = code
                continue
            log.error("%s exited with code %d; last lines of %s:\n%s", child.name, code, child.log_path, child.tail())
            if code == USER_ERROR_EXIT:  # a config, data or state error: a restart would only repeat it
                child.exit_code = code
                self.failure = self.exit_reason = f"{child.name} stopped: {child.last_error()}"
                return False
            if self.cfg.rollout.restart_on_crash and child.restarts < MAX_RESTARTS:
                child.restarts += 1
                log.info("restarting %s (restart %d)", child.name, child.restarts)
                child.start()
                self.write_pids()
            else:
                child.exit_code = code
                if not any(c.alive() for c in self.children if c.kind == "worker"):
                    self.failure = self.exit_reason = (f"no worker left: {child.name} exited with code {code} "
                                                       f"({child.last_error()})")
                    return False
        return True

    def stop_children(self, grace_s: float | None = None) -> None:
        """SIGTERM everyone (learner writes its final checkpoint), then SIGKILL stragglers."""
        self.stopping = True
        grace = grace_s if grace_s is not None else self.cfg.rollout.shutdown_grace_s + 20
        for child in self.children:
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for child in self.children:
            while child.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if child.alive():
                log.warning("%s did not stop within %.0f s: killing it", child.name, grace)
                child.signal(signal.SIGKILL)
                child.proc.wait(timeout=10)
            if child.proc is not None and child.exit_code is None:
                child.exit_code = child.proc.returncode

    def shutdown_infrastructure(self, clean: bool = False) -> None:
        """Stop the weight server and a private Redis. Its data goes when the run finished
        cleanly (``clean``); otherwise it stays for ``resume=``."""
        if self.weight_server is not None:
            self.weight_server.stop()
            self.weight_server = None
        if self._weight_server_log is not None:
            self._weight_server_log()
            self._weight_server_log = None
        if self.redis is not None:
            self.redis.stop()
            if clean:
                shutil.rmtree(self.redis.workdir, ignore_errors=True)
            else:  # after `run failed: ...`, if it failed
                what = "fix what the error above says, then continue" if self.failure else "continue"
                print(f"the run's Redis data is kept in {self.redis.workdir}; {what} the run with:\n"
                      f"  rlhf-run resume={self.output_dir}", file=sys.stderr, flush=True)
            self.redis = None

    def check_progress(self, progress: Any) -> bool:
        """True when the run must end on what the progress thread met (corrupt control state);
        says how to bring back a Redis this launcher started when it stays unreachable."""
        if progress.error is not None:
            self.failure = self.exit_reason = str(progress.error)
            if isinstance(progress.error, BufferDiskError) and self.redis is not None:  # its data is this run's
                self.failure = self.exit_reason = f"{progress.error} ({self.redis.workdir}: {free_space(self.redis.workdir)})"
            log.error("%s", self.failure)
            return True
        since = progress.unreachable_since
        if since is not None and self.redis is not None and time.time() - since > REDIS_DOWN_HINT_S \
                and not self._redis_hint_given:
            self._redis_hint_given = True
            log.error("Redis of this run has been unreachable for %.0f s. It keeps the run's state in its append-only "
                      "file; restart it on the same data with:\n  %s", time.time() - since, self.redis.restart_command())
        return False

    def anything_running(self) -> bool:
        return any(c.alive() for c in self.children)

    def learner_code(self) -> int:
        learner = next(c for c in self.children if c.kind == "learner")
        return learner.exit_code if learner.exit_code is not None else 1

    def run(self) -> int:
        from rlhf_run.progress import Progress
        from rlhf_run.summary import write_report

        self.output_dir.mkdir(parents=True, exist_ok=True)
        interrupted: list[int] = []

        def on_signal(signum: int, _frame: Any) -> None:
            interrupted.append(signum)

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        progress = None
        code = 1
        try:
            check_reward_targets(self.cfg.reward)  # before anything starts
            import_env_target(self.cfg.rollout)  # an environment that does not import stops the run here too
            for name, data in (("data", self.cfg.data), ("eval.data", self.cfg.eval.data if self.cfg.eval.every else None)):
                if data is not None and data.source not in ("builtin", "none"):
                    data_path(data, name)  # a missing file: here, not in the learner's log once it has started
            pin_paths(self.cfg)
            if self.cfg.model.lora.r:
                from rlhf_core.models import check_lora  # torch and transformers: only when there is something to check

                check_lora(self.cfg.model)  # LoRA targets on a weightless copy of the model: a typo stops here
            self.save_launch_config()
            self.start_infrastructure()
            self.write_resolved_config()
            self.start_children()
            progress = Progress(self.cfg, self.output_dir, self.weight_server).start()
            url = redact(self.cfg.buffer.url)
            where = f"; the password is buffer.url in {RESOLVED_CONFIG}.yaml" if url != self.cfg.buffer.url else ""
            print(f"run {self.cfg.buffer.run_id}: output in {self.output_dir}  "
                  f"(monitor: rlhf-monitor url={url} run_id={self.cfg.buffer.run_id}{where})", flush=True)
            # Supervision never touches Redis (the progress thread does), so a Redis outage
            # cannot stop it from restarting children.
            while not interrupted and self.supervise_once() and not self.check_progress(progress):
                time.sleep(0.5)
            if interrupted:
                self.exit_reason = f"interrupted by signal {interrupted[0]}"
                log.info("%s: stopping children", self.exit_reason)
            self.stop_children()
            progress.close()
            summary = write_report(self.cfg, self.output_dir, progress, self.exit_reason)
            print(summary, flush=True)
            if interrupted:
                code = 130
            elif self.failure:
                print(f"run failed: {self.failure}", file=sys.stderr, flush=True)
            else:
                code = 0 if self.learner_code() == 0 else 1
            return code
        finally:
            if self.anything_running():
                self.stop_children(grace_s=5)
            self.shutdown_infrastructure(clean=code == 0)
            for s, h in old.items():
                signal.signal(s, h)


def own_log_file(logger_name: str, path: Path) -> Callable[[], None]:
    """Send ``logger_name``'s records to ``path`` instead of the console, warnings and errors
    to both: a component running inside the launcher (the weight server logs two lines per
    version) keeps its chatter in its own log like the children, and the console shows the live
    line. Returns the function that undoes it."""
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
