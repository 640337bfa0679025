"""`rlhf-run launcher=ray`: the run's roles as Ray actors, on one machine or a cluster.

The flow is the one-machine launcher's (:meth:`rlhf_run.local_launcher.Launcher.run`: pinned model
paths, the saved config, the live line, the report, ``resume=``); what differs is where the
roles run and how they are watched:

* **Connect** to ``ray.address`` (probed first, and Ray's own connect settings bounded, so a missing
  cluster, or a server there that is no Ray cluster, is an error within about
  ``ray.connect_timeout_s``) or start a local Ray instance (loopback only), then check that
  the cluster can hold every actor (:func:`rlhf_run.ray_plan.check_fits`) before any starts.
* **Place**: the learner's ranks in a placement group, one bundle per rank (rank 0 on this node
  by default: the output folder with metrics.jsonl and the checkpoints is here); the weight
  server on this node too (beside rank 0 it publishes through shared memory; here it outlives
  the loss of any other node), with an HMAC secret made for the run unless
  ``weight_server.auth`` says otherwise; a private redis-server (when no ``buffer.url``) on this
  node, data in ``<output>/redis``, bound to the node's IP with a password; workers and the
  evaluator wherever their ``ray.worker`` demand fits, spread over the nodes that can hold one
  (``ray.worker.strategy``), so a lost node stops only its own workers.
* **Supervise** on Ray's terms: a worker whose process or node dies is restarted by Ray
  (``ray.worker.max_restarts``) and runs again; its leases are expired at once (the other workers
  take them over without waiting for ``buffer.lease_timeout_s``); a
  worker that crashed is given a fresh process the same way; the learner is restarted from its
  checkpoint (``run.learner_restarts``), all ranks together, in its placement group (which Ray
  re-places when a node is lost). Exit codes mean what they mean for children (2: a user error
  ends the run; 75: a server unreachable, restarted).
* **Scale**: the progress thread reads the worker target from Redis (``rlhf-monitor ...
  workers=N`` sets it); workers are added (Ray places them) or the newest retired (SIGTERM:
  they drain and release their leases). Workers started by hand (``rlhf-worker``) join as ever.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import signal
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit

from buffer.connection import redact
from rlhf_core.config import ConfigError
from rlhf_core.errors import UserError
from rlhf_run.local_launcher import PIDS_FILE, REDIS_DIR, USER_ERROR_EXIT, Launcher, write_json
from rlhf_run import ray_plan as plan

log = logging.getLogger(__name__)

ACTORS_FILE = "actors.json"  # every actor of the run: pid, node, IP, restarts (children.json: this node's)
DIED = -9  # the exit code shown for an actor whose process or node was lost
CALL_TIMEOUT_S = 60.0  # a start-up call to an actor (model-free: Redis, the weight server, where())
INFRA_CHECK_S = 2.0


@dataclass
class RoleProc:
    """One role actor as the launcher sees it (what :class:`rlhf_run.local_launcher.Child` is for a process)."""

    name: str
    kind: str  # learner | worker | evaluator
    log_path: Path
    options: dict[str, Any]
    env: dict[str, str]
    rank: int = 0
    handle: Any = None
    run_ref: Any = None
    where_ref: Any = None
    placed: dict[str, Any] | None = None  # where(): pid, node_id, ip, gpus
    restarts: int = 0
    exit_code: int | None = None
    retiring_since: float | None = None
    submitted: float = 0.0
    pending_warned: bool = False


@dataclass
class ActorHandle:
    """The weight server's or Redis's actor, shaped like what the one-machine launcher holds
    (``stop()``, and ``metrics()`` / ``url``, ``pid``, ``workdir``, ``restart_command()``)."""

    ray: Any
    actor: Any
    info: dict[str, Any]
    workdir: Path | None = None
    _metrics_failed: bool = False

    @property
    def pid(self) -> int:
        return int(self.info.get("redis_pid", self.info["pid"]))

    @property
    def url(self) -> str:
        return self.info["url"]

    def restart_command(self) -> str:
        """Redis's, for the hint the launcher logs: its password stays where the run keeps it."""
        password = urlsplit(self.url).password
        command = self.info["restart_command"]
        return command.replace(password, "PASSWORD (buffer.url in run_config.yaml)") if password else command

    def metrics(self) -> dict[str, Any]:
        try:
            return self.ray.get(self.actor.metrics.remote(), timeout=5)
        except Exception as exc:  # the live line goes on without the weight server's numbers
            if not self._metrics_failed:
                log.warning("the weight server's metrics are unavailable: %s", _first_line(exc))
            self._metrics_failed = True
            return {}

    def stop(self) -> None:
        try:
            self.ray.get(self.actor.stop.remote(), timeout=15)
        except Exception as exc:
            log.debug("stopping an actor: %s", exc)
        self.ray.kill(self.actor)


@dataclass
class RayLauncher(Launcher):
    """:class:`~rlhf_run.local_launcher.Launcher` with the roles as Ray actors (see the module docstring)."""

    actors: list[RoleProc] = field(default_factory=list)
    ray: Any = None
    driver_node: str = ""
    pg: Any = None
    cfg_plain: dict[str, Any] = field(default_factory=dict)
    learner_restarts: int = 0
    learner_exit: int | None = None
    worker_target: int = 0
    _infra_pings: dict[str, Any] = field(default_factory=dict)
    _infra_checked: float = 0.0
    _signals: list[Any] = field(default_factory=list)
    _expiring: list[threading.Thread] = field(default_factory=list)
    _spread_warned: bool = False

    # ------------------------------------------------------------------ start

    def connect(self) -> None:
        """Ray up: ``ray.address`` answered within ``ray.connect_timeout_s``, or a local instance."""
        address = self.cfg.ray.address
        if address is None:
            # a local instance serves this machine only: Ray then uses loopback instead of the
            # machine's network address (read when ray is imported)
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        try:
            import ray
        except ImportError:
            raise ConfigError("launcher=ray needs Ray, which is not installed: pip install -e '.[ray]' "
                              "(./quickstart.sh installs it), or use launcher=local") from None
        self.ray = ray
        sigterm = signal.getsignal(signal.SIGTERM)  # ray.init puts its own (sys.exit) there
        try:
            if address is None:
                want = sum(d.resources.get("CPU", 0.0) for d in plan.demands(self.cfg))
                cpus = self.cfg.ray.num_cpus or max(os.cpu_count() or 1, math.ceil(want))
                # "local": a new instance even where RAY_ADDRESS or a `ray start` on this machine would be joined
                ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False,
                         object_store_memory=self.cfg.ray.object_store_mb * 2**20)
                log.info("started a local Ray instance (%g logical CPUs)", cpus)
            else:
                join(ray, address, self.cfg.ray.connect_timeout_s)
                log.info("connected to the Ray cluster at %s", address)
        finally:
            signal.signal(signal.SIGTERM, sigterm)  # the run's: it stops the roles and writes the summary
        self.driver_node = ray.get_runtime_context().get_node_id()

    def start_infrastructure(self) -> None:
        cfg = self.cfg
        self.connect()
        ray = self.ray
        from ray.util.placement_group import placement_group

        self.check_fits()
        ranks = cfg.ray.learner.ranks
        bundles, selectors = plan.learner_bundles(cfg, self.driver_node)
        self.pg = placement_group(bundles, strategy=cfg.ray.learner.strategy, bundle_label_selector=selectors)
        self.wait_placement_group(f"{ranks} bundle(s) of {bundles[0]}")
        from rlhf_run.ray_actors import RedisActor, WeightServerActor

        if cfg.buffer.url is None:
            workdir = self.output_dir / REDIS_DIR
            if workdir.is_dir():
                log.info("continuing on the run's Redis data in %s", workdir)
            actor = RedisActor.options(**self.infra_options(cfg.ray.redis, self.driver_node)).remote()
            info = self.call(actor.start.remote(str(workdir), secrets.token_urlsafe(24)), "the run's redis-server")
            self.redis = ActorHandle(ray, actor, info, workdir=workdir)
            cfg.buffer.url = info["url"]
            log.info("started private redis-server pid %d on %s at %s (data in %s)", self.redis.pid, info["ip"],
                     redact(info["url"]), workdir)
        if cfg.weight_server.address is None:
            if cfg.weight_server.auth == "none":  # other nodes connect: never without authentication
                cfg.weight_server.auth, cfg.weight_server.secret = "hmac", secrets.token_hex(32)
            actor = WeightServerActor.options(**self.infra_options(cfg.ray.weight_server, self.driver_node)).remote()
            info = self.call(actor.start.remote(plan.plain_config(cfg), str(self.output_dir / "logs" / "weight-server.log")),
                             "the weight server")
            self.weight_server = ActorHandle(ray, actor, info)
            cfg.weight_server.address, cfg.weight_server.pub_address = info["address"], info["pub_address"]
            log.info("weight server at %s (announcements %s), auth %s", info["address"], info["pub_address"],
                     cfg.weight_server.auth)
        cfg.run.output_dir = str(self.output_dir)

    def check_fits(self, workers: int | None = None) -> None:
        """The cluster can hold the run's actors (with ``workers`` workers), or a ConfigError naming the resource."""
        cfg = self.cfg
        plan.check_fits(plan.demands(cfg, workers), self.ray.nodes(), cfg.ray.address or "this machine (a local instance)",
                        spread_ranks=cfg.ray.learner.ranks if cfg.ray.learner.strategy == "STRICT_SPREAD" else 0,
                        driver_node=self.driver_node)

    def infra_options(self, role: Any, node_id: str) -> dict[str, Any]:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return {**plan.actor_options(role, labels=False), "runtime_env": {"env_vars": dict(plan.NORMAL_PRIORITY_ENV)},
                "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}

    def wait_placement_group(self, what: str) -> None:
        try:
            self.ray.get(self.pg.ready(), timeout=self.cfg.ray.placement_timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            raise UserError(f"the learner's placement group ({what}, strategy {self.cfg.ray.learner.strategy}) was not "
                            f"placed within ray.placement_timeout_s={self.cfg.ray.placement_timeout_s:g} s: no node "
                            "has that room now (other jobs hold it, or a node with it is gone)") from None

    def call(self, ref: Any, what: str, timeout: float = CALL_TIMEOUT_S) -> Any:
        """``ray.get`` a start-up call: a user error raised in the actor stays one; a timeout says what."""
        ray = self.ray
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise UserError(f"{what} did not start within {timeout:g} s (no node has room for its actor, or its node "
                            "is overloaded)") from None
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, UserError):
                raise exc.cause from None
            raise

    def write_resolved_config(self) -> Path:
        path = super().write_resolved_config()  # 0600: it holds the weight server's secret and Redis's password
        self.cfg_plain = plan.plain_config(self.cfg)
        return path

    def start_children(self) -> None:
        self.start_learner()
        for i in range(self.cfg.rollout.num_workers):
            self.add_worker(i)
        if self.cfg.eval.every:
            self.launch(RoleProc("evaluator", "evaluator", self.output_dir / "logs" / "evaluator.log",
                                 self.worker_options(), plan.role_env(self.cfg.ray.worker)))
        self.worker_target = self.cfg.rollout.num_workers
        self.publish_worker_target()
        self.write_pids()
        buf = self.cfg.buffer
        print(f"scale the workers: rlhf-monitor url={redact(buf.url)} run_id={buf.run_id} workers=N; join by hand: "
              f"rlhf-worker --config-path {self.output_dir.resolve()} --config-name run_config", flush=True)
        if self.cfg.gateway.enabled:  # the workers serve its calls; the gateway runs where clients reach it
            print(f"gateway.enabled: the workers take gateway calls; start the gateway where your agents reach it: "
                  f"rlhf-gateway --config-path {self.output_dir.resolve()} --config-name run_config", flush=True)

    def publish_worker_target(self) -> None:
        """The target the run starts with, in Redis beside where ``rlhf-monitor workers=N`` changes it."""
        from buffer import MonitorClient

        buf = MonitorClient.connect(self.cfg.buffer.url, self.cfg.buffer.run_id, self.cfg.buffer)
        try:
            buf.set_worker_target(self.worker_target)
        finally:
            buf.close()

    def start_learner(self) -> None:
        """One actor per rank in the placement group; ranks > 1 get torch.distributed's environment
        from where they landed (rank 0's node is the rendezvous)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlhf_run.ray_actors import RoleActor

        role, logs = self.cfg.ray.learner, self.output_dir / "logs"
        procs = [RoleProc("learner" if r == 0 else f"learner-{r}", "learner",
                          logs / ("learner.log" if r == 0 else f"learner-{r}.log"), plan.actor_options(role, labels=False),
                          plan.role_env(role), rank=r) for r in range(role.ranks)]
        for p in procs:
            strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=p.rank)
            p.handle = RoleActor.options(**p.options, scheduling_strategy=strategy,
                                         runtime_env={"env_vars": p.env}).remote()
        self.actors[:0] = procs
        placed = [self.call(p.handle.where.remote(), f"learner rank {p.rank}") for p in procs]
        envs = plan.rank_envs([(w["ip"], w["gpus"]) for w in placed], placed[0]["free_port"]) if role.ranks > 1 \
            else [{}]
        for p, where, env in zip(procs, placed, envs):
            p.placed, p.submitted = where, time.monotonic()
            p.run_ref = p.handle.run.remote("learner", self.cfg_plain, env, str(p.log_path), os.getcwd())
            log.info("started %s on %s (pid %d), log %s", p.name, where["ip"], where["pid"], p.log_path)

    def add_worker(self, i: int) -> None:
        name = f"worker-{i}"
        self.launch(RoleProc(name, "worker", self.output_dir / "logs" / f"{name}.log",
                             self.worker_options(), plan.role_env(self.cfg.ray.worker, name)))

    def worker_options(self) -> dict[str, Any]:
        """A worker's (or the evaluator's) actor options, placed as ``ray.worker.strategy`` says
        (:func:`rlhf_run.ray_plan.worker_strategy`, on the cluster as it is now); a cluster of
        several nodes of which one can hold a worker is said once."""
        nodes = self.ray.nodes()
        strategy, fit = plan.worker_strategy(self.cfg, nodes)
        alive = sum(1 for n in nodes if n.get("Alive", True))
        if self.cfg.ray.worker.strategy == "SPREAD" and fit == 1 and alive > 1 and not self._spread_warned:
            self._spread_warned = True
            log.warning("ray.worker.strategy=SPREAD, but 1 of the %d nodes can hold a worker (%s): every worker runs "
                        "there, and losing that node stops all generation until Ray places them again", alive,
                        plan.Demand("worker", plan.role_resources(self.cfg.ray.worker),
                                    dict(self.cfg.ray.worker.label_selector)).text())
        return {**plan.actor_options(self.cfg.ray.worker), "scheduling_strategy": strategy}

    def launch(self, p: RoleProc) -> None:
        from rlhf_run.ray_actors import RoleActor

        p.handle = RoleActor.options(**p.options, runtime_env={"env_vars": p.env}).remote()
        self.actors.append(p)
        self.submit(p)
        log.info("started %s (a Ray actor), log %s", p.name, p.log_path)

    def submit(self, p: RoleProc) -> None:
        """Ask the actor where it is; once it answers (placed, or back after Ray restarted it),
        :meth:`poll_placement` has it run its role."""
        p.where_ref, p.placed, p.submitted, p.pending_warned = p.handle.where.remote(), None, time.monotonic(), False

    def write_pids(self) -> None:
        """children.json: the launcher and the processes on this node (what ``resume=`` checks);
        actors.json: every actor of the run with its node."""
        local: dict[str, int] = {"launcher": os.getpid()}
        everywhere: dict[str, Any] = {}
        for p in self.actors:
            if p.placed is not None:
                everywhere[p.name] = {k: p.placed[k] for k in ("pid", "node_id", "ip")} | {"restarts": p.restarts}
                if p.placed["node_id"] == self.driver_node:
                    local[p.name] = int(p.placed["pid"])
        for name, handle in (("redis", self.redis), ("weight_server", self.weight_server)):
            if handle is not None:
                everywhere[name] = {k: handle.info[k] for k in ("pid", "node_id", "ip")}
                if handle.info["node_id"] == self.driver_node:
                    local[name] = handle.pid
        write_json(self.output_dir / PIDS_FILE, local)
        write_json(self.output_dir / ACTORS_FILE, everywhere, indent=1)

    # ------------------------------------------------------------------ supervise

    def supervise_once(self) -> bool:
        ray = self.ray
        if not self.poll_placement() or not self.check_infrastructure():
            return False
        running = {p.run_ref: p for p in self.actors if p.run_ref is not None}
        done = ray.wait(list(running), num_returns=len(running), timeout=0)[0] if running else []
        for ref in done:
            p = running[ref]
            if p not in self.actors:  # replaced meanwhile: a learner restart kills every rank, this one too
                continue
            p.run_ref = None
            code, error, gone = self.outcome(ref)
            if not (self.on_learner_exit(p, code, error) if p.kind == "learner"
                    else self.on_worker_exit(p, code, error, gone)):
                return False
        self.end_retired()
        return True

    def outcome(self, ref: Any) -> tuple[int, str, bool]:
        """(exit code, error line, whether the actor is gone for good) of a finished call."""
        ray = self.ray
        try:
            result = ray.get(ref)
            return int(result["code"]), str(result.get("error", "")), False
        except ray.exceptions.ActorDiedError as exc:  # no restart left, or killed for good
            return DIED, f"the actor died: {_first_line(exc)}", True
        except ray.exceptions.RayActorError as exc:  # its process or its node was lost: Ray restarts it
            return DIED, f"the actor died: {_first_line(exc)}", False
        except ray.exceptions.RayError as exc:
            return 1, _first_line(exc), False

    def poll_placement(self) -> bool:
        """Actors that answered where they are (first start, or back after a restart) run their
        role; one Ray is still restarting is asked again. False when the run must end."""
        ray = self.ray
        waiting = {p.where_ref: p for p in self.actors if p.where_ref is not None}
        done = ray.wait(list(waiting), num_returns=len(waiting), timeout=0)[0] if waiting else []
        for ref in done:
            p = waiting[ref]
            p.where_ref = None
            try:
                p.placed = ray.get(ref)
            except ray.exceptions.ActorUnavailableError:  # Ray is (re)starting it: ask again next round
                p.where_ref = p.handle.where.remote()
                continue
            except ray.exceptions.RayError as exc:
                if not self.on_worker_exit(p, DIED, f"the actor died: {_first_line(exc)}", True):
                    return False
                continue
            log.info("%s runs on %s (pid %d)", p.name, p.placed["ip"], p.placed["pid"])
            if not self.stopping:
                p.run_ref = p.handle.run.remote(p.kind, self.cfg_plain, {}, str(p.log_path), os.getcwd())
        if done:
            self.write_pids()
        limit = self.cfg.ray.placement_timeout_s
        for p in waiting.values():
            if p.where_ref is not None and not p.pending_warned and time.monotonic() - p.submitted > limit:
                p.pending_warned = True
                log.warning("%s is not placed after %.0f s: no node has room for %s now (it starts when one has)",
                            p.name, limit, plan.role_resources(self.cfg.ray.worker))
        return True

    def check_infrastructure(self) -> bool:
        """The weight server's and Redis's actors still answer (asked every few seconds, never waited on)."""
        ray = self.ray
        for name, ref in list(self._infra_pings.items()):
            if not ray.wait([ref], timeout=0)[0]:
                continue
            del self._infra_pings[name]
            try:
                alive = ray.get(ref)
                why = "" if alive else "its process exited"
            except ray.exceptions.RayError as exc:
                why = _first_line(exc)
            if why and not self.stopping:
                self.failure = self.exit_reason = (f"the run's {name} is gone ({why}); the run's state is kept: "
                                                   f"rlhf-run resume={self.output_dir}")
                return False
        if time.monotonic() - self._infra_checked > INFRA_CHECK_S:
            self._infra_checked = time.monotonic()
            for name, handle in (("redis-server", self.redis), ("weight server", self.weight_server)):
                if handle is not None and name not in self._infra_pings:
                    self._infra_pings[name] = handle.actor.ping.remote()
        return True

    def on_learner_exit(self, p: RoleProc, code: int, error: str) -> bool:
        if code == 0 and p.rank != 0:
            p.exit_code = 0  # rank 0 says when the learner is done
            return True
        if code not in (0, USER_ERROR_EXIT) and not self.stopping and self.learner_restarts < self.cfg.run.learner_restarts:
            log.error("learner crashed (exit %d: %s); last lines of %s:\n%s", code, error, p.log_path, self.tail(p))
            self.learner_restarts += 1
            log.info("restarting the learner from its last checkpoint (restart %d of %d)", self.learner_restarts,
                     self.cfg.run.learner_restarts)
            try:
                self.restart_learner()
            except UserError as exc:
                self.failure = self.exit_reason = f"the learner could not be restarted: {exc}"
                return False
            return True
        self.learner_exit = p.exit_code = code
        if code == 0:
            self.exit_reason = "learner finished"
        else:
            self.exit_reason = f"learner exited with code {code}: {error}"
            log.error("learner crashed (exit %d); last lines of %s:\n%s", code, p.log_path, self.tail(p))
        return False

    def restart_learner(self) -> None:
        """All ranks anew (a torch.distributed group does not survive one rank), in the placement
        group Ray re-places when a node was lost; the learner resumes from its checkpoint. A lost
        node is seen by the launcher (its actors' calls fail) before Ray declares it dead, so a
        rank may first land on it again and die unstarted: it is placed again, until
        ``ray.placement_timeout_s``."""
        deadline = time.monotonic() + self.cfg.ray.placement_timeout_s
        while True:
            for q in [q for q in self.actors if q.kind == "learner"]:
                self.ray.kill(q.handle)
                self.actors.remove(q)
            self.wait_placement_group(f"{self.cfg.ray.learner.ranks} rank(s)")
            try:
                self.start_learner()
                break
            except self.ray.exceptions.RayActorError as exc:
                if time.monotonic() > deadline:
                    raise UserError(f"the learner's ranks kept dying before they started ({_first_line(exc)}) for "
                                    f"ray.placement_timeout_s={self.cfg.ray.placement_timeout_s:g} s") from None
                log.warning("a learner rank died before it started (%s): placing the ranks again", _first_line(exc))
        self.write_pids()

    def on_worker_exit(self, p: RoleProc, code: int, error: str, gone: bool = False) -> bool:
        """A worker or the evaluator ended: retired, stopping, a user error, or restarted (``gone``:
        Ray will not restart its actor, so a restart is a new actor)."""
        if p.retiring_since is not None:
            self.remove(p)  # before the line that says so: actors.json no longer lists it once it is read
            log.info("%s left (scaled down; exit %d)", p.name, code)
            return True
        if self.stopping:
            p.exit_code = code
            return True
        if p.kind == "worker" and code == DIED:  # nothing heartbeats its leases now
            self.expire_leases(p.name)
        log.error("%s exited with code %d (%s); last lines of %s:\n%s", p.name, code, error or "no error line",
                  p.log_path, self.tail(p))
        if code == USER_ERROR_EXIT:  # a config, data or state error: a restart would only repeat it
            p.exit_code = code
            self.failure = self.exit_reason = f"{p.name} stopped: {error}"
            return False
        limit = self.cfg.ray.worker.max_restarts
        if self.cfg.rollout.restart_on_crash and p.restarts < limit:
            p.restarts += 1
            if gone:
                from rlhf_run.ray_actors import RoleActor

                p.options = self.worker_options()  # placed on the cluster as it is now
                p.handle = RoleActor.options(**p.options, runtime_env={"env_vars": p.env}).remote()
            elif code != DIED:  # the process lives on: Ray starts a fresh one, as a restarted child is
                self.ray.kill(p.handle, no_restart=False)
            log.info("restarting %s (restart %d of %d, by Ray, where its demand fits)", p.name, p.restarts, limit)
            self.submit(p)
            return True
        p.exit_code = code
        self.ray.kill(p.handle)
        if p.kind == "worker" and not any(q.kind == "worker" and q.exit_code is None for q in self.actors):
            self.failure = self.exit_reason = f"no worker left: {p.name} exited with code {code} ({error})"
            return False
        return True

    def expire_leases(self, name: str) -> None:
        """``name``'s actor died (its process or its node lost): the other workers take its leases
        over now (:meth:`buffer.MonitorClient.expire_leases`) instead of after ``buffer.lease_timeout_s``.
        On a thread, as supervision never waits on Redis; Ray's restart of the actor runs its role
        only after a model load, long after this."""
        from buffer import MonitorClient

        def expire() -> None:
            try:
                buf = MonitorClient.connect(self.cfg.buffer.url, self.cfg.buffer.run_id, self.cfg.buffer)
                try:
                    n = buf.expire_leases(name)
                finally:
                    buf.close()
            except Exception as exc:  # then they come back after the lease timeout, as any dead worker's
                log.warning("%s's leases could not be expired (%s): they come back after buffer.lease_timeout_s",
                            name, _first_line(exc))
                return
            log.info("%s's %d lease(s) expired: the other workers take them over now", name, n)

        self._expiring = [t for t in self._expiring if t.is_alive()]
        self._expiring.append(threading.Thread(target=expire, name=f"expire-{name}", daemon=True))
        self._expiring[-1].start()

    def tail(self, p: RoleProc, lines: int = 20) -> str:
        """A log's last lines: here when its node is this one (or the folder is shared), else read there."""
        if p.log_path.is_file():
            return "\n".join(p.log_path.read_text(errors="replace").splitlines()[-lines:])
        if p.placed is None:
            return "(no log)"
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from rlhf_run.ray_actors import read_tail

        try:
            strategy = NodeAffinitySchedulingStrategy(p.placed["node_id"], soft=False)
            return self.ray.get(read_tail.options(scheduling_strategy=strategy).remote(str(p.log_path), lines), timeout=10)
        except Exception as exc:  # the node is gone with the log
            return f"(its log on {p.placed['ip']} cannot be read: {_first_line(exc)})"

    # ------------------------------------------------------------------ scale

    def check_progress(self, progress: Any) -> bool:
        if super().check_progress(progress):
            return True
        target = ((progress.latest or {}).get("control") or {}).get("workers")
        if target is not None and int(target) != self.worker_target and not self.stopping:
            self.scale_to(int(target))
        return False

    def scale_to(self, target: int) -> None:
        """Add workers (Ray places them) or retire the newest (SIGTERM: they drain and leave)."""
        active = sorted((p for p in self.actors if p.kind == "worker" and p.retiring_since is None and p.exit_code is None),
                        key=_index)
        log.info("scaling the workers from %d to %d (the run's worker target changed)", len(active), target)
        self.worker_target = target
        if target > len(active):
            try:
                self.check_fits(target)
            except ConfigError as exc:
                log.error("rlhf-monitor workers=%d is refused, the run keeps its %d: %s", target, len(active), exc)
                return
            used = {_index(p) for p in self.actors if p.kind == "worker"}
            for _ in range(target - len(active)):
                i = next(i for i in range(len(used) + 1) if i not in used)
                used.add(i)
                self.add_worker(i)
        for p in active[target:]:
            p.retiring_since = time.monotonic()
            if p.placed is None:  # never placed: nothing to drain
                self.remove(p)
            else:
                self.signal(p, signal.SIGTERM)
        self.write_pids()

    def end_retired(self) -> None:
        grace = self.cfg.rollout.shutdown_grace_s + 20
        for p in [p for p in self.actors if p.retiring_since is not None and time.monotonic() - p.retiring_since > grace]:
            log.warning("%s did not leave within %.0f s: killing it", p.name, grace)
            self.remove(p)

    def remove(self, p: RoleProc) -> None:
        self.ray.kill(p.handle)
        self.actors.remove(p)
        self.write_pids()

    def signal(self, p: RoleProc, sig: int) -> None:
        """``sig`` to the actor's process, sent from its node (as the launcher signals a child)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from rlhf_run.ray_actors import signal_process

        strategy = NodeAffinitySchedulingStrategy(p.placed["node_id"], soft=False)
        self._signals = [r for r in self._signals if not self.ray.wait([r], timeout=0)[0]]
        self._signals.append(signal_process.options(scheduling_strategy=strategy).remote(int(p.placed["pid"]), sig))

    # ------------------------------------------------------------------ stop

    def stop_children(self, grace_s: float | None = None) -> None:
        """SIGTERM every role (the learner writes its final checkpoint), then kill what is left."""
        self.stopping = True
        ray = self.ray
        grace = grace_s if grace_s is not None else self.cfg.rollout.shutdown_grace_s + 20
        for p in self.actors:
            p.where_ref = None  # nothing more starts
            if p.run_ref is not None and p.placed is not None:
                self.signal(p, signal.SIGTERM)
        # The grace is the roles' (a worker drains, then releases its leases): it starts once the
        # signals have landed, each a Ray task started on its node, which can take seconds on busy cores.
        if self._signals:
            ray.wait(list(self._signals), num_returns=len(self._signals), timeout=grace)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            running = {p.run_ref: p for p in self.actors if p.run_ref is not None}
            if not running:
                break
            for ref in ray.wait(list(running), num_returns=len(running), timeout=0.5)[0]:
                p = running[ref]
                p.run_ref = None
                p.exit_code = self.outcome(ref)[0]
                if p.kind == "learner" and p.rank == 0 and self.learner_exit is None:
                    self.learner_exit = p.exit_code
        for p in self.actors:
            if p.run_ref is not None:
                log.warning("%s did not stop within %.0f s: killing it", p.name, grace)
                p.run_ref = None
            ray.kill(p.handle)

    def anything_running(self) -> bool:
        return any(p.run_ref is not None for p in self.actors)

    def learner_code(self) -> int:
        return self.learner_exit if self.learner_exit is not None else 1

    def shutdown_infrastructure(self, clean: bool = False) -> None:
        if self.ray is None:
            return
        for t in self._expiring:  # before Redis stops; one waiting on an unreachable Redis is left behind
            t.join(timeout=5)
        for p in self.actors:
            self.ray.kill(p.handle)
        super().shutdown_infrastructure(clean)
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
            self.pg = None
        self.ray.shutdown()
        self.ray = None


def join(ray: Any, address: str, timeout: float) -> None:
    """``ray.init`` at ``ray.address``, or a ConfigError within about ``timeout`` s (plus a second)
    that names the address and says what to do."""
    found = resolve(address)
    probe(found, timeout, address)
    try:
        with gcs_connect_within(timeout):
            ray.init(address=address, log_to_driver=False)
    except ConnectionError as exc:  # it accepts connections, yet no Ray GCS answered there
        name = f"{address} ({found})" if found != address else address
        raise ConfigError(f"ray.address={name}: something accepts connections there but no Ray cluster answered "
                          f"within ~{timeout:g} s (ray.connect_timeout_s; {_first_line(exc)}). Pass the address "
                          "`ray start --head` prints (HOST:6379 by default), start a cluster there with `ray start "
                          "--head --port=6379`, or leave ray.address unset for a local Ray instance") from None


def resolve(address: str) -> str:
    """``ray.address`` as HOST:PORT: ``auto`` is RAY_ADDRESS, else the cluster that `ray start` last
    recorded on this node (never, as Ray's own ``auto`` may, any Ray instance that runs here)."""
    if address != "auto":
        return address
    from ray._private.utils import read_ray_address  # Ray's own lookup: <RAY_TMPDIR or /tmp>/ray/ray_current_cluster

    found = os.environ.get("RAY_ADDRESS") or read_ray_address()
    if not found:
        raise ConfigError("ray.address=auto: no Ray cluster was started on this node (RAY_ADDRESS is unset and no "
                          "`ray start` is recorded). Start one with `ray start --head --port=6379` (or join one with "
                          "`ray start --address=HEAD_IP:6379`), pass ray.address=HOST:PORT, or leave ray.address "
                          "unset for a local Ray instance")
    return found


@contextmanager
def gcs_connect_within(timeout: float) -> Iterator[None]:
    """Make ``ray.init`` give up on an address that accepts connections but is no Ray GCS (a Redis,
    any other server) after about ``timeout`` s, with Ray's own settings: one connect attempt
    instead of 20 of ~40 s each, its gRPC connect, pubsub connect and cluster id request each
    bounded by a third of ``timeout``. An operator's own RAY_* setting of these wins."""
    step = str(max(1, round(timeout / 3)))
    settings = {"RAY_gcs_server_port_wait_time_s": "1", "RAY_gcs_rpc_server_connect_timeout_s": step,
                "RAY_py_gcs_connect_timeout_s": step}
    ours = [k for k in settings if k not in os.environ]
    os.environ.update({k: settings[k] for k in ours})
    from ray._raylet import Config

    Config.initialize("")  # Ray read its settings from the environment when imported: read them again
    try:
        yield
    finally:
        for k in ours:  # a local Ray instance started later in this process waits as long as Ray likes
            os.environ.pop(k, None)


def probe(address: str, timeout: float, setting: str | None = None) -> None:
    """A clear error, within ``timeout`` seconds, when nothing listens at ``address`` (``setting``:
    the ``ray.address`` it came from, when that was ``auto``)."""
    name = f"{setting} ({address})" if setting not in (None, address) else address
    host, _, port = address.rpartition(":")
    if address.startswith("ray://"):
        raise ConfigError(f"ray.address={name}: Ray Client addresses are not supported; run rlhf-run on a node of "
                          "the cluster (the head node) with ray.address=HEAD_IP:6379")
    if not host or not port.isdigit():
        raise ConfigError(f"ray.address={name} must be HOST:PORT of the cluster's head (what `ray start --head` "
                          "prints), or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise ConfigError(f"ray.address={name}: no Ray cluster answers there ({exc}; waited at most {timeout:g} s, "
                          "ray.connect_timeout_s). Start one on the head node with `ray start --head --port=6379` and "
                          "pass the address it prints, or leave ray.address unset for a local Ray instance") from None


def _index(p: RoleProc) -> int:
    return int(p.name.rsplit("-", 1)[1])


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
