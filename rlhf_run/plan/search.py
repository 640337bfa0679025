"""Plan search: the feasible settings of a run, ranked by simulated trained samples/s.

A plan fixes the workers (or, on GPUs, the split of the devices between rollout workers and
the learner, GPUs left idle allowed), the slots per worker, the batch and micro-batch, the ZeRO stage, the lookahead
and the staleness bound (within the user's). On a CPU profile every plan is simulated; on a GPU
profile memory rules out what cannot fit (ZeRO states and activations on a learner device, the
weights and KV cache on a rollout device), the learner gets the fastest ZeRO stage and
micro-batch that fit, a closed-form estimate of each remaining plan keeps the most promising
ones, and those are simulated. The winner comes with the Hydra overrides that run it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Iterable

from rlhf_core.errors import UserError
from rlhf_run.plan.profile import Profile
from rlhf_run.plan.simulate import Plan, SimResult, simulate


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
    devices = cfg.learner.devices
    return Plan(
        workers=int(cfg.rollout.num_workers), slots=int(cfg.rollout.slots), batch_size=int(cfg.learner.batch_size),
        micro_batch_size=int(cfg.learner.micro_batch_size), group_size=int(cfg.algo.group_size),
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
    if not 1 <= plan.micro_batch_size <= plan.batch_size:
        why.append(f"learner.micro_batch_size {plan.micro_batch_size} is outside 1..{plan.batch_size}")
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
            for workers in range(1, request.max_workers + 1):
                for slots in sorted({batch // 2, batch, 2 * batch, 4 * batch} - {0}):
                    for micro in sorted({batch, max(1, batch // 2)}):
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
            if plan.batch_size % (micro * plan.learner_devices) or memory_problems(cand, profile):
                continue
            t = profile.learner.update_s(plan.batch_size, tokens, micro, plan.learner_devices, zero,
                                         profile.machine.gpus_per_node)
            if t < best_s:
                best, best_s = replace(plan, zero_stage=zero, micro_batch_size=micro), t
    return best


def estimate(plan: Plan, profile: Profile) -> float:
    """Closed-form trained samples/s (for pruning only): generation, training and weight sync as
    rates, overlapped when pacing lets generation run ahead, serialised when it does not."""
    gen, p = profile.generation, profile
    mean_len, prompt = gen.response_tokens.mean(), gen.prompt_tokens.mean()
    rows = plan.slots
    step = gen.decode_s(rows, rows * (prompt + mean_len / 2)) + p.worker.per_iteration
    gen_rate = plan.workers * rows / max(1e-9, mean_len * step)  # samples/s
    tokens = plan.batch_size * (prompt + mean_len)
    learn = (p.learner.update_s(plan.batch_size, tokens, plan.micro_batch_size, plan.learner_devices, plan.zero_stage,
                                p.machine.gpus_per_node) + p.learner.per_update + p.learner.read_per_sample * plan.batch_size)
    sync = p.sync.snapshot_s() + p.sync.send_s() + p.sync.pull_s(plan.workers)
    gen_batch = plan.batch_size / gen_rate + p.sync.pull_s(plan.workers)  # every worker pulls every version
    if plan.ahead == 0:
        return plan.batch_size / (gen_batch + learn + sync)
    return plan.batch_size / max(gen_batch, learn, p.sync.send_s())


@dataclass
class Ranked:
    plan: Plan
    result: SimResult
    estimate: float


def search(request: Request, profile: Profile, top: int = 5, simulate_at_most: int = 24, updates: int = 200,
           seed: int = 0) -> list[Ranked]:
    """The feasible plans, best first (simulated trained samples/s; fewer stale samples on ties)."""
    check_request(request, profile)
    plans = candidates(request, profile)
    if not plans:
        raise PlanError("no plan fits: " + "; ".join(check_plan(request.base, request, profile) or
                                                     ["every candidate breaks a memory or device limit"]))
    scored = sorted(((estimate(p, profile), p) for p in plans), key=lambda x: -x[0])
    if profile.kind == "gpu":
        scored = scored[:simulate_at_most]
    warmup = max(5, updates // 10)
    ranked = [Ranked(p, simulate(profile, p, updates=updates, warmup=warmup, seed=seed), est) for est, p in scored]
    ranked.sort(key=lambda r: (-round(r.result.trained_samples_per_s, 6), r.result.staleness_mean))
    return ranked[:top]
