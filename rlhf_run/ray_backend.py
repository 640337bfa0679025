"""The Ray backend (``launcher=ray``): the run's roles as Ray actors, on one machine or a cluster
(reached by :mod:`rlhf_run.ray_cluster`; what each actor asks of it: :mod:`rlhf_run.ray_plan`).
docs/architecture.md (The run app) and docs/cluster.md describe the placement and the restarts.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from buffer.connection import redact
from rlhf_core.choices import WeightServerAuth
from rlhf_core.cli import write_json
from rlhf_core.config import Config
from rlhf_core.errors import UserError
from rlhf_run import ray_plan as plan
from rlhf_run.ray_cluster import ActorHandle, connect
from rlhf_run.supervisor import PIDS_FILE, REDIS_DIR, Role, RoleExit, RoleKind, first_line

log = logging.getLogger(__name__)

ACTORS_FILE = "actors.json"  # every actor of the run: pid, node, IP, restarts (children.json: this node's)
DIED = -9  # the exit code shown for an actor whose process or node was lost
CALL_TIMEOUT_S = 60.0  # a start-up call to an actor (model-free: Redis, the weight server, where())
INFRA_CHECK_S = 2.0
# (type: ignore[attr-defined] on `.options`: @ray.remote makes a class an ActorClass, which mypy cannot see)


@dataclass
class Actor:
    """One actor of a role (the learner has one per rank): ``Role.handle`` is the list of them."""

    name: str
    log_path: Path
    env: dict[str, str]
    rank: int = 0
    handle: Any = None
    run_ref: Any = None
    where_ref: Any = None
    placed: dict[str, Any] | None = None  # where(): pid, node_id, ip, gpus
    submitted: float = 0.0
    pending_warned: bool = False
    gone: bool = False  # it ended for good: Ray will not restart it, so a restart is a new actor


@dataclass
class RayBackend:
    """The roles as Ray actors (see the module docstring)."""

    cfg: Config
    output_dir: Path
    redis: ActorHandle | None = None
    weight_server: ActorHandle | None = None
    max_restarts: int = 0  # ray.worker.max_restarts
    restart_note: str = ""
    scales: bool = True
    runs_gateway: bool = False  # started by hand where its clients reach it
    ray: Any = None
    driver_node: str = ""
    pg: Any = None
    cfg_plain: dict[str, Any] = field(default_factory=dict)
    _infra_pings: dict[str, Any] = field(default_factory=dict)
    _infra_checked: float = 0.0
    _signals: list[Any] = field(default_factory=list)
    _spread_warned: bool = False

    def __post_init__(self) -> None:
        self.max_restarts = self.cfg.ray.worker.max_restarts
        self.restart_note = f" of {self.max_restarts}, by Ray, where its demand fits"

    # ------------------------------------------------------------------ start

    def connect(self) -> None:
        self.ray, self.driver_node = connect(self.cfg)

    def start_infrastructure(self) -> None:
        cfg = self.cfg
        self.connect()
        ray = self.ray
        from ray.util.placement_group import placement_group

        self.check_fits()
        bundles, selectors = plan.learner_bundles(cfg, self.driver_node)
        self.pg = placement_group(bundles, strategy=cfg.ray.learner.strategy, bundle_label_selector=selectors)
        self.wait_placement_group(f"{cfg.ray.learner.ranks} bundle(s) of {bundles[0]}")
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from rlhf_run.ray_actors import RedisActor, WeightServerActor

        def pinned(role: Any) -> dict[str, Any]:  # Redis and the weight server run on this node
            return {**plan.actor_options(role, labels=False), "runtime_env": {"env_vars": dict(plan.NORMAL_PRIORITY_ENV)},
                    "scheduling_strategy": NodeAffinitySchedulingStrategy(self.driver_node, soft=False)}

        if cfg.buffer.url is None:
            workdir = self.output_dir / REDIS_DIR
            actor = RedisActor.options(**pinned(cfg.ray.redis)).remote()  # type: ignore[attr-defined]
            info = call(ray, actor.start.remote(str(workdir), secrets.token_urlsafe(24)), "the run's redis-server")
            self.redis = ActorHandle(ray, actor, info, workdir=workdir)
            cfg.buffer.url = info["url"]
            log.info("started private redis-server pid %d on %s at %s (data in %s)", self.redis.pid, info["ip"],
                     redact(info["url"]), workdir)
        if cfg.weight_server.address is None:
            if cfg.weight_server.auth == "none":  # other nodes connect: never without authentication
                cfg.weight_server.auth, cfg.weight_server.secret = WeightServerAuth.hmac, secrets.token_hex(32)
            actor = WeightServerActor.options(**pinned(cfg.ray.weight_server)).remote()  # type: ignore[attr-defined]
            info = call(ray, actor.start.remote(plan.plain_config(cfg), str(self.output_dir / "logs" / "weight-server.log")),
                        "the weight server")
            self.weight_server = ActorHandle(ray, actor, info)
            cfg.weight_server.address, cfg.weight_server.pub_address = info["address"], info["pub_address"]
            log.info("weight server at %s (announcements %s), auth %s", info["address"], info["pub_address"],
                     cfg.weight_server.auth)
        self.cfg_plain = plan.plain_config(cfg)  # what every role runs with
        out = self.output_dir.resolve()
        print(f"scale the workers: rlhf-monitor url={redact(cfg.buffer.url)} run_id={cfg.buffer.run_id} workers=N; "
              f"join by hand: rlhf-worker --config-path {out} --config-name run_config", flush=True)
        if cfg.gateway.enabled:  # the workers serve its calls; the gateway runs where clients reach it
            print(f"gateway.enabled: the workers take gateway calls; start the gateway where your agents reach it: "
                  f"rlhf-gateway --config-path {out} --config-name run_config", flush=True)

    def check_fits(self, workers: int | None = None) -> None:
        """The cluster can hold the run's actors (with ``workers`` workers), or a ConfigError naming the resource."""
        cfg = self.cfg
        plan.check_fits(plan.demands(cfg, workers), self.ray.nodes(), cfg.ray.address or "this machine (a local instance)",
                        spread_ranks=cfg.ray.learner.ranks if cfg.ray.learner.strategy == "STRICT_SPREAD" else 0,
                        driver_node=self.driver_node)

    def wait_placement_group(self, what: str) -> None:
        try:
            self.ray.get(self.pg.ready(), timeout=self.cfg.ray.placement_timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            raise UserError(f"the learner's placement group ({what}, strategy {self.cfg.ray.learner.strategy}) was not "
                            f"placed within ray.placement_timeout_s={self.cfg.ray.placement_timeout_s:g} s: no node "
                            "has that room now (other jobs hold it, or a node with it is gone)") from None

    def start(self, role: Role) -> None:
        if role.kind == RoleKind.LEARNER:
            self.start_learner(role)
            return
        env = plan.role_env(self.cfg.ray.worker, role.name if role.kind == RoleKind.WORKER else None)
        role.handle = [actor := Actor(role.name, role.log_path, env)]
        self.place(actor)
        log.info("started %s (a Ray actor), log %s", role.name, role.log_path)

    def start_learner(self, learner: Role) -> None:
        """One actor per rank in the placement group; ranks > 1 get torch.distributed's environment
        from where they landed (rank 0's node is the rendezvous)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlhf_run.ray_actors import RoleActor

        role, logs = self.cfg.ray.learner, learner.log_path.parent
        ranks = [Actor("learner" if r == 0 else f"learner-{r}", logs / ("learner.log" if r == 0 else f"learner-{r}.log"),
                       plan.role_env(role), rank=r) for r in range(role.ranks)]
        for a in ranks:
            strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=a.rank)
            a.handle = RoleActor.options(**plan.actor_options(role, labels=False), scheduling_strategy=strategy,  # type: ignore[attr-defined]
                                         runtime_env={"env_vars": a.env}).remote()
        learner.handle = ranks
        placed = [call(self.ray, a.handle.where.remote(), f"learner rank {a.rank}") for a in ranks]
        envs = plan.rank_envs([(w["ip"], w["gpus"]) for w in placed], placed[0]["free_port"]) if role.ranks > 1 \
            else [{}]
        for a, where, env in zip(ranks, placed, envs):
            a.placed, a.submitted = where, time.monotonic()
            a.run_ref = a.handle.run.remote(RoleKind.LEARNER.value, self.cfg_plain, env, str(a.log_path), os.getcwd())
            log.info("started %s on %s (pid %d), log %s", a.name, where["ip"], where["pid"], a.log_path)

    def worker_options(self) -> dict[str, Any]:
        """A worker's (or the evaluator's) actor options, placed as ``ray.worker.strategy`` says
        (:func:`rlhf_run.ray_plan.worker_strategy`, on the cluster as it is now)."""
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

    def place(self, a: Actor) -> None:
        """A new actor for a worker or the evaluator, placed on the cluster as it is now."""
        from rlhf_run.ray_actors import RoleActor

        a.handle = RoleActor.options(**self.worker_options(), runtime_env={"env_vars": a.env}).remote()  # type: ignore[attr-defined]
        self.submit(a)

    def submit(self, a: Actor) -> None:
        """Ask the actor where it is; once it answers (placed, or back after Ray restarted it),
        :meth:`poll_placement` has it run its role."""
        a.where_ref, a.placed, a.submitted, a.pending_warned = a.handle.where.remote(), None, time.monotonic(), False

    def write_pids(self, roles: list[Role]) -> None:
        """children.json: the launcher and the processes on this node (what ``resume=`` checks);
        actors.json: every actor of the run with its node."""
        local: dict[str, int] = {"launcher": os.getpid()}
        everywhere: dict[str, Any] = {}
        for role, a in _actors(roles):
            if a.placed is not None:
                everywhere[a.name] = {k: a.placed[k] for k in ("pid", "node_id", "ip")} | {"restarts": role.restarts}
                if a.placed["node_id"] == self.driver_node:
                    local[a.name] = int(a.placed["pid"])
        for name, handle in (("redis", self.redis), ("weight_server", self.weight_server)):
            if handle is not None:
                everywhere[name] = {k: handle.info[k] for k in ("pid", "node_id", "ip")}
                if handle.info["node_id"] == self.driver_node:
                    local[name] = handle.pid
        write_json(self.output_dir / PIDS_FILE, local)
        write_json(self.output_dir / ACTORS_FILE, everywhere, indent=1)

    # ------------------------------------------------------------------ watch

    def poll(self, roles: list[Role]) -> list[RoleExit]:
        ray = self.ray
        exits = self.poll_placement(roles)
        running = {a.run_ref: (role, a) for role, a in _actors(roles) if a.run_ref is not None}
        for ref in ray.wait(list(running), num_returns=len(running), timeout=0)[0] if running else []:
            role, a = running[ref]
            a.run_ref = None
            code, error, a.gone = outcome(ray, ref)
            if role.kind == RoleKind.LEARNER and code == 0 and a.rank != 0:
                continue  # rank 0 says when the learner is done
            if not any(e.role is role for e in exits):  # a learner's first rank to end speaks for all of them
                exits.append(RoleExit(role, code, error, a.log_path, note=error or "no error line", lost=code == DIED))
        return exits

    def poll_placement(self, roles: list[Role]) -> list[RoleExit]:
        """Actors that answered where they are (first start, or back after a restart) run their
        role; one Ray is still restarting is asked again; one that died before it answered ended."""
        ray = self.ray
        waiting = {a.where_ref: (role, a) for role, a in _actors(roles) if a.where_ref is not None}
        done = ray.wait(list(waiting), num_returns=len(waiting), timeout=0)[0] if waiting else []
        exits = []
        for ref in done:
            role, a = waiting[ref]
            a.where_ref = None
            try:
                a.placed = ray.get(ref)
            except ray.exceptions.ActorUnavailableError:  # Ray is (re)starting it: ask again next round
                a.where_ref = a.handle.where.remote()
                continue
            except ray.exceptions.RayError as exc:
                a.gone, error = True, f"the actor died: {first_line(exc)}"
                exits.append(RoleExit(role, DIED, error, a.log_path, note=error, lost=True))
                continue
            log.info("%s runs on %s (pid %d)", a.name, a.placed["ip"], a.placed["pid"])
            a.run_ref = a.handle.run.remote(role.kind.value, self.cfg_plain, {}, str(a.log_path), os.getcwd())
        if done:
            self.write_pids(roles)
        limit = self.cfg.ray.placement_timeout_s
        for _, a in waiting.values():
            if a.where_ref is not None and not a.pending_warned and time.monotonic() - a.submitted > limit:
                a.pending_warned = True
                log.warning("%s is not placed after %.0f s: no node has room for %s now (it starts when one has)",
                            a.name, limit, plan.role_resources(self.cfg.ray.worker))
        return exits

    def infrastructure_lost(self) -> str:
        """The weight server's and Redis's actors still answer (asked every few seconds, never waited on)."""
        ray = self.ray
        for name, ref in list(self._infra_pings.items()):
            if not ray.wait([ref], timeout=0)[0]:
                continue
            del self._infra_pings[name]
            try:
                why = "" if ray.get(ref) else "its process exited"
            except ray.exceptions.RayError as exc:
                why = first_line(exc)
            if why:
                return f"the run's {name} is gone ({why}); the run's state is kept: rlhf-run resume={self.output_dir}"
        if time.monotonic() - self._infra_checked > INFRA_CHECK_S:
            self._infra_checked = time.monotonic()
            for name, handle in (("redis-server", self.redis), ("weight server", self.weight_server)):
                if handle is not None and name not in self._infra_pings:
                    self._infra_pings[name] = handle.actor.ping.remote()
        return ""

    def restart(self, role: Role, ended: RoleExit) -> None:
        """The learner: all its ranks anew. Another role: a new actor when Ray will not restart the
        one it had (``gone``), else a fresh process of the same actor (Ray restarts it)."""
        if role.kind == RoleKind.LEARNER:
            self.restart_learner(role)
            return
        a = role.handle[0]
        if a.gone:
            self.place(a)
            return
        if ended.code != DIED:  # the process lives on: Ray starts a fresh one, as a restarted child is
            self.ray.kill(a.handle, no_restart=False)
        self.submit(a)

    def restart_learner(self, learner: Role) -> None:
        """All ranks anew (a torch.distributed group does not survive one rank), in the placement
        group Ray re-places when a node was lost. A rank that lands on a node Ray has not declared
        dead yet and dies unstarted is placed again, until ``ray.placement_timeout_s``."""
        deadline = time.monotonic() + self.cfg.ray.placement_timeout_s
        while True:
            self.kill(learner)
            self.wait_placement_group(f"{self.cfg.ray.learner.ranks} rank(s)")
            try:
                self.start_learner(learner)
                return
            except self.ray.exceptions.RayActorError as exc:
                if time.monotonic() > deadline:
                    raise UserError(f"the learner's ranks kept dying before they started ({first_line(exc)}) for "
                                    f"ray.placement_timeout_s={self.cfg.ray.placement_timeout_s:g} s") from None
                log.warning("a learner rank died before it started (%s): placing the ranks again", first_line(exc))

    def stop(self, role: Role) -> bool:
        placed = role.handle[0].placed
        if placed is None:
            return False
        self.signal(placed, signal.SIGTERM)
        return True

    def kill(self, role: Role) -> None:
        for a in role.handle or ():
            self.ray.kill(a.handle)

    def tail(self, ended: RoleExit, lines: int = 20) -> str:
        """A log's last lines: here when its node is this one (or the folder is shared), else read there."""
        if ended.log_path.is_file():
            return "\n".join(ended.log_path.read_text(errors="replace").splitlines()[-lines:])
        a = next((a for a in ended.role.handle or () if a.log_path == ended.log_path), None)
        if a is None or a.placed is None:
            return "(no log)"
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from rlhf_run.ray_actors import read_tail

        try:
            strategy = NodeAffinitySchedulingStrategy(a.placed["node_id"], soft=False)
            return self.ray.get(read_tail.options(scheduling_strategy=strategy).remote(str(a.log_path), lines), timeout=10)
        except Exception as exc:  # the node is gone with the log
            return f"(its log on {a.placed['ip']} cannot be read: {first_line(exc)})"

    def signal(self, placed: dict[str, Any], sig: int) -> None:
        """``sig`` to a placed actor's process, sent from its node (as the launcher signals a child)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from rlhf_run.ray_actors import signal_process

        strategy = NodeAffinitySchedulingStrategy(placed["node_id"], soft=False)
        self._signals = [r for r in self._signals if not self.ray.wait([r], timeout=0)[0]]
        self._signals.append(signal_process.options(scheduling_strategy=strategy).remote(int(placed["pid"]), sig))

    # ------------------------------------------------------------------ stop

    def stop_all(self, roles: list[Role], grace_s: float) -> None:
        ray = self.ray
        for _, a in _actors(roles):
            a.where_ref = None  # nothing more starts
            if a.run_ref is not None and a.placed is not None:
                self.signal(a.placed, signal.SIGTERM)
        # The roles' grace starts once the signals (Ray tasks on their nodes) have landed.
        if self._signals:
            ray.wait(list(self._signals), num_returns=len(self._signals), timeout=grace_s)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            running = {a.run_ref: (role, a) for role, a in _actors(roles) if a.run_ref is not None}
            if not running:
                break
            for ref in ray.wait(list(running), num_returns=len(running), timeout=0.5)[0]:
                role, a = running[ref]
                a.run_ref = None
                code = outcome(ray, ref)[0]
                if a.rank == 0 and role.exit_code is None:  # a learner's: rank 0's
                    role.exit_code = code
        for _, a in _actors(roles):
            if a.run_ref is not None:
                log.warning("%s did not stop within %.0f s: killing it", a.name, grace_s)
                a.run_ref = None
            ray.kill(a.handle)

    def running(self, roles: list[Role]) -> bool:
        return any(a.run_ref is not None for _, a in _actors(roles))

    def shutdown(self) -> None:
        if self.ray is None:
            return
        for handle in (self.weight_server, self.redis):
            if handle is not None:
                handle.stop()
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
            self.pg = None
        self.ray.shutdown()
        self.ray = None


def call(ray: Any, ref: Any, what: str, timeout: float = CALL_TIMEOUT_S) -> Any:
    """``ray.get`` a start-up call: a user error raised in the actor stays one; a timeout says what."""
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise UserError(f"{what} did not start within {timeout:g} s (no node has room for its actor, or its node "
                        "is overloaded)") from None
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, UserError):
            raise exc.cause from None
        raise


def outcome(ray: Any, ref: Any) -> tuple[int, str, bool]:
    """(exit code, error line, whether the actor is gone for good) of a finished call."""
    try:
        result = ray.get(ref)
        return int(result["code"]), str(result.get("error", "")), False
    except ray.exceptions.ActorDiedError as exc:  # no restart left, or killed for good
        return DIED, f"the actor died: {first_line(exc)}", True
    except ray.exceptions.RayActorError as exc:  # its process or its node was lost: Ray restarts it
        return DIED, f"the actor died: {first_line(exc)}", False
    except ray.exceptions.RayError as exc:
        return 1, first_line(exc), False


def _actors(roles: list[Role]) -> list[tuple[Role, Actor]]:
    return [(role, a) for role in roles for a in role.handle or ()]
