"""The Ray actors of a ``launcher=ray`` run, and two small tasks that act on an actor's node.

:class:`RoleActor` runs a role in its own process as a child of the one-machine launcher does:
the same entry function on the process's main thread (so a stop request is a signal, sent by
:func:`signal_process` on the actor's node), the config as plain data
(:func:`rlhf_run.ray_plan.plain_config`), its output in ``<output>/logs/<name>.log`` on its node.
:class:`WeightServerActor` and :class:`RedisActor` are bound to their node's IP, always
authenticated. This module imports Ray; nothing else of the app imports it unless ``launcher=ray``.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import ray

from rlhf_core.errors import STOPPED_EARLY_EXIT, UserError, disk_writes
from rlhf_core.metric_names import STOP_SIGNAL

log = logging.getLogger(__name__)

LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


def node_ip() -> str:
    """The IP of this node as the cluster knows it (other nodes reach this one there)."""
    return ray.util.get_node_ip_address()


def where() -> dict[str, Any]:
    """Where the calling actor runs: pid, node id and IP, and the GPU ids Ray gave it."""
    return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(), "ip": node_ip(),
            "gpus": [str(g) for g in ray.get_gpu_ids()]}


def log_to(path: str, level: str = "INFO") -> None:
    """Send this process's stdout, stderr and log records to ``path`` (appended: a restarted
    actor continues its log), as the one-machine launcher does for each child."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr, force=True)


def _enter(cfg_plain: dict[str, Any], env: dict[str, str], log_path: str, cwd: str) -> Any:
    """A role's first steps in its actor: environment, libraries, working folder, log, config."""
    from rlhf_core.cli import quiet_libraries
    from rlhf_run.ray_plan import config_from_plain

    os.environ.update(env)  # before torch is imported: ranks' CUDA_VISIBLE_DEVICES, MASTER_ADDR, ...
    quiet_libraries(hub_offline=True)  # the launcher pinned Hub ids to folders; actors never download
    cfg = config_from_plain(cfg_plain)
    log_to(log_path, cfg.run.log_level)
    if os.path.isdir(cwd):  # relative paths in the config mean what they mean for rlhf-run
        os.chdir(cwd)
    else:
        log.warning("%s does not exist on this node (%s): relative paths in the config will not resolve", cwd, node_ip())
    return cfg


@ray.remote
class RoleActor:
    """A worker, the evaluator or one learner rank (see the module docstring)."""

    def where(self) -> dict[str, Any]:
        """Where this actor runs, and a TCP port free on its node (a rank 0's rendezvous port)."""
        from buffer.local_server import free_port

        return {**where(), "free_port": free_port(node_ip())}

    def run(self, kind: str, cfg_plain: dict[str, Any], env: dict[str, str], log_path: str, cwd: str) -> dict[str, Any]:
        """Run the role until it finishes or is signalled; ``{"code": exit code, "error": line}``
        with the codes of the one-machine launcher's children (0, 2 user error, 75 unavailable, 1)."""
        try:
            cfg = _enter(cfg_plain, env, log_path, cwd)
            with disk_writes(cfg.run.output_dir or cwd):  # a full disk where no caller named the file
                if kind == "worker":
                    from rollout_workers.worker import run_worker

                    run_worker(cfg)
                elif kind == "learner":
                    from learner.trainer import run_learner

                    if run_learner(cfg).stopped_by == STOP_SIGNAL:  # before its budget: not a finished run
                        return {"code": STOPPED_EARLY_EXIT, "error": "stopped by a signal"}
                elif kind == "evaluator":
                    from rollout_workers.evaluator import run_evaluator

                    run_evaluator(cfg)
                else:
                    raise ValueError(f"unknown role {kind!r}")
            return {"code": 0, "error": ""}
        except UserError as exc:  # what a child prints as one line, exit 2 (75: a server unreachable)
            log.error("%s", exc)
            try:
                print(f"error: {exc}", file=sys.stderr, flush=True)
            except OSError:  # its log is on the disk that is full: the launcher gets the line below
                pass
            return {"code": exc.exit_code, "error": f"error: {exc}"}
        except SystemExit as exc:
            return {"code": exc.code if isinstance(exc.code, int) else 1, "error": f"exited ({exc.code})"}
        except BaseException as exc:  # a crash: the traceback goes to the log, a line to the launcher
            traceback.print_exc()
            sys.stderr.flush()
            return {"code": 1, "error": f"{type(exc).__name__}: {exc}"}


@ray.remote
class WeightServerActor:
    """The run's weight server, on its node's IP, serving from a thread (``metrics()`` answers while it serves)."""

    def __init__(self) -> None:
        self.server: Any = None

    def start(self, cfg_plain: dict[str, Any], log_path: str) -> dict[str, Any]:
        from rlhf_core.config import LOOPBACK_HOSTS
        from rlhf_run.ray_plan import config_from_plain
        from weight_server import WeightServer

        cfg = config_from_plain(cfg_plain)
        log_to(log_path, cfg.run.log_level)
        ws = cfg.weight_server
        if ws.host in LOOPBACK_HOSTS:  # other nodes connect to this node's address
            ws.host = node_ip()
        self.server = WeightServer(ws).start()
        return {**where(), "address": self.server.address, "pub_address": self.server.pub_address}

    def metrics(self) -> dict[str, Any]:
        return self.server.metrics() if self.server is not None else {}

    def ping(self) -> bool:
        return True

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


@ray.remote
class RedisActor:
    """The run's private redis-server (AOF on, data in the output folder's ``redis/``) as a child
    of this actor: bound to the node's IP with a password, and dead with the actor."""

    def __init__(self) -> None:
        self.redis: Any = None

    def start(self, workdir: str, password: str) -> dict[str, Any]:
        from buffer.local_server import RedisServer

        # everysec, as rlhf-run's private Redis: at most a second of appends at risk if the machine dies
        self.redis = RedisServer(workdir, password=password, fsync="everysec", die_with_parent=True,
                                 host=node_ip()).start()
        return {**where(), "url": self.redis.url, "redis_pid": self.redis.pid,
                "restart_command": self.redis.restart_command()}

    def ping(self) -> bool:
        return self.redis is not None and self.redis.proc is not None and self.redis.proc.poll() is None

    def stop(self) -> None:
        if self.redis is not None:
            self.redis.stop()
            self.redis = None


@ray.remote(num_cpus=0, max_retries=0)
def signal_process(pid: int, sig: int) -> bool:
    """Send ``sig`` to ``pid`` (scheduled on the node the process runs on)."""
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


@ray.remote(num_cpus=0, max_retries=0)
def read_tail(path: str, lines: int) -> str:
    """The last ``lines`` lines of a log file on this task's node (a crashed actor's log)."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(no log: {exc})"
