"""What a ``launcher=ray`` run asks of the cluster, worked out without Ray: each actor's demand,
whether the cluster can hold them, the learner's placement-group bundles, the workers' scheduling
strategy, the torch.distributed environment of the learner's ranks, and each role's options. Pure
functions of the config and of ``ray.nodes()``; :mod:`rlhf_run.ray_backend` applies them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf

from rlhf_core.cli import WORKER_ID_ENV
from rlhf_core.config import Config, ConfigError, RayRoleConfig, to_object

#: the label Ray gives every node: its id (a bundle's label selector pins it to that node)
NODE_ID_LABEL = "ray.io/node-id"
#: Ray starts an actor's process at niceness 15 unless its runtime_env says otherwise, and the
#: run's roles would yield the CPU to any other process of the node: they run at the normal priority.
NORMAL_PRIORITY_ENV = {"RAY_worker_niceness": "0"}


@dataclass(frozen=True)
class Demand:
    """One actor's ask: logical CPUs, GPUs and custom resources, on a node with these labels
    (``on_driver``: on the node running rlhf-run)."""

    name: str
    resources: dict[str, float]
    labels: dict[str, str] = field(default_factory=dict)
    on_driver: bool = False

    def text(self) -> str:
        ask = ", ".join(f"{k} {_num(v)}" for k, v in self.resources.items() if v)
        on = f" on a node labelled {self.labels}" if self.labels else ""
        return f"{self.name} ({ask or 'nothing'}{on})"


def role_resources(role: RayRoleConfig) -> dict[str, float]:
    """``{"CPU": .., "GPU": .., custom...}`` with the zero entries left out."""
    out = {"CPU": float(role.num_cpus), "GPU": float(role.num_gpus), **{k: float(v) for k, v in role.resources.items()}}
    return {k: v for k, v in out.items() if v}


def demands(cfg: Config, workers: int | None = None) -> list[Demand]:
    """Every actor the run starts: Redis (when no ``buffer.url``), the weight server, the learner's
    ranks, ``workers`` (default ``rollout.num_workers``) workers and the evaluator (``eval.every``)."""
    r = cfg.ray
    out = []
    if cfg.buffer.url is None:
        out.append(Demand("redis", role_resources(r.redis), on_driver=True))
    out.append(Demand("weight_server", role_resources(r.weight_server), on_driver=True))
    out += [Demand(f"learner rank {i}", role_resources(r.learner), dict(r.learner.label_selector),
                   on_driver=i == 0 and r.learner.on_driver_node) for i in range(r.learner.ranks)]
    n = cfg.rollout.num_workers if workers is None else workers
    out += [Demand(f"worker-{i}", role_resources(r.worker), dict(r.worker.label_selector)) for i in range(n)]
    if cfg.eval.every:
        out.append(Demand("evaluator", role_resources(r.worker), dict(r.worker.label_selector)))
    return out


def check_fits(wanted: Sequence[Demand], nodes: Sequence[Mapping[str, Any]], address: str,
               spread_ranks: int = 0, driver_node: str | None = None) -> None:
    """Refuse, naming the resource, a placement the cluster cannot hold: more of a resource in all
    than its alive nodes have, one actor no single node can hold, the actors pinned to the node
    running rlhf-run (``driver_node``) more than it holds, or ``spread_ranks`` STRICT_SPREAD ranks
    with fewer nodes. Not a full bin packing: Ray may still leave what passes pending."""
    alive = [n for n in nodes if n.get("Alive", True)]
    have = _sum(n.get("Resources", {}) for n in alive)
    total = _sum(d.resources for d in wanted)
    for k, v in total.items():
        if v > have.get(k, 0.0) + 1e-9:
            askers = [f"{d.name} {_num(d.resources[k])}" for d in wanted if d.resources.get(k)]
            shown = ", ".join(askers if len(askers) <= 6 else [*askers[:5], f"... {len(askers) - 5} more"])
            raise ConfigError(
                f"the run asks for {_num(v)} {k} in all ({shown}) but the Ray cluster at {address} has "
                f"{_num(have.get(k, 0.0))} {k} on {len(alive)} alive node(s); lower ray.<role>.num_cpus / num_gpus / "
                f"resources or rollout.num_workers, or add nodes (ray start --address=...)")
    for d in wanted:
        if not any(_holds(node, d) for node in alive):
            raise ConfigError(
                f"no node of the Ray cluster at {address} can hold {d.text()}: the largest node has "
                f"{_largest(alive, d)}; change ray.<role> settings or start a node that has them")
    pinned = [d for d in wanted if d.on_driver]
    here = next((n for n in alive if n.get("NodeID") == driver_node), None)
    together = Demand(", ".join(d.name for d in pinned), _sum(d.resources for d in pinned),
                      {k: v for d in pinned for k, v in d.labels.items()})
    if here is not None and not _holds(here, together):
        res, labels = here.get("Resources", {}), here.get("Labels") or {}
        has = [", ".join(f"{k} {_num(float(res.get(k, 0.0)))}" for k in together.resources)] if together.resources else []
        has += [f"{k}={labels.get(k, '(unset)')}" for k in together.labels]
        rank0 = any(d.name.startswith("learner") for d in pinned)
        raise ConfigError(
            f"{together.text()} runs on the node running rlhf-run{' (ray.learner.on_driver_node)' if rank0 else ''}, "
            f"which has {' and '.join(has)}: run rlhf-run on a node with that room"
            + (", or ray.learner.on_driver_node=false (rank 0 anywhere; its output folder then on a filesystem every "
               "node mounts)" if rank0 else ""))
    if spread_ranks > len(alive):
        raise ConfigError(f"ray.learner.strategy=STRICT_SPREAD puts each of the {spread_ranks} learner ranks on its own "
                          f"node, but the Ray cluster at {address} has {len(alive)} alive node(s)")


def _sum(resources: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in resources:
        for k, v in r.items():
            out[k] = out.get(k, 0.0) + float(v)
    return out


def _holds(node: Mapping[str, Any], d: Demand) -> bool:
    res, labels = node.get("Resources", {}), node.get("Labels", {}) or {}
    return all(float(res.get(k, 0.0)) + 1e-9 >= v for k, v in d.resources.items()) and \
        all(_label_matches(labels.get(k), v) for k, v in d.labels.items())


def _label_matches(label: str | None, selector: str) -> bool:
    """Ray's label selector values: ``v``, ``in(a, b)`` and their negations ``!v``, ``!in(a, b)``,
    which a node without the label matches."""
    body = selector.removeprefix("!")
    group = body.removeprefix("in")
    values = {v.strip() for v in group[1:-1].split(",")} if group.startswith("(") and group.endswith(")") else {body}
    return (label in values) != selector.startswith("!")


def _largest(nodes: Sequence[Mapping[str, Any]], d: Demand) -> str:
    return ", ".join(f"{k} {_num(max((float(n.get('Resources', {}).get(k, 0.0)) for n in nodes), default=0.0))}"
                     for k in d.resources) + (" (and no node has those labels)" if d.labels else "")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def worker_strategy(cfg: Config, nodes: Sequence[Mapping[str, Any]]) -> tuple[str, int]:
    """Ray's scheduling strategy for a worker or the evaluator, and how many alive nodes could hold
    one: SPREAD (``ray.worker.strategy``) where more than one could, else DEFAULT."""
    role = cfg.ray.worker
    one = Demand("worker", role_resources(role), dict(role.label_selector))
    fit = sum(1 for n in nodes if n.get("Alive", True) and _holds(n, one))
    return ("SPREAD" if role.strategy == "SPREAD" and fit > 1 else "DEFAULT"), fit


def learner_bundles(cfg: Config, driver_node: str) -> tuple[list[dict[str, float]], list[dict[str, str]]]:
    """The learner's placement group: one bundle per rank and each bundle's label selector; with
    ``ray.learner.on_driver_node`` rank 0's is pinned to the node that runs rlhf-run."""
    role = cfg.ray.learner
    bundles = [role_resources(role) for _ in range(role.ranks)]
    selectors = [dict(role.label_selector) for _ in range(role.ranks)]
    if role.on_driver_node:
        selectors[0][NODE_ID_LABEL] = driver_node
    return bundles, selectors


def rank_envs(placed: Sequence[tuple[str, Sequence[int | str]]], master_port: int) -> list[dict[str, str]]:
    """The torch.distributed environment of each learner rank from where its actor landed:
    ``placed[r] = (node ip, GPU ids Ray gave rank r)``. Rank 0's node is the rendezvous
    (MASTER_ADDR/PORT); LOCAL_RANK counts the ranks on one node, and on GPUs every rank of a
    node sees that node's learner GPUs in rank order, so ``set_device(LOCAL_RANK)`` picks its own."""
    world = len(placed)
    by_node: dict[str, list[int]] = {}
    for rank, (ip, _) in enumerate(placed):
        by_node.setdefault(ip, []).append(rank)
    envs = []
    for rank, (ip, gpus) in enumerate(placed):
        local = by_node[ip]
        env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local.index(rank)),
               "LOCAL_WORLD_SIZE": str(len(local)), "MASTER_ADDR": placed[0][0], "MASTER_PORT": str(master_port)}
        node_gpus = [str(g) for r in local for g in placed[r][1]]
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpus)
        envs.append(env)
    return envs


def role_env(role: RayRoleConfig, worker_id: str | None = None) -> dict[str, str]:
    """The environment an actor's process starts with (Ray's ``runtime_env``), as a child of the
    one-machine launcher gets it: torch threads = the role's CPUs (unless OMP_NUM_THREADS is set
    here), the worker id, unbuffered output, the normal CPU priority and this PYTHONPATH."""
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(max(1, math.floor(role.num_cpus))),
           "PYTHONUNBUFFERED": "1", **NORMAL_PRIORITY_ENV}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    if worker_id is not None:
        env[WORKER_ID_ENV] = worker_id
    return env


def actor_options(role: RayRoleConfig, labels: bool = True) -> dict[str, Any]:
    """``ActorClass.options(...)`` for a role: its resources, restarts and (``labels``; not for
    an actor in a placement group bundle, whose selector is the bundle's) its node labels."""
    opts: dict[str, Any] = {"num_cpus": float(role.num_cpus), "num_gpus": float(role.num_gpus),
                            "max_restarts": int(role.max_restarts)}
    if role.resources:
        opts["resources"] = {k: float(v) for k, v in role.resources.items()}
    if labels and role.label_selector:
        opts["label_selector"] = dict(role.label_selector)
    return opts


def plain_config(cfg: Config) -> dict[str, Any]:
    """The resolved config as plain data (what travels to the actors: no objects of ours)."""
    # a structured config's container is a dict; OmegaConf types it as any container
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def config_from_plain(data: Mapping[str, Any]) -> Config:
    """The typed config back from :func:`plain_config`'s dict (an actor's first step)."""
    return to_object(OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(dict(data))))
