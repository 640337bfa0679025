"""A plan's rates in closed form, without simulating it: what :func:`~rlhf_run.plan.search.search`
prunes with (:func:`upper_bound`: the simulated rate does not exceed it) and orders by
(:func:`likely_rate`, :func:`estimate`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlhf_run.plan.profile import Profile
from rlhf_run.plan.records import Plan


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


def window_updates(updates: int, warmup: int) -> tuple[int, int]:
    """The learner updates whose cycles make up a simulation's measuring window: ``simulate`` stops
    once update ``updates`` is counted, before its cycle ends, so the cycles of updates ``warmup + 2``
    .. ``updates - 1`` lie between the window's first and last marks. Returns (first, count)."""
    first = warmup + 2
    return first, max(0, updates - first)


def learner_bound(plan: Plan, profile: Profile, updates: int, warmup: int) -> float:
    """The most trained samples/s the simulator can report for ``plan`` (a proof, not an estimate).

    Every job takes at least its work (a device runs it at full speed, a shared core slower), and
    each of the window's ``n`` learner cycles does, in its one thread: ``read_base``, the read and
    the update (``R``), the snapshot (``s``), ``per_update`` (``u``) and, every ``checkpoint_every``
    updates, a checkpoint (``K``, ``k`` of them in the window). The send (``d``) runs on the publish thread,
    and a snapshot waits for the previous send to end, so consecutive snapshots start at least
    ``C = s + max(d, u + read_base + R)`` apart. From the window's first mark to its first snapshot
    is at least ``read_base + R``, from its last snapshot to its last mark at least ``s + u``:
    ``window >= L + (n - 1) C + k K`` with ``L = read_base + R + s + u``, and the window
    trains ``n`` batches."""
    first, n = window_updates(updates, warmup)
    if n <= 0:
        return math.inf
    p, lc = profile, profile.learner
    tokens = plan.batch_size * (p.generation.prompt_tokens.mean() + p.generation.response_tokens.mean())
    rest = (lc.read_base + lc.read_per_sample * plan.batch_size + lc.per_update
            + lc.update_s(plan.batch_size, tokens, plan.micro_batch_size, plan.learner_devices, plan.zero_stage,
                          p.machine.gpus_per_node))
    snap = p.sync.snapshot_s()
    cycle = snap + max(p.sync.send_s(), rest)
    checkpoints = sum(1 for u in range(first, first + n) if u % plan.checkpoint_every == 0)
    checkpoint = lc.checkpoint_time(plan.learner_devices, p.machine.gpus_per_node)
    window = rest + snap + (n - 1) * cycle + checkpoints * checkpoint
    return n * plan.batch_size / window if window > 0 else math.inf


@dataclass(frozen=True)
class RolloutPeriods:
    """Seconds per learner version the rollout side needs at least, in the steady state (from
    the expected response lengths), by :func:`rollout_periods`."""

    workers: float  # the workers' time, pulls counted for the workers that must be busy
    workers_all: float  # the same with every worker pulling every version (the likely case)
    chain: float  # the pacing chain
    chain_likely: float  # the same at the step cost of the rows a worker likely runs (not a bound)


def rollout_periods(plan: Plan, profile: Profile) -> RolloutPeriods:
    """Per learner version (``T`` seconds apart, ``B`` samples each), a worker's cost per sample
    ``w`` is at least: its share of each step's fixed cost (a step runs at most ``slots`` rows; a
    response of ``n`` tokens rides ``max(1, n - 1)`` steps), its context (``decode_per_ctx_token``
    times the context it carries through those steps), its prefill, and the claim and emit per
    sample; each pass is floored by its compute, so the larger of the two sums is a bound. Then:

    * workers: a busy worker pulls every version (an announcement between steps, or the lease of
      its next claim) and generates nothing meanwhile; the ``k``-th of the workers to start a
      pull shares the weight server with ``k`` pulls. When the budget keeps every worker busy
      (``W slots <= ahead B``), ``W T >= B w + sum_k pull_s(k)``; otherwise idle workers skip
      pulls and a pull longer than ``T`` skips versions: the least ``T`` with ``W T >= B w +
      sum_k min(pull_s(k), T)``. ``workers_all`` charges every pull in every case (what the
      simulated workers, all of them claiming, mostly do: the search's order, not its bound);
    * chain: pacing admits batch ``v``'s samples only once version ``v - ahead`` is published, and
      the learner trains batch ``v`` once ``B`` of them are appended, so ``(ahead + 1) T >= snapshot
      + send + pull + generate B + read and update``, with ``generate B >= max(B w / W, the
      longest response's steps)`` (the longest of ``B``: the learner may take others first when
      more than ``B`` are admitted, hence :data:`CHAIN_MARGIN`).
    """
    p, gen, wc = profile, profile.generation, profile.worker
    B, W, slots = plan.batch_size, plan.workers, plan.slots
    resp, prompt = gen.response_tokens, gen.prompt_tokens
    total = sum(resp.weights) or 1.0
    probs = [w / total for w in resp.weights]
    steps = [max(1, int(v) - 1) for v in resp.values]
    e_steps = sum(q * s for q, s in zip(probs, steps))
    e_pairs = sum(q * s * (s - 1) for q, s in zip(probs, steps)) / 2  # context added while decoding
    e_prompt = prompt.mean()
    e_ctx = e_steps * (e_prompt + 1) + e_pairs
    per_step = e_steps / slots  # steps per sample, at full rows
    decode = per_step * (gen.decode_base + wc.per_iteration) + gen.decode_per_row * e_steps + gen.decode_per_ctx_token * e_ctx
    if gen.flops_per_s > 0:
        decode = max(decode, per_step * wc.per_iteration + gen.flops_per_token * e_steps / gen.flops_per_s)
    prefill = gen.prefill_base / slots + gen.prefill_per_row + gen.prefill_per_token * e_prompt
    if gen.flops_per_s > 0:
        prefill = max(prefill, gen.flops_per_token * e_prompt / gen.flops_per_s)
    work = decode + prefill + wc.per_prompt / plan.group_size + wc.per_sample_emit  # worker seconds per sample
    pulls = [p.sync.pull_s(k) for k in range(1, W + 1)]
    workers_all = (B * work + sum(pulls)) / W
    workers = workers_all if W * slots <= plan.ahead * B else _worker_period(B * work, W, pulls)
    # the longest response of a batch of B (its expected value): its steps at the least step cost
    cum, longest = 0.0, 0.0
    for q, s in sorted(zip(probs, steps), key=lambda x: x[1]):
        below = cum
        cum += q
        longest += s * (min(1.0, cum) ** B - min(1.0, below) ** B)
    step_min = gen.decode_base + wc.per_iteration
    if gen.flops_per_s > 0:
        step_min = max(step_min, gen.flops_per_token / gen.flops_per_s)
    lc = p.learner
    tokens = B * (e_prompt + resp.mean())
    learn = lc.read_per_sample * B + lc.update_s(B, tokens, plan.micro_batch_size, plan.learner_devices, plan.zero_stage,
                                                  p.machine.gpus_per_node)
    fixed = p.sync.snapshot_s() + p.sync.send_s() + p.sync.pull_s(1) + learn
    chain = (fixed + max(B * work / W, longest * step_min)) / (plan.ahead + 1)
    # likely: a worker runs the rows pacing lets in, spread over the workers, at most its slots
    rows = max(1.0, min(slots, (plan.ahead + 1) * B / W))
    step = gen.decode_s(max(1, round(rows)), rows * (e_prompt + e_steps / 2)) + wc.per_iteration
    chain_likely = (fixed + max(B * work / W, longest * step)) / (plan.ahead + 1)
    return RolloutPeriods(workers, workers_all, chain, chain_likely)


def _worker_period(work: float, workers: int, pulls: list[float]) -> float:
    """The least ``T`` with ``workers T >= work + sum(min(pull, T))``: the workers' time per version
    holds the batch's generation and each pull (at most the whole period: a worker whose pull
    outlasts a version pulls back to back and skips versions). ``pulls`` ascending."""
    paid = 0.0
    for j in range(len(pulls) + 1):  # T in [pulls[j-1], pulls[j]): the first j pulls are paid in full
        rate = workers - (len(pulls) - j)
        if rate > 0:
            t = (work + paid) / rate
            if (j == 0 or t >= pulls[j - 1]) and (j == len(pulls) or t < pulls[j]):
                return t
        if j < len(pulls):
            paid += pulls[j]
    return (work + paid) / workers


#: how much faster than :func:`rollout_periods` a simulated window ran at most, over 320 random
#: plans of the 7B profile (8-1,024 GPUs, both transports, 30 updates), rounded up: 1.1% where
#: the workers' time binds (finite windows, drawn lengths), 9.1% where the chain does (the learner
#: taking the first ``B`` of more admitted samples, not always the longest; many workers, small
#: batches). Not a proof: a plan beyond them would be pruned wrongly
WORKERS_MARGIN, CHAIN_MARGIN = 0.03, 0.10


def upper_bound(plan: Plan, profile: Profile, updates: int, warmup: int) -> float:
    """What :func:`~rlhf_run.plan.search.search` prunes with: the simulated trained samples/s of
    ``plan`` does not exceed it (the learner's part is a proof; the rollout side's a steady-state
    ceiling, with margins)."""
    r = rollout_periods(plan, profile)
    period = max(r.workers / (1 + WORKERS_MARGIN), r.chain / (1 + CHAIN_MARGIN))
    return min(learner_bound(plan, profile, updates, warmup), plan.batch_size / period if period > 0 else math.inf)


def likely_rate(plan: Plan, profile: Profile, updates: int, warmup: int) -> float:
    """The order :func:`~rlhf_run.plan.search.search` simulates in (not a bound):
    :func:`upper_bound` without margins, every worker pulling every version and the chain's steps
    at the cost of the rows a worker likely runs (closer to the simulated rate where many workers
    share the weight server, or split few rows)."""
    r = rollout_periods(plan, profile)
    period = max(r.workers_all, r.chain_likely)
    return min(learner_bound(plan, profile, updates, warmup), plan.batch_size / period if period > 0 else math.inf)
