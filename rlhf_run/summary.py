"""What a run leaves behind: ``summary.json`` and its text, from every update's line of the
learner's ``metrics.jsonl`` and the buffer's snapshots in ``timeline.jsonl``
(:mod:`rlhf_run.progress`), with the plots (:mod:`rlhf_run.plots`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlhf_core import metric_names as M
from rlhf_core.config import Config
from rlhf_core.errors import UserError, disk_writes
from rlhf_run.plots import plot
from rlhf_run.progress import TIMELINE_FILE, Progress, RestartDrops, read_jsonl, read_timeline, reward_cost, worker_stats

log = logging.getLogger(__name__)

SUMMARY_FILE = "summary.json"


def read_metrics(output_dir: Path) -> list[dict[str, Any]]:
    """Every update's metrics line (read once, at the end of a run)."""
    by_update: dict[Any, dict[str, Any]] = {}
    for row in read_jsonl(output_dir / M.METRICS_FILE):
        # an update re-trained after a crash appears twice; the later line is the real one
        by_update[row.get(M.UPDATES, len(by_update))] = row
    return list(by_update.values())


def appended_per_s(timeline: list[dict[str, Any]], since: float | None = None) -> float | None:
    """Samples appended to the buffer per second (by workers and by the gateway), from the first
    snapshot (after ``since``) that counts more than the first one did (start-up left out, also
    on a resume whose Redis data counts the launch before) to the last that counts less than the
    final total (the end of the run left out: the final checkpoint and the workers' drain append
    nothing), or the first that counts it when that leaves one snapshot. Neither end's interval,
    in which appends began or ended, is counted: snapshots far apart (timeline.jsonl is thinned
    as a run goes on) would stretch the window over idle time. None without two snapshots."""
    points = [(float(snap["time"]), int(snap["counters"]["samples_appended"])) for snap in timeline
              if "samples_appended" in snap.get("counters", {}) and "time" in snap
              and (since is None or snap["time"] >= since)]
    points = [p for p in points if p[1] > points[0][1]] if points else []
    below = [p for p in points if p[1] < points[-1][1]]
    points = below if len(below) >= 2 else points[:next((i + 1 for i, p in enumerate(points) if p[1] == points[-1][1]), 0)]
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return None
    return (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])


def sync_latency_s(timeline: list[dict[str, Any]]) -> float | None:
    """Publish -> applied, averaged over the run's versions: each version the snapshots saw
    applied (its mean over workers, from the last snapshot that names it, when most workers had
    it) stands for itself and the versions since the one seen before it, which fell between
    snapshots (a second apart, and sparser as timeline.jsonl is thinned: counted once each, the
    run's first versions, seen densely, would outweigh the rest). The newest version's alone, at
    the end of a run, is one version's and may have reached few workers or none (None)."""
    by_version: dict[int, float] = {}
    for snap in timeline:
        ws = (snap.get("stats") or {}).get(M.WEIGHT_SERVER_STATS) or {}
        if ws.get("sync_latency_s") is not None and isinstance(ws.get("version"), int):
            by_version[ws["version"]] = float(ws["sync_latency_s"])
    total = weight = 0.0
    before = None
    for version, latency in sorted(by_version.items()):
        w = 1 if before is None else version - before
        total, weight, before = total + w * latency, weight + w, version
    return total / weight if weight else None


def mismatch_summary(rows: list[dict[str, Any]], warn: float) -> dict[str, Any] | None:
    """The run's train/rollout mismatch per split (``metric_names.MISMATCH_SPLITS``): the means over
    every token (each update's mean weighted by its tokens), the largest ``abs_max``, the worst
    update's KL (``kl_k3_max``) and the tokens counted; and the updates with lag-0 tokens, and
    those whose lag-0 KL was over ``warn`` (``algo.mismatch_warn``: the learner warned of them).
    None when no update reported it (DPO)."""
    tokens, kl = (M.mismatch_key(M.MISMATCH_LAG0, stat) for stat in ("tokens", "kl_k3"))
    if not any(tokens in r for r in rows):
        return None
    lag0 = [r for r in rows if r.get(tokens)]
    return {**{split: _split_summary(rows, split) for split in M.MISMATCH_SPLITS}, "lag0_updates": len(lag0),
            "lag0_updates_over_warn": sum(1 for r in lag0 if r.get(kl, 0.0) > warn)}


def _split_summary(rows: list[dict[str, Any]], split: str) -> dict[str, Any]:
    key = {stat: M.mismatch_key(split, stat) for stat in M.MISMATCH_STATS}
    counted = [(r, float(r[key["tokens"]])) for r in rows if r.get(key["tokens"])]
    total = sum(n for _, n in counted)

    def mean(stat: str) -> float | None:
        return sum(r.get(key[stat], 0.0) * n for r, n in counted) / total if total else None

    def worst(stat: str) -> float | None:
        return max((r.get(key[stat], 0.0) for r, _ in counted), default=None)

    return {"tokens": int(total), "abs_mean": mean("abs_mean"), "abs_max": worst("abs_max"), "kl_k3": mean("kl_k3"),
            "kl_k3_max": worst("kl_k3"), "out_of_band_frac": mean("out_of_band_frac")}


def mismatch_text(stats: dict[str, Any]) -> str:
    """One split's mismatch in words: ``|dlogp| mean 1.2e-07 max 9.5e-07, KL k3 8.1e-15, ... (N tokens)``."""
    if not stats.get("tokens"):
        return "no tokens"

    def g(x: Any) -> str:
        return "n/a" if x is None else f"{x:.2g}"

    return (f"|dlogp| mean {g(stats.get('abs_mean'))} max {g(stats.get('abs_max'))}, KL k3 {g(stats.get('kl_k3'))}, "
            f"out of [0.5, 2] {g(stats.get('out_of_band_frac'))} ({int(stats['tokens'])} tokens)")


def _mean(values: Sequence[float | None]) -> float | None:
    xs = [x for x in values if x is not None]
    return sum(xs) / len(xs) if xs else None


def summarize(cfg: Config, rows: list[dict[str, Any]], timeline: list[dict[str, Any]], wall_s: float,
              exit_reason: str, since: float | None = None) -> dict[str, Any]:
    """``rows``: every update of the run; rates count those after ``since`` (this launch's start:
    a resumed run's rows before the stop would stretch the window over the pause)."""
    rewards = [r.get(M.REWARD_MEAN) for r in rows]
    k = max(1, min(5, len(rows) // 4 or 1))
    samples = rows[-1].get(M.SAMPLES_TRAINED, 0) if rows else 0
    last_snap = timeline[-1] if timeline else {}
    workers = worker_stats(last_snap, cfg.buffer.lease_timeout_s)
    # the buffer's count (the workers' samples and the gateway's): the workers' own counters restart
    # with each worker process and know nothing of the gateway's
    counters = last_snap.get("counters", {})
    gen_samples = counters.get("samples_appended", sum(int(s.get(M.WORKER_SAMPLES, 0)) for s in workers.values()))
    gen_rate = appended_per_s(timeline, since)
    # a resumed run whose Redis data was removed at its clean finish: the buffer counts from 0 again
    launch = [snap for snap in timeline if since is not None and snap.get("time", 0.0) >= since]
    counts_restarted = bool(launch) and any(r.get(M.TIME, 0.0) < since for r in rows) \
        and not int(launch[0].get("counters", {}).get("samples_appended", 0))
    staleness_means = [r.get(M.STALENESS_MEAN) for r in rows]
    staleness_max = max((r.get(M.STALENESS_MAX, 0) for r in rows), default=0)
    restarts = RestartDrops(cfg.algo.max_staleness)
    for snap in timeline:
        restarts.add(snap)
    compute = sum(r.get(M.TIME_COMPUTE_S, 0.0) for r in rows)
    wait = sum(r.get(M.TIME_WAIT_S, 0.0) for r in rows)
    read = sum(r.get(M.TIME_READ_S, 0.0) for r in rows)
    publish = sum(r.get(M.TIME_PUBLISH_S, 0.0) for r in rows)
    # the learner's active window (first to last update), so start-up time does not dilute the rate
    window = [r for r in rows if since is None or r.get(M.TIME, 0.0) >= since] or rows
    active_s = (window[-1].get(M.TIME, 0.0) - window[0].get(M.TIME, 0.0)) if len(window) > 1 else 0.0
    active_samples = samples - (window[0].get(M.SAMPLES_TRAINED, 0) if window else 0)
    return {
        "run_id": cfg.buffer.run_id,
        "exit_reason": exit_reason,
        # the learner's own reason (its last stats record): budget | time | data | signal
        "stopped_by": last_snap.get("stats", {}).get(M.LEARNER_STATS, {}).get(M.STOPPED_BY),
        "max_staleness": cfg.algo.max_staleness,
        "steps": len(rows),
        "samples_trained": samples,
        "samples_generated": gen_samples,
        "generated_this_launch": counts_restarted,  # samples_generated counts this launch's alone
        "samples_dropped_stale": int(counters.get("samples_dropped_stale", 0)),  # never trained on
        "samples_aged_out": int(counters.get("samples_aged_out", 0)),  # replay mode: trained, then too stale
        # learner restarts that numbered their weights past the updates they hold, with the stale drops that followed
        "learner_restarts": restarts.restarts,
        "reward_start": _mean(rewards[:k]),
        "reward_end": _mean(rewards[-k:]),
        "reward_max": max((r for r in rewards if r is not None), default=None),
        "staleness_mean": _mean(staleness_means),
        "staleness_max": staleness_max,
        # the workers' behaviour log-probs against the learner's, at lag 0 and lagged (None: not reported, DPO)
        "mismatch": mismatch_summary(rows, cfg.algo.mismatch_warn),
        "wall_s": wall_s,
        "training_window_s": active_s,
        "throughput": {
            "trained_samples_per_s": active_samples / active_s if active_s else 0.0,
            # the buffer's appends over the run's snapshots; without two of them, each worker's own
            # rate over its uptime, summed
            "generated_samples_per_s": gen_rate if gen_rate is not None else
            sum(float(w.get(M.WORKER_SAMPLES_PER_S, 0.0)) for w in workers.values()),
            "generated_tokens_per_s": sum(float(w.get(M.WORKER_TOKENS_PER_S, 0.0)) for w in workers.values()),
            "learner_compute_s": compute,
            "learner_wait_s": wait,
            "learner_read_s": read,
            "learner_publish_s": publish,
            "learner_tflops": _mean([r.get(M.TRAIN_TFLOPS) for r in rows]),
            "learner_mfu": _mean([r.get(M.MFU) for r in rows]),  # None without a known device peak
            "weight_sync_latency_s": sync_latency_s(timeline),
        },
        "rewards": reward_cost(list(workers.values())),
        # rlhf-gateway's last stats (its counts since it last started; None: no gateway)
        "gateway": last_snap.get("stats", {}).get(M.GATEWAY_STATS),
        "dead_letters": counters.get("dead_letters"),
        "leases_reclaimed": counters.get("prompts_reclaimed"),
        # the buffer's own counters at the end, for audits (appended = consumed + stale + left)
        "buffer_counters": counters,
    }


#: the learner's stop reasons (``rlhf_core.metric_names.STOP_REASONS``) as the summary says them
STOP_REASONS = {M.STOP_BUDGET: "learner.max_updates reached", M.STOP_TIME: "run.max_seconds reached",
                M.STOP_DATA: "every prompt of data.epochs trained on", M.STOP_SIGNAL: "stopped by a signal"}


def format_summary(s: dict[str, Any]) -> str:
    def f(x: Any) -> str:
        return "n/a" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x))

    t = s["throughput"]
    why = STOP_REASONS.get(s.get("stopped_by") or "", s.get("stopped_by"))
    lines = [
        f"run {s['run_id']} ({s['exit_reason'] or 'done'}{f': {why}' if why else ''}) in {s['wall_s']:.0f} s",
        f"  steps {s['steps']}, samples trained {s['samples_trained']}, generated {s['samples_generated']}"
        + (" (this launch: the buffer's counts restarted with the run's Redis)" if s.get("generated_this_launch") else "")
        + (f", dropped as too stale {s['samples_dropped_stale']}" if s.get("samples_dropped_stale") else "")
        + (f", trained and then aged out {s['samples_aged_out']}" if s.get("samples_aged_out") else ""),
        f"  reward {f(s['reward_start'])} -> {f(s['reward_end'])} (max {f(s['reward_max'])})",
        f"  staleness mean {f(s['staleness_mean'])}, max {f(s['staleness_max'])} (limit {s['max_staleness']})",
        f"  throughput: generated {t['generated_tokens_per_s']:.0f} tok/s ({t['generated_samples_per_s']:.1f} samples/s), "
        f"trained {t['trained_samples_per_s']:.1f} samples/s; learner compute {t['learner_compute_s']:.0f} s, "
        f"reading batches {t['learner_read_s']:.1f} s, waiting {t['learner_wait_s']:.0f} s, "
        f"publishing {t['learner_publish_s']:.1f} s (on its own thread)",
    ]
    mm = s.get("mismatch")
    if mm:
        lines.append(f"  mismatch: lag-0 {mismatch_text(mm[M.MISMATCH_LAG0])}; lag>0 {mismatch_text(mm[M.MISMATCH_LAGGED])}")
        if mm.get("lag0_updates_over_warn"):
            lines.append(f"  the lag-0 mismatch was over algo.mismatch_warn in {mm['lag0_updates_over_warn']} of the "
                         f"{mm['lag0_updates']} updates with lag-0 tokens: the workers do not sample what the learner "
                         "computes (logs/learner.log has the learner's warning and what to check)")
    dropped, generated = s.get("samples_dropped_stale") or 0, s["samples_generated"] or 0
    restarts = [r for r in s.get("learner_restarts") or [] if r["samples_dropped_stale"]]
    if restarts:
        after = sum(r["samples_dropped_stale"] for r in restarts)
        dropped -= after
        at = "; ".join(f"at version {r['version']}, {r['samples_dropped_stale']} dropped, the restored weights numbered "
                       f"{r['skipped']} versions ahead" for r in restarts)
        lines.append(f"  {after} of the samples dropped as too stale followed a learner restart ({at}): the learner "
                     "restored a checkpoint older than the versions it had published and numbered its weights past "
                     "them, so what was generated before the restart was that many versions behind it. Expected once "
                     "per restart (fewer with a smaller learner.checkpoint_every), not a reason to raise "
                     "algo.max_staleness")
    if generated and dropped > 0.1 * generated:
        lines.append(f"  {dropped / generated:.0%} of the generated samples were more than algo.max_staleness="
                     f"{s['max_staleness']} versions behind the learner when it read them, and were dropped: raise "
                     "algo.max_staleness (gateway episodes: a group is appended at its last session's reward, so "
                     "reward a group's sessions close together)")
    ev = s.get("eval") or {}
    if ev:
        first, last = ev["first"], ev["last"]
        passes = ", ".join(f"{k.removeprefix(M.EVAL_PREFIX)} {f(last[k])}" for k in last if k.startswith("eval/pass@"))
        lines.append(f"  eval: reward {f(first.get(M.EVAL_REWARD_MEAN))} (version {first.get(M.EVAL_VERSION)}) -> "
                     f"{f(last.get(M.EVAL_REWARD_MEAN))} (version {last.get(M.EVAL_VERSION)}), {passes} "
                     f"({ev['evaluations']} evaluations)")
    r = s.get("rewards") or {}
    if r.get("scoring_share") is not None and r.get("reward_calls_per_s"):  # none: agents' rewards only (gateway)
        lines.append(f"  rewards: scoring busy {r['scoring_share']:.0%} of the workers' scoring-thread time, "
                     f"{r['reward_calls_per_s']:.1f} reward calls/s, {r['reward_timeouts']} call(s) timed out, "
                     f"{r['empty_responses']} empty response(s)")
    if r.get("reasons"):  # why the built-in verifiers scored what they did (math/no_answer, code/timeout, ...)
        lines.append("  reward reasons: " + ", ".join(f"{k} {n}" for k, n in r["reasons"].items()))
    g = s.get("gateway") or {}
    if g:
        errors = ", ".join(f"{code} {n}" for code, n in M.gateway_errors(g).items())
        lines.append(f"  gateway (since it last started): {g.get('calls', 0)} calls ({g.get('calls_failed', 0)} failed), "
                     f"sessions {g.get('sessions_rewarded', 0)} rewarded and {g.get('sessions_expired', 0)} expired, "
                     f"{g.get('groups_appended', 0)} groups appended; errors answered: {errors or 'none'}")
    return "\n".join(lines)


def write_report(cfg: Config, output_dir: Path, progress: Progress | None, exit_reason: str) -> str:
    rows = read_metrics(output_dir)
    timeline = progress.timeline() if progress else read_timeline(output_dir / TIMELINE_FILE)
    wall = time.time() - (progress.started if progress else time.time())
    summary = summarize(cfg, rows, timeline, wall, exit_reason, since=progress.started if progress else None)
    evals = read_jsonl(output_dir / M.EVAL_FILE)
    if evals:  # the evaluator's records (eval.every > 0): the first and the newest
        summary["eval"] = {"first": evals[0], "last": evals[-1], "evaluations": len(evals)}
    try:
        summary["plots"] = [p.name for p in plot(output_dir, rows, timeline)]
    except Exception as exc:  # a plot must never lose the summary
        log.warning("plots failed: %s", exc)
        summary["plots"] = []
    try:
        with disk_writes(output_dir / SUMMARY_FILE):
            (output_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    except UserError as exc:  # a full disk: the summary is still printed, and the run's own outcome stands
        log.error("%s", exc)
    return format_summary(summary)
