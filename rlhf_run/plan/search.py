"""Plan search: the feasible settings of a run (:func:`candidates`), ranked by simulated trained
samples/s (:func:`search`), with the Hydra overrides that run them. On a GPU profile memory rules
out what cannot fit (:func:`memory_problems`) and the learner gets the fastest ZeRO stage and
micro-batch that fit (:func:`fastest_learner`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from rlhf_core.errors import UserError
from rlhf_run.plan.bounds import estimate, likely_rate, upper_bound
from rlhf_run.plan.profile import Profile
from rlhf_run.plan.records import Plan, SimResult
from rlhf_run.plan.simulate import same_run, simulate


class PlanError(UserError):
    """A request no plan can satisfy (more devices than given, a lookahead the bound forbids)."""


@dataclass(frozen=True)
class Request:
    """What the user gives: the devices (GPU profile) or cores (CPU profile), bounds, the base plan."""

    base: Plan
    gpus: int | None = None
    nodes: int = 1
    max_staleness: int = 2  # the largest staleness bound the user accepts
    max_workers: int = 3  # CPU profile: processes beside the learner
    batch_sizes: tuple[int, ...] = ()  # empty: the base plan's batch only (the batch changes the algorithm)
    lookahead_fixed: bool = False  # the user set buffer.lookahead: search only that one (else 0 .. staleness)


def plan_from_config(cfg: Any) -> Plan:
    from rlhf_core.config import replay_mode

    if replay_mode(cfg.buffer):  # the simulator trains each group once, in order
        b = cfg.buffer
        raise PlanError(f"rlhf-plan models a FIFO buffer only; this config runs it in replay mode (buffer.max_reuse="
                        f"{b.max_reuse}, buffer.samples_per_insert={'null' if b.samples_per_insert is None else b.samples_per_insert}, "
                        f"buffer.sampling={b.sampling}), whose reuse and rate limiter it does not simulate: plan the "
                        "run with buffer.max_reuse=1 buffer.samples_per_insert=null buffer.sampling=fifo")
    devices = cfg.learner.devices
    return Plan(
        workers=int(cfg.rollout.num_workers), slots=int(cfg.rollout.slots), batch_size=int(cfg.learner.batch_size),
        micro_batch_size=int(cfg.learner.micro_batch_size), num_minibatches=int(cfg.learner.num_minibatches),
        group_size=int(cfg.algo.group_size),
        max_staleness=int(cfg.algo.max_staleness), lookahead=cfg.buffer.lookahead,
        checkpoint_every=int(cfg.learner.checkpoint_every), learner_devices=len(devices) if devices else 1,
        zero_stage=int(cfg.learner.zero_stage) if cfg.learner.engine == "deepspeed" else 0,
        reward_batch_size=int(cfg.reward.batch_size), reward_max_wait_s=float(cfg.reward.max_wait_ms) / 1000.0,
    )


def overrides(plan: Plan, gpu: bool) -> list[str]:
    """The Hydra overrides of ``rlhf-run`` that run ``plan``."""
    out = [f"rollout.num_workers={plan.workers}", f"rollout.slots={plan.slots}",
           f"learner.batch_size={plan.batch_size}", f"learner.micro_batch_size={plan.micro_batch_size}",
           f"algo.max_staleness={plan.max_staleness}",
           f"buffer.lookahead={'null' if plan.lookahead is None else plan.lookahead}"]
    if gpu:
        learner = list(range(plan.learner_devices))
        rollout = list(range(plan.learner_devices, plan.learner_devices + plan.workers))
        out += [f"learner.devices=[{','.join(map(str, learner))}]", f"rollout.devices=[{','.join(map(str, rollout))}]"]
        if plan.zero_stage:
            out += ["learner.engine=deepspeed", f"learner.zero_stage={plan.zero_stage}"]
    return out


def spans_nodes(plan: Plan, request: Request) -> bool:
    """Whether ``plan`` needs more GPUs than one node of the request has: the local launcher,
    which runs every role on its machine, cannot run it (``launcher=ray`` can)."""
    return request.gpus is not None and plan.workers + plan.learner_devices > request.gpus // max(1, request.nodes)


def ray_overrides(plan: Plan, gpu: bool, gpus_per_node: int = 8) -> list[str]:
    """The same plan under ``launcher=ray`` (on top of :func:`overrides` less its device lists,
    which only the local launcher reads): a GPU per worker and per learner rank, the ranks in
    one placement group packed onto as few nodes as hold them (one node: NVLink only)."""
    out = ["launcher=ray", f"ray.learner.ranks={plan.learner_devices}"]
    if gpu:
        strategy = "STRICT_PACK" if plan.learner_devices <= gpus_per_node else "PACK"
        out += ["ray.learner.num_gpus=1", "ray.worker.num_gpus=1", f"ray.learner.strategy={strategy}"]
    return out


# ---- feasibility ----------------------------------------------------------------------------


def check_plan(plan: Plan, request: Request, profile: Profile) -> list[str]:
    """Why ``plan`` cannot run (empty: it can)."""
    why = []
    if plan.batch_size % plan.group_size:
        why.append(f"learner.batch_size {plan.batch_size} is not a multiple of algo.group_size {plan.group_size}")
    if plan.batch_size % plan.num_minibatches:
        why.append(f"learner.batch_size {plan.batch_size} is not a multiple of learner.num_minibatches {plan.num_minibatches}")
    elif not 1 <= plan.micro_batch_size <= plan.batch_size // plan.num_minibatches:
        why.append(f"learner.micro_batch_size {plan.micro_batch_size} is outside 1..{plan.batch_size // plan.num_minibatches} "
                   f"(the minibatch: learner.batch_size / learner.num_minibatches)")
    if plan.max_staleness > request.max_staleness:
        why.append(f"algo.max_staleness {plan.max_staleness} is above the bound {request.max_staleness}")
    if plan.lookahead is not None and plan.lookahead > plan.max_staleness:
        why.append(f"buffer.lookahead {plan.lookahead} is above algo.max_staleness {plan.max_staleness}")
    if plan.workers < 1 or plan.slots < 1:
        why.append("a plan needs at least one worker with at least one slot")
    if profile.kind == "gpu":
        devices = plan.workers + plan.learner_devices
        if request.gpus is not None and devices > request.gpus:
            why.append(f"{plan.workers} worker(s) + {plan.learner_devices} learner device(s) need {devices} GPUs; "
                       f"{request.gpus} given")
        if plan.batch_size % plan.learner_devices:
            why.append(f"learner.batch_size {plan.batch_size} does not split over {plan.learner_devices} learner devices")
        why += memory_problems(plan, profile)
    elif plan.workers > request.max_workers:
        why.append(f"{plan.workers} workers is above --max-workers {request.max_workers}")
    return why


def memory_problems(plan: Plan, profile: Profile) -> list[str]:
    """GPU memory: the learner's ZeRO states and activations, a worker's weights and KV cache."""
    shape, cap = profile.identity.get("shape") or {}, profile.machine.device_memory_bytes * 0.9
    if not shape or cap <= 0:
        return []
    params, devices = float(shape["params"]), plan.learner_devices
    states = {0: 16 * params, 1: 4 * params + 12 * params / devices, 2: 2 * params + 14 * params / devices,
              3: 16 * params / devices}[plan.zero_stage]
    gen = profile.generation
    seq = max(gen.prompt_tokens.values) + gen.max_new_tokens
    # gradient checkpointing: each layer's input kept, one layer's activations (34 h bytes per
    # token, Korthikanti et al. 2022) and the fp32 logits of a chunk of 1,024 tokens live at once
    per_token = 2 * shape["hidden"] * shape["layers"] + 34 * shape["hidden"]
    act = plan.micro_batch_size * seq * per_token + 1024 * shape["vocab"] * 4
    out = []
    if states + act > cap:
        out.append(f"learner: ZeRO-{plan.zero_stage} states {states / 1e9:.1f} GB + activations of micro-batch "
                   f"{plan.micro_batch_size} {act / 1e9:.1f} GB exceed {cap / 1e9:.0f} GB per device")
    kv = plan.slots * seq * shape["kv_bytes_per_token"]
    if 2 * params + kv > cap:
        out.append(f"rollout: weights {2 * params / 1e9:.1f} GB + KV cache of {plan.slots} slots x {seq} tokens "
                   f"{kv / 1e9:.1f} GB exceed {cap / 1e9:.0f} GB per device")
    return out


def check_request(request: Request, profile: Profile) -> None:
    """Refuse a request no plan can satisfy, saying what to change."""
    base = request.base
    if request.max_staleness < 0:
        raise PlanError(f"the staleness bound must be >= 0, got {request.max_staleness}")
    if request.lookahead_fixed and base.lookahead is not None and base.lookahead > request.max_staleness:
        raise PlanError(
            f"buffer.lookahead={base.lookahead} with a staleness bound of {request.max_staleness}: samples generated "
            f"{base.lookahead} batch(es) ahead are at least that many versions old when trained, so every one would "
            f"be dropped. Lower buffer.lookahead to <= {request.max_staleness} (0 is synchronous) or allow more "
            "staleness (--max-staleness / algo.max_staleness)")
    if profile.kind == "cpu" and request.gpus is not None:
        raise PlanError("--gpus applies to a GPU profile; this profile was measured on CPUs, where the processes "
                        "share the machine's cores (drop --gpus; --max-workers bounds the workers)")
    if profile.kind == "gpu":
        if request.gpus is None or request.gpus < 2:
            raise PlanError(f"a GPU plan needs --gpus >= 2 (one learner device and one rollout worker at least), "
                            f"got {request.gpus}")
        if request.nodes < 1 or request.gpus % request.nodes:
            raise PlanError(f"--gpus {request.gpus} does not divide over --nodes {request.nodes}")
        per_node = request.gpus // request.nodes
        if per_node > profile.machine.gpus_per_node:
            raise PlanError(f"{per_node} GPUs per node asked, the profile's nodes have {profile.machine.gpus_per_node}: "
                            f"use --nodes {math.ceil(request.gpus / profile.machine.gpus_per_node)} or more")


# ---- enumeration ------------------------------------------------------------------------------


def _pacing(request: Request) -> Iterable[tuple[int, int | None]]:
    for staleness in range(request.max_staleness + 1):
        if request.lookahead_fixed:
            lookahead = request.base.lookahead
            if lookahead is None or lookahead <= staleness:
                yield staleness, lookahead
            continue
        for lookahead in range(staleness + 1):
            yield staleness, lookahead


def candidates(request: Request, profile: Profile) -> list[Plan]:
    base = request.base
    batches = request.batch_sizes or (base.batch_size,)
    out: list[Plan] = []
    if profile.kind == "cpu":
        for batch in batches:
            minibatch = max(1, batch // base.num_minibatches)  # the largest micro-batch
            for workers in range(1, request.max_workers + 1):
                for slots in sorted({batch // 2, batch, 2 * batch, 4 * batch} - {0}):
                    for micro in sorted({minibatch, max(1, minibatch // 2)}):
                        for staleness, lookahead in _pacing(request):
                            out.append(replace(base, workers=workers, slots=slots, batch_size=batch, micro_batch_size=micro,
                                               max_staleness=staleness, lookahead=lookahead, learner_devices=1, zero_stage=0))
        return [p for p in out if not check_plan(p, request, profile)]
    gpus = int(request.gpus or 0)
    learner_sizes = sorted({d for d in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if d < gpus})
    for batch in batches:
        for devices in learner_sizes:
            learner = fastest_learner(replace(base, batch_size=batch, learner_devices=devices), request, profile)
            if learner is None:
                continue
            # every other GPU a worker, or fewer (workers pulling every version can cost more than they add)
            for workers in sorted({gpus - devices} | {w for w in learner_sizes if w < gpus - devices}):
                for slots in (64, 128, 256, 512):
                    for staleness, lookahead in _pacing(request):
                        plan = replace(learner, workers=workers, slots=slots, max_staleness=staleness, lookahead=lookahead)
                        if not check_plan(plan, request, profile):
                            out.append(plan)
    return out


def fastest_learner(plan: Plan, request: Request, profile: Profile) -> Plan | None:
    """The ZeRO stage and micro-batch that fit and train fastest (None: nothing fits)."""
    best, best_s = None, math.inf
    tokens = plan.batch_size * (profile.generation.prompt_tokens.mean() + profile.generation.response_tokens.mean())
    for zero in (1, 2, 3):
        for micro in (1, 2, 4, 8, 16, 32):
            cand = replace(plan, zero_stage=zero, micro_batch_size=micro, slots=1)
            if (plan.batch_size % (micro * plan.learner_devices) or micro > plan.batch_size // plan.num_minibatches
                    or memory_problems(cand, profile)):
                continue
            t = profile.learner.update_s(plan.batch_size, tokens, micro, plan.learner_devices, zero,
                                         profile.machine.gpus_per_node)
            if t < best_s:
                best, best_s = replace(plan, zero_stage=zero, micro_batch_size=micro), t
    return best


@dataclass
class Ranked:
    plan: Plan
    result: SimResult


def tightest_staleness(plan: Plan, result: SimResult) -> Plan:
    """``plan`` with the least staleness bound that runs the same simulation (:func:`same_run`):
    a bound nothing in ``result``'s run came near changes nothing but what it would allow."""
    for bound in range(plan.ahead, plan.max_staleness):
        other = replace(plan, max_staleness=bound)
        if same_run(plan, result, other):
            return other
    return plan


def _key(r: Ranked) -> tuple[float, float]:
    return -round(r.result.trained_samples_per_s, 6), r.result.staleness_mean


def search(request: Request, profile: Profile, top: int = 5, simulate_at_most: int | None = None, updates: int = 200,
           seed: int = 0, exhaustive: bool = False, ties: bool = True, cache: dict | None = None,
           stats: dict | None = None) -> list[Ranked]:
    """The feasible plans, best first (simulated trained samples/s; fewer stale samples on ties).

    A CPU profile's few plans are all simulated. A GPU profile's (thousands) are searched by branch
    and bound: simulated most promising first (:func:`~rlhf_run.plan.bounds.likely_rate`) until no
    plan left has an :func:`~rlhf_run.plan.bounds.upper_bound` above the ``top``-th best simulated
    rate; what is left could not have ranked, so the result is the exhaustive search's (as far as the bound holds). With ``ties``
    (the default) a plan whose bound only equals that rate is simulated too (it may tie and win on
    staleness); without, the search stops there (the rates are the exhaustive search's, a tie may
    be broken among fewer plans). ``exhaustive``: simulate every plan; ``simulate_at_most``: stop
    after that many new simulations even if the bound has not closed (``stats`` says so);
    ``cache``: simulated results by plan, shared by searches of one profile (a table over device
    counts); ``stats``: filled with the counts of plans (``candidates``, ``simulated``, ``replayed``
    from a run that differs only in the staleness bound, ``cached``), ``exact`` (the bound closed)
    and ``gap`` (how far above the ``top``-th rate the best plan not simulated could still be)."""
    check_request(request, profile)
    plans = candidates(request, profile)
    if not plans:
        raise PlanError("no plan fits: " + "; ".join(check_plan(request.base, request, profile) or
                                                     ["every candidate breaks a memory or device limit"]))
    warmup = max(5, updates // 10)
    cache = {} if cache is None else cache
    counts: dict[str, Any] = {"candidates": len(plans), "simulated": 0, "replayed": 0, "cached": 0}

    def run(p: Plan) -> SimResult:
        key = (p, updates, warmup, seed)
        if key in cache:
            counts["cached"] += 1
            return cache[key]
        # a plan that differs only in its staleness bound replays a run that never dropped (same_run)
        kin = ("kin", replace(p, max_staleness=-1), updates, warmup, seed)
        for q, r in cache.get(kin, ()):
            if same_run(q, r, p):
                counts["replayed"] += 1
                cache[key] = r
                return r
        cache[key] = r = simulate(profile, p, updates=updates, warmup=warmup, seed=seed)
        cache.setdefault(kin, []).append((p, r))
        counts["simulated"] += 1
        return r

    if profile.kind != "gpu" or exhaustive:
        ranked = [Ranked(p, run(p)) for p in sorted(plans, key=lambda p: -estimate(p, profile))]
        counts.update(exact=True, gap=0.0)
    else:
        bound = {p: upper_bound(p, profile, updates, warmup) for p in plans}
        tie = lambda p: (-p.max_staleness, p.ahead, p.workers + p.learner_devices)  # noqa: E731
        order = sorted(plans, key=lambda p: (-likely_rate(p, profile, updates, warmup), -bound[p], tie(p)))
        by_bound = sorted(plans, key=lambda p: -bound[p])
        done: set[Plan] = set()
        # what was simulated already (a smaller device count of the same table) is free: it sets the bar first
        ranked = [Ranked(p, run(p)) for p in order if (p, updates, warmup, seed) in cache]
        done.update(r.plan for r in ranked)
        left = 0  # by_bound[left:] holds every plan not simulated yet (and some that were)

        def beaten(b: float, bar: float) -> bool:  # a plan bounded by b cannot rank above the bar
            return b < bar * (1 - 1e-9) or (not ties and b <= bar * (1 + 1e-9))

        for p in order:
            while left < len(by_bound) and by_bound[left] in done:
                left += 1
            if left == len(by_bound):
                break
            if len(ranked) >= top:
                ranked.sort(key=_key)
                bar = ranked[top - 1].result.trained_samples_per_s
                if beaten(bound[by_bound[left]], bar):
                    break  # the bound closed: nothing left can rank
                if p in done or beaten(bound[p], bar):
                    continue
            elif p in done:
                continue
            if simulate_at_most is not None and counts["simulated"] >= simulate_at_most:
                break
            ranked.append(Ranked(p, run(p)))
            done.add(p)
        ranked.sort(key=_key)
        best_left = next((bound[p] for p in by_bound[left:] if p not in done), None)
        bar = ranked[min(top, len(ranked)) - 1].result.trained_samples_per_s if ranked else 0.0
        closed = best_left is None or (len(ranked) >= top and beaten(best_left, bar))
        gap = 0.0 if best_left is None or closed else (max(0.0, best_left / bar - 1) if bar > 0 else math.inf)
        counts.update(exact=closed, gap=gap)
    ranked.sort(key=_key)
    if stats is not None:
        stats.update(counts)
    return ranked[:top]
