"""`rlhf-monitor`: attach to a running run by Redis URL and run id, and show it live.

    rlhf-monitor url=redis://127.0.0.1:6379 run_id=run-20261122-101500-ab12
    rlhf-monitor url=... run_id=... --once --json      # one snapshot for scripts
    rlhf-monitor url=... run_id=... prometheus_port=9300   # and serve the run's Prometheus target
    rlhf-monitor url=... run_id=... workers=4              # a launcher=ray run: keep 4 worker actors

Everything shown comes from Redis (the buffer's counters, the consumers' heartbeats and the
stats the learner and weight server publish there), so the monitor needs no other address.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import sys
import threading
import time
from typing import Any

from rlhf_core import metric_names as M
from rlhf_core.cli import hydra_entry
from rlhf_core.config import BufferConfig, ConfigError
from rlhf_core.dapo import FILTER_REASONS
from rlhf_run.plots import RATE_WINDOW_S
from rlhf_run.progress import PROBE_RETRY_S, worker_stats
from rlhf_run.summary import mismatch_text

log = logging.getLogger(__name__)

_FLAGS = {"--once": "once=true", "--json": "json=true"}
_UNCUT = 10_000  # columns: wider than any snapshot's table


def snapshot(buf: Any, previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """One monitor snapshot: the buffer's metrics plus rates derived from the snapshots before."""
    snap = buf.metrics()
    snap["time"] = time.time()
    # the workers heartbeating now: a record stays after its worker left (progress.worker_stats)
    workers = list(worker_stats(snap, _lease_timeout_s(buf)).values())
    snap["generated_tokens_per_s"] = sum(float(w.get(M.WORKER_TOKENS_PER_S, 0.0)) for w in workers)
    # samples appended by workers and by the gateway (whose samples no worker counts) over the
    # last RATE_WINDOW_S; the workers' own rates until there are two snapshots
    rate = _windowed_rate(snap, previous, "appended_window", snap.get("counters", {}).get("samples_appended", 0))
    snap["generated_samples_per_s"] = rate if rate is not None else sum(
        float(w.get(M.WORKER_SAMPLES_PER_S, 0.0)) for w in workers)
    # samples trained likewise (the learner's learner/samples_per_s is over one update's compute
    # time: a learner waiting for batches trains far fewer a second); None until two snapshots
    learner = snap.get("stats", {}).get(M.LEARNER_STATS, {})
    snap["trained_samples_per_s"] = _windowed_rate(snap, previous, "trained_window", learner.get(M.SAMPLES_TRAINED))
    if previous is not None:
        dt = max(snap["time"] - previous["time"], 1e-9)
        c, p = snap.get("counters", {}), previous.get("counters", {})
        snap["rate_samples_appended_per_s"] = (c.get("samples_appended", 0) - p.get("samples_appended", 0)) / dt
        snap["rate_samples_consumed_per_s"] = (c.get("samples_consumed", 0) - p.get("samples_consumed", 0)) / dt
    return snap


def _windowed_rate(snap: dict[str, Any], previous: dict[str, Any] | None, name: str, count: Any) -> float | None:
    """The growth per second of ``count`` over the last RATE_WINDOW_S of snapshots (the newest
    point before them stays, so a count that grows less often still has two points). The points
    are kept in ``snap[name]``; a count that went down (a restored learner) starts them again.
    None with fewer than two points."""
    if count is None:  # no learner stats yet
        snap[name] = []
        return None
    before = (previous or {}).get(name, [])
    if before and count < before[-1][1]:
        before = []
    snap[name] = [p for p in before[:-1] if p[0] >= snap["time"] - RATE_WINDOW_S] + before[-1:] + [[snap["time"], count]]
    (t0, n0), (t1, n1) = snap[name][0], snap[name][-1]
    return (n1 - n0) / (t1 - t0) if t1 > t0 else None


def _lease_timeout_s(buf: Any) -> float:
    """The run's ``buffer.lease_timeout_s`` (the default before the run has parameters)."""
    from buffer import RunNotInitialised

    try:
        return float(buf.run_params()["lease_timeout_s"])
    except RunNotInitialised:
        return BufferConfig.lease_timeout_s


def render(snap: dict[str, Any]):
    """A rich renderable of one snapshot."""
    from rich.console import Group
    from rich.table import Table

    c = snap.get("counters", {})
    head = Table.grid(padding=(0, 2))
    version, updates = snap.get("learner_version"), snap.get("learner_updates", snap.get("learner_version"))
    # a learner restarted from a checkpoint numbers its weights past the updates they hold; pacing counts the updates
    head.add_row("run", str(snap.get("run_id")), "learner version",
                 str(version) if updates == version else f"{version} ({updates} updates)",
                 "admission budget", str(snap.get("admission_budget")))
    depth = snap.get("depth", {})
    head.add_row("prompts waiting", str(depth.get("prompts_waiting")), "leased", str(depth.get("prompts_leased")),
                 "samples in buffer", str(depth.get("samples_in_buffer")))
    head.add_row("generated tok/s", f"{snap.get('generated_tokens_per_s', 0):.0f}",
                 "generated samples/s", f"{snap.get('generated_samples_per_s', 0):.1f}",
                 "trained samples/s", str(_fmt(snap.get("trained_samples_per_s"))))
    head.add_row("dead letters", str(c.get("dead_letters")), "reclaimed leases", str(c.get("prompts_reclaimed")),
                 "dropped stale", str(c.get("samples_dropped_stale")))
    if c.get("samples_aged_out"):  # replay mode: samples trained on, then too stale to draw again
        head.add_row("aged out after training", str(c.get("samples_aged_out")), "", "", "", "")
    if c.get("groups_filtered"):  # algo.filter_groups: groups dropped because they teach nothing
        head.add_row("groups filtered", str(c.get("groups_filtered")), "by reason",
                     "  ".join(f"{r} {c.get(f'groups_filtered_{r}', 0)}" for r in FILTER_REASONS), "", "")
    target = (snap.get("control") or {}).get("workers")
    if target is not None:  # a launcher=ray run: the worker actors it keeps (workers=N changes it)
        head.add_row("worker target", str(target), "", "", "", "")
    ws = snap.get("stats", {}).get(M.WEIGHT_SERVER_STATS, {})
    head.add_row("weight-sync latency (s)", str(_fmt(ws.get("sync_latency_s"))),
                 "last version bytes", str(ws.get("bytes")), "pulls", str(ws.get("pulls")))
    gw = snap.get("stats", {}).get(M.GATEWAY_STATS)
    if gw:  # rlhf-gateway: its calls, its sessions, and why requests failed (retryable 503s: worker_stopped, ...)
        errors = "  ".join(f"{code} {n}" for code, n in M.gateway_errors(gw).items())
        head.add_row("gateway calls (running, failed)", f"{gw.get('calls')} ({gw.get('calls_running')}, {gw.get('calls_failed')})",
                     "sessions open, rewarded, expired",
                     f"{gw.get('sessions_open')}, {gw.get('sessions_rewarded')}, {gw.get('sessions_expired')}",
                     "gateway errors", errors or "none")
    learner = snap.get("stats", {}).get(M.LEARNER_STATS, {})
    if M.mismatch_key(M.MISMATCH_LAG0, "tokens") in learner:  # the newest update's (none with DPO)
        split = {s: {stat: learner.get(M.mismatch_key(s, stat)) for stat in M.MISMATCH_STATS} for s in M.MISMATCH_SPLITS}
        head.add_row("mismatch lag 0", mismatch_text(split[M.MISMATCH_LAG0]), "lag > 0",
                     mismatch_text(split[M.MISMATCH_LAGGED]), "", "")
    ev = snap.get("stats", {}).get(M.EVAL_STATS)
    if ev:  # the newest evaluation (eval.every > 0)
        passes = "  ".join(f"{k.removeprefix(M.EVAL_PREFIX)} {_fmt(v)}" for k, v in ev.items() if k.startswith("eval/pass@"))
        head.add_row("eval (version)", str(ev.get(M.EVAL_VERSION)), "eval reward", _fmt(ev.get(M.EVAL_REWARD_MEAN)),
                     "eval", passes)
    workers = Table(title="consumers", show_lines=False)
    for col in ("name", "version", "heartbeat age (s)", "leases", "tokens/s", "samples", "scoring busy", "reward calls/s"):
        workers.add_column(col)
    for name, rec in sorted(snap.get("consumers", {}).items()):
        stats = rec.get("stats", {})
        share = stats.get(M.WORKER_SCORE_SHARE)
        workers.add_row(name, str(rec.get("version")), str(rec.get("age_s")), str(rec.get("leases")),
                        _fmt(stats.get(M.WORKER_TOKENS_PER_S)), str(stats.get(M.WORKER_SAMPLES, "")),
                        "-" if share is None else f"{share:.0%}", _fmt(stats.get(M.WORKER_REWARD_CALLS_PER_S)))
    retired = snap.get("retired") or {}
    if retired.get("consumers"):  # long-dead workers the buffer retired: their totals, summed
        workers.add_row(f"({retired['consumers']} retired)", "-", "-", "-", "-",
                        str(retired.get("stats", {}).get(M.WORKER_SAMPLES, "")), "-", "-")
    hist = Table(title="staleness of consumed samples")
    hist.add_column("versions behind")
    hist.add_column("samples")
    for lag, count in sorted(snap.get("staleness_hist", {}).items(), key=lambda kv: int(kv[0])):
        hist.add_row(str(lag), str(count))
    return Group(head, workers, hist)


def _fmt(x: Any) -> str:
    return "-" if x is None else (f"{x:.3g}" if isinstance(x, float) else str(x))


def run_monitor(url: str, run_id: str, once: bool = False, as_json: bool = False, refresh_s: float = 1.0,
                out: Any = None, prometheus_port: int | None = None) -> dict[str, Any]:
    """Show the run (``once``: one snapshot). ``prometheus_port``: also serve the run's Prometheus
    target (:mod:`rlhf_run.run_exporter`) from the live view's snapshots, for a run whose
    ``rlhf-run`` does not (``run.prometheus_port``) or that was started by hand."""
    from buffer import BufferUnavailable, MonitorClient, RunNotInitialised

    out = out or sys.stdout
    # the live view rides a Redis outage out (the run does): a short retry budget per refresh, so
    # the view says so within seconds, then it tries again; --once fails after the full budget
    cfg = BufferConfig(url=url, run_id=run_id)
    buf = MonitorClient.connect(url, run_id, cfg if once else dataclasses.replace(cfg, max_retry_s=PROBE_RETRY_S),
                                setting="url")  # its errors name rlhf-monitor's url=, not the trainer's buffer.url
    try:
        buf.run_params()
    except RunNotInitialised:  # a wrong run_id would otherwise show a page of zeros
        log.warning("run %r has not started at %s (no run parameters there): check run_id; rlhf-run prints it "
                    "at start as 'monitor: rlhf-monitor url=... run_id=...'", run_id, url)
    if once:
        # two snapshots one refresh apart: the rates (trained samples/s) need two, as in the live view
        snap = snapshot(buf)
        time.sleep(refresh_s)
        snap = snapshot(buf, snap)
        if as_json:
            out.write(json.dumps(snap, default=str, sort_keys=True) + "\n")
        else:
            from rich.console import Console

            console, view = Console(file=out), render(snap)
            if not console.is_terminal:  # a pipe or a file: rich's 80 columns would cut names; fit the content
                console.width = console.measure(view, options=console.options.update_width(_UNCUT)).maximum
            console.print(view)
        return snap
    from rich.console import Group
    from rich.live import Live
    from rich.text import Text

    prev = snapshot(buf)
    target = None
    if prometheus_port is not None:
        from rlhf_run.run_exporter import RunExporter

        target = RunExporter(run_id)
        target.update(prev)
        target.serve(prometheus_port, setting="prometheus_port")
    # Ctrl-C / SIGTERM end the loop between two refreshes, not as a KeyboardInterrupt raised
    # wherever the main thread happens to be (inside a Redis reply, the display, the exporter).
    stopping: list[int] = []
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {sig: signal.signal(sig, lambda signum, _frame: stopping.append(signum))
                    for sig in (signal.SIGINT, signal.SIGTERM)}
    down_since: float | None = None
    try:
        with Live(render(prev), refresh_per_second=max(1, int(1 / refresh_s))) as live:
            while not stopping:
                time.sleep(refresh_s)
                if stopping:
                    break
                try:
                    prev = snapshot(buf, prev)
                except BufferUnavailable as exc:  # the last snapshot stays, under a line that says so
                    if down_since is None:
                        down_since = time.time()
                        log.warning("Redis unreachable: %s; retrying", exc)
                    since = time.strftime("%H:%M:%S", time.localtime(down_since))
                    live.update(Group(Text(f"Redis unreachable since {since} (the last snapshot below); retrying",
                                           style="bold red"), render(prev)))
                    continue
                if down_since is not None:
                    log.warning("Redis reachable again after %.0f s", time.time() - down_since)
                    down_since = None
                live.update(render(prev))
                if target is not None:
                    target.update(prev)
    except KeyboardInterrupt:  # a caller's thread with no handlers of ours
        pass
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if target is not None:
            target.close()
        buf.close()
    return prev


def set_workers(url: str, run_id: str, workers: int) -> int | None:
    """``rlhf-monitor ... workers=N``: ask the run's launcher for N worker actors (a ``launcher=ray``
    run adds or retires workers within seconds); returns the target before."""
    from buffer import MonitorClient, RunNotInitialised

    buf = MonitorClient.connect(url, run_id, BufferConfig(url=url, run_id=run_id), setting="url")
    try:
        try:
            buf.run_params()
        except RunNotInitialised:
            raise ConfigError(f"run {run_id!r} has not started at {url}: check run_id (rlhf-run prints it)") from None
        before = buf.set_worker_target(workers)
    finally:
        buf.close()
    print(f"run {run_id}: worker target {before if before is not None else '-'} -> {workers} (rlhf-run launcher=ray "
          "starts or stops worker actors to match; workers started by hand are not counted)", flush=True)
    return before


@hydra_entry("monitor")
def _main(cfg) -> int:
    from omegaconf import OmegaConf

    if OmegaConf.is_missing(cfg, "url"):
        raise ConfigError("rlhf-monitor needs url=redis://HOST:PORT/DB and run_id=RUN: rlhf-run prints both when it "
                          "starts ('monitor: rlhf-monitor url=... run_id=...'); rlhf-monitor --help says more")
    if cfg.workers is not None:
        set_workers(cfg.url, cfg.run_id, int(cfg.workers))
        return 0
    if cfg.once and cfg.prometheus_port is not None:
        raise ConfigError("rlhf-monitor serves prometheus_port only in the live view: drop --once, or drop prometheus_port")
    run_monitor(cfg.url, cfg.run_id, once=cfg.once, as_json=cfg.json, refresh_s=cfg.refresh_s,
                prometheus_port=cfg.prometheus_port)
    return 0


def main() -> None:
    # `--once` / `--json` read better than Hydra's once=true json=true; accept both.
    sys.argv = [_FLAGS.get(a, a) for a in sys.argv]
    _main()


main.config_name = "monitor"  # type: ignore[attr-defined]  # read by the config tests

if __name__ == "__main__":
    main()
