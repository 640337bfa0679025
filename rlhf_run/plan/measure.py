"""The calibration behind ``rlhf-plan profile``: every stage measured alone, on this machine,
beside a private redis-server and an in-process weight server, in CPU seconds of the thread
doing the work (other jobs disturb the figures little; the simulator adds the sharing back):
generation (:func:`measure_generation`), a real worker alone (:func:`measure_worker`), a real
learner alone and its update on several batch sizes (:func:`measure_learner`,
:func:`measure_updates`), weight sync (:func:`measure_sync`), and the machine's figures
(:mod:`rlhf_run.plan.machine`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from rlhf_run.plan.machine import BackgroundMeter, fit_contention, measure_handoff, measure_launcher
from rlhf_run.plan.profile import Generation, Learner, Lengths, Machine, Profile, Sync, Worker, identity_of

log = logging.getLogger(__name__)


# ---- helpers ----------------------------------------------------------------------------


def fit(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares ``ys ~ rows @ coef`` with every coefficient >= 0 (a negative cost is noise:
    that column is dropped and the rest refitted)."""
    cols = list(range(len(rows[0])))
    a, y = np.asarray(rows, dtype=float), np.asarray(ys, dtype=float)
    while True:
        coef, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
        if (coef >= 0).all() or len(cols) == 1:
            out = [0.0] * a.shape[1]
            for c, v in zip(cols, coef):
                out[c] = max(0.0, float(v))
            return out
        cols.pop(int(np.argmin(coef)))


class Timed:
    """Wraps a callable; adds up the CPU time of the calling thread spent in it, per call."""

    def __init__(self, fn: Callable, sizer: Callable[..., float] | None = None) -> None:
        self.fn, self.sizer = fn, sizer
        self.calls: list[tuple[float, float]] = []  # (CPU s, size)
        self.lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time()
        out = self.fn(*args, **kwargs)
        dt = time.thread_time() - t0
        with self.lock:
            self.calls.append((dt, self.sizer(out, *args, **kwargs) if self.sizer else 1.0))
        return out

    @property
    def total(self) -> float:
        return sum(c for c, _ in self.calls)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


# ---- the stages ---------------------------------------------------------------------------


def measure_generation(cfg: Any, reps: int = 3) -> tuple[Generation, list[tuple[list[int], int]]]:
    """Decode/prefill cost against rows (waves of 1 .. 4 x slots) and the length distributions."""
    import torch

    from learner.prompts import prompt_source
    from rlhf_core.models import load_tokenizer
    from rollout_workers.engine import GenRequest, SamplingParams
    from rollout_workers.engine_factory import make_engine
    from rollout_workers.prompts import PromptRenderer

    slots = int(cfg.rollout.slots)
    waves = sorted({r for r in (1, 2, 4, 8, 16, 32, 64, 128, 256, slots, 2 * slots, 4 * slots) if r <= 4 * slots})
    big = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, slots=max(waves)))
    tokenizer = load_tokenizer(cfg.model)
    engine = make_engine(big, None, tokenizer)
    renderer = PromptRenderer(tokenizer, cfg.rollout.max_prompt_tokens, cfg.rollout.prompt_overflow)
    prompts = [renderer.render(p)[1] for _, p in zip(range(max(waves)), prompt_source(cfg)(0))]
    params = SamplingParams.from_config(cfg.rollout)
    decode: list[tuple[int, float, float]] = []  # (rows, ctx, s)
    first: list[tuple[int, int, float, float]] = []  # (rows, prompt tokens, ctx, s)
    responses: Counter[int] = Counter()
    seq = 0
    with torch.inference_mode():
        for _ in range(reps + 1):  # the first round warms up and is not kept
            for rows in waves:
                ids = [prompts[i % len(prompts)] for i in range(rows)]
                for prompt_ids in ids:
                    engine.add(GenRequest(f"c{seq}", list(prompt_ids), params))
                    seq += 1
                step = 0
                ctx = float(sum(len(p) for p in ids))
                while engine.has_work():
                    active = engine.num_active() + engine.num_waiting()
                    t0 = time.thread_time()
                    done = engine.step()
                    dt = time.thread_time() - t0
                    if _ > 0:
                        (first.append((rows, sum(len(p) for p in ids), ctx + rows, dt)) if step == 0
                         else decode.append((active, ctx, dt)))
                        responses.update(r.num_tokens for r in done)
                    # every row sampled a token (two in the prefill pass); the finished ones leave the context
                    ctx += active + (active if step == 0 else 0) - sum(len(r.prompt_ids) + r.num_tokens for r in done)
                    step += 1
    engine.close()
    d = fit([[1.0, r, c] for r, c, _ in decode], [t for *_, t in decode])
    extra = [t - (d[0] + d[1] * r + d[2] * c) for r, _, c, t in first]
    p = fit([[1.0, r, n] for r, n, _, _ in first], extra)
    prompt_counts = Counter(len(x) for x in prompts)
    gen = Generation(
        decode_base=d[0], decode_per_row=d[1], decode_per_ctx_token=d[2],
        prefill_base=p[0], prefill_per_row=p[1], prefill_per_token=p[2],
        prompt_tokens=Lengths(sorted(prompt_counts), [prompt_counts[k] for k in sorted(prompt_counts)]),
        response_tokens=Lengths(sorted(responses), [responses[k] for k in sorted(responses)]),
        max_new_tokens=int(cfg.rollout.max_new_tokens),
        cuda_graph_buckets=bool(cfg.rollout.cuda_graphs) and str(cfg.model.device).startswith("cuda"),
    )
    return gen, [(p, 0) for p in prompts]


def isolated_config(cfg: Any, url: str, address: str, pub_address: str, out: Path) -> Any:
    """The run's config with an admission budget that never runs out (the worker measured alone
    never waits for the learner) and this calibration's servers."""
    return dataclasses.replace(
        cfg,
        algo=dataclasses.replace(cfg.algo, max_staleness=1_000_000),
        buffer=dataclasses.replace(cfg.buffer, url=url, run_id=f"calib-{os.getpid()}", lookahead=None),
        weight_server=dataclasses.replace(cfg.weight_server, address=address, pub_address=pub_address),
        learner=dataclasses.replace(cfg.learner, checkpoint_dir=str(out / "checkpoints"), prometheus_port=None),
        rollout=dataclasses.replace(cfg.rollout, prometheus_port=None),
        run=dataclasses.replace(cfg.run, output_dir=str(out), loggers=[], prometheus_port=None),
    )


def measure_worker(cfg: Any, prompts: int, redis_cpu: Callable[[], float]) -> tuple[Worker, list[Any]]:
    """A real worker alone (budget unlimited): its engine steps, claims, appends and scoring calls
    timed in place, the rest of its loop per step (``per_iteration``). Returns the costs and the
    samples it appended (for the learner)."""
    from buffer import WorkerClient
    from rollout_workers.worker import RolloutWorker

    buf = WorkerClient.connect(cfg.buffer.url, cfg.buffer.run_id, cfg.buffer)
    worker = RolloutWorker(cfg, worker_id="calib-worker", buffer=buf)
    captured: list[Any] = []
    step = Timed(worker.engine.step)
    claim = Timed(buf.claim, lambda out, *a, **k: len(out))
    add = Timed(worker.engine.add)

    def prepared(out: Any, lease: Any, group: list[Any], *a: Any, **k: Any) -> int:
        captured.extend(group)
        return len(group)

    prepare = Timed(buf.prepare, prepared)
    complete = Timed(buf.complete_many, lambda out, items, *a, **k: len(out))
    score = Timed(worker.scoring.job, lambda out, items, *a, **k: len(items))
    timed = ((worker.engine, "step", step), (buf, "claim", claim), (worker.engine, "add", add),
             (buf, "prepare", prepare), (buf, "complete_many", complete), (worker.scoring, "job", score))
    for obj, method, wrapper in timed:  # an instance attribute shadows the method for this worker's run
        setattr(obj, method, wrapper)
    r0, t0 = redis_cpu(), time.thread_time()
    worker.run(max_prompts=prompts)
    main_cpu, redis_s = time.thread_time() - t0, redis_cpu() - r0
    buf.close()
    # Redis's own CPU for the calls, shared out per call
    redis_per_call = redis_s / max(1, len(claim.calls) + len(complete.calls))
    steps = max(1, len(step.calls))
    emit = fit([[1.0, n] for _, n in complete.calls], [c + redis_per_call for c, _ in complete.calls]) \
        if len(complete.calls) > 2 else [complete.total / max(1, len(complete.calls)), 0.0]
    per_sample_prepare = prepare.total / max(1, sum(n for _, n in prepare.calls))
    sc = fit([[1.0, n] for _, n in score.calls], [c for c, _ in score.calls]) if len(score.calls) > 2 else [0.0, 0.0]
    group = max(1, cfg.algo.group_size)
    rest = main_cpu - step.total - claim.total - prepare.total - complete.total
    costs = Worker(
        per_iteration=max(0.0, rest) / steps,
        claim_call=claim.total / max(1, len(claim.calls)) + redis_per_call,
        per_prompt=add.total / max(1, len(add.calls)) * group,
        emit_call=emit[0], per_sample_emit=emit[1] + per_sample_prepare,
        score_batch=sc[0], score_sample=sc[1],
    )
    log.info("worker alone: %d steps, %d claims, %d appends, main thread %.2f s CPU", steps, len(claim.calls),
             len(complete.calls), main_cpu)
    return costs, captured


def measure_learner(learner: Any, updates: int, redis_cpu: Callable[[], float]) -> dict[str, float]:
    """A real learner on the worker's samples: read, publish (snapshot), checkpoint, the rest."""
    read = Timed(learner.buffer.read_batch, lambda out, *a, **k: len(out.samples) if out else 0)
    update = Timed(learner.updater.update, lambda out, batch, *a, **k: batch.num_rows)
    publish = Timed(learner.publishing.publish)
    ckpt = Timed(learner.checkpoint)
    learner.buffer.read_batch, learner.updater.update, learner.publishing.publish, learner.checkpoint = \
        read, update, publish, ckpt
    r0, t0 = redis_cpu(), time.thread_time()
    learner.run(max_updates=updates)
    main_cpu, redis_s = time.thread_time() - t0, redis_cpu() - r0
    n = max(1, len(update.calls))
    samples = max(1, sum(s for _, s in read.calls))
    rest = main_cpu - read.total - update.total - publish.total - ckpt.total
    return {
        "read_per_sample": (read.total + redis_s) / samples,
        "snapshot_s": _median([c for c, _ in publish.calls[1:]]) if len(publish.calls) > 1 else publish.total,
        "checkpoint_s": _median([c for c, _ in ckpt.calls]) if ckpt.calls else 0.0,
        "per_update": max(0.0, rest) / n,
        "update_s": _median([c for c, _ in update.calls]),
    }


def measure_updates(learner: Any, cfg: Any, samples: list[Any], reps: int = 3) -> list[float]:
    """Update CPU against samples, micro-batches and tokens: [base, per micro, per sample, per token]."""
    from learner.update import PolicyUpdater

    collate = learner.reader.collate
    batch = int(cfg.learner.batch_size)
    group = int(cfg.algo.group_size)
    rows, ys = [], []
    sizes = sorted({max(group, batch // 4 // group * group), max(group, batch // 2 // group * group), batch, 2 * batch, 4 * batch})
    for n in sizes:
        if n > len(samples):
            continue
        for micro in sorted({n, max(1, n // 2)}):
            lcfg = dataclasses.replace(cfg.learner, batch_size=n, micro_batch_size=micro, num_minibatches=1)
            # the learner's own reference and critic: a run with either updates them (and gae needs the critic)
            updater = PolicyUpdater(dataclasses.replace(cfg, learner=lcfg), learner.engine, learner.ref, learner.critic)
            batch_samples = samples[:n]
            tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in batch_samples)
            times = []
            for r in range(reps + 1):
                t0 = time.thread_time()
                updater.update(collate(batch_samples), 0)
                if r:
                    times.append(time.thread_time() - t0)
            rows.append([1.0, -(-n // micro), float(n), float(tokens)])
            ys.append(_median(times))
    return fit(rows, ys)


def measure_sync(cfg: Any, reps: int = 5) -> Sync:
    """Publish and pull through a weight server: the policy, and a 4x larger set (cost per byte)."""
    from rlhf_core.models import load_policy
    from weight_server import WeightPublisher, WeightServer, WeightSubscriber

    ws_cfg = dataclasses.replace(cfg.weight_server, port=0, pub_port=0, address=None, pub_address=None)
    model = load_policy(cfg.model)
    small = {n: t.detach().clone() for n, t in model.state_dict().items()}
    large = {f"{n}.{i}": t for i in range(4) for n, t in small.items()}
    version = 0
    out: dict[str, list[tuple[float, float, float]]] = {"small": [], "large": []}
    with contextlib.ExitStack() as stack:  # closed in reverse, whatever fails
        server = stack.enter_context(WeightServer(ws_cfg))
        client_cfg = dataclasses.replace(ws_cfg, address=server.address, pub_address=server.pub_address)
        pub = stack.enter_context(WeightPublisher(server.address, client_cfg))
        sub = stack.enter_context(WeightSubscriber(server.address, server.pub_address, client_cfg, worker_id="calib-sync"))
        for r in range(reps + 1):
            for name, tensors in (("small", small), ("large", large)):
                version += 1
                nbytes = float(sum(t.numel() * t.element_size() for t in tensors.values()))
                t0 = time.process_time()  # the server thread runs in this process too
                pub.publish(version, tensors)
                t_pub = time.process_time() - t0
                t0 = time.process_time()
                if name == "small":
                    sub.pull(None, into=model)
                else:
                    sub.pull(None)
                t_pull = time.process_time() - t0
                if r:
                    out[name].append((nbytes, t_pub, t_pull))
    (b_s, pub_s, pull_s), (b_l, pub_l, pull_l) = [tuple(_median([x[i] for x in out[k]]) for i in range(3)) for k in ("small", "large")]
    per_byte_pub = max(0.0, (pub_l - pub_s) / (b_l - b_s))
    per_byte_pull = max(0.0, (pull_l - pull_s) / (b_l - b_s))
    return Sync(bytes=b_s, transport="shm" if cfg.weight_server.shm == "auto" else "tcp",
                snapshot_base=0.0, snapshot_per_byte=0.0,
                send_base=max(0.0, pub_s - per_byte_pub * b_s), send_per_byte=per_byte_pub,
                pull_base=max(0.0, pull_s - per_byte_pull * b_s), pull_per_byte=per_byte_pull)


# ---- all of it ----------------------------------------------------------------------------


def calibrate(cfg: Any, prompts: int = 160, quick: bool = False) -> Profile:
    """Run every measurement for ``cfg`` (the run's resolved config) and return the profile."""
    import psutil
    import torch

    from buffer import LearnerClient
    from buffer.local_server import RedisServer
    from learner.prompts import prompt_source
    from learner.trainer import Learner
    from weight_server import WeightServer

    threads = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    meter = BackgroundMeter()
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rlhf-plan-") as tmp, contextlib.ExitStack() as stack:
        out = Path(tmp)
        redis = RedisServer(out / "redis", fsync="everysec").start()
        stack.callback(redis.stop)
        ws = stack.enter_context(WeightServer(dataclasses.replace(cfg.weight_server, port=0, pub_port=0)))
        redis_proc = psutil.Process(redis.pid)

        def redis_cpu() -> float:
            t = redis_proc.cpu_times()
            return t.user + t.system

        gen, _ = measure_generation(cfg, reps=2 if quick else 3)
        log.info("generation: decode %.2f ms + %.3f ms/row", gen.decode_base * 1e3, gen.decode_per_row * 1e3)
        icfg = isolated_config(cfg, redis.url, ws.address, ws.pub_address, out)
        learner = Learner(icfg, buffer=LearnerClient.connect(redis.url, icfg.buffer.run_id, icfg.buffer), output_dir=out)
        stack.callback(learner.close)
        learner.publishing.publish(learner.version, learner.updates)
        learner.buffer.set_learner_version(learner.version, learner.updates)
        learner.buffer_producer.fill_prompts(prompt_source(icfg), epochs=icfg.data.epochs, low_watermark=4 * prompts)
        worker, samples = measure_worker(icfg, prompts, redis_cpu)
        batch = int(cfg.learner.batch_size)
        lstage = measure_learner(learner, max(4, len(samples) // batch - 1), redis_cpu)
        coef = measure_updates(learner, icfg, samples, reps=2 if quick else 3)
        launcher = measure_launcher(learner)
        handoff = measure_handoff(redis.url, float(len(os.sched_getaffinity(0))))
    sync = measure_sync(cfg, reps=3 if quick else 5)
    sync.snapshot_base = lstage["snapshot_s"]
    background = meter.cores()
    torch.set_num_threads(threads)
    lc = _learner_costs(coef, lstage)
    profile = Profile(
        kind="gpu" if identity_of(cfg)["device"] == "cuda" else "cpu",
        identity=identity_of(cfg),
        source={"how": "calibration", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "host": os.uname().nodename, "cpu_count": os.cpu_count(), "seconds": round(time.monotonic() - t_start, 1),
                "background_cores": round(background, 3), "loadavg": os.getloadavg(),
                "torch_threads": torch.get_num_threads(), "samples": len(samples),
                "learner_update_s_in_run": lstage["update_s"], "handoff": handoff},
        machine=Machine(cores=float(len(os.sched_getaffinity(0))), contention=1.0, background=0.0,
                        launcher_per_s=launcher, handoff_s=handoff["handoff_s"], handoff_busy_s=handoff["handoff_busy_s"]),
        generation=gen, worker=worker, learner=lc, sync=sync,
        notes=["costs are CPU seconds of the thread doing the work, measured alone; machine.contention is fitted "
               "to short runs of the same config (source.contention_fit); machine.background is the load of "
               "other jobs assumed during a run (0: a quiet machine); pass --background to simulate a busy one"],
    )
    if profile.kind == "cpu":  # on GPUs each process owns its device: no sharing of cores to fit
        profile.source["contention_fit"] = fit_contention(profile, cfg, updates=60 if quick else 100,
                                                          warmup=10 if quick else 20, runs=1 if quick else 3)
        profile.source["seconds"] = round(time.monotonic() - t_start, 1)
    return profile


def _learner_costs(coef: list[float], stage: dict[str, float]) -> Learner:
    return Learner(update_base=coef[0], update_per_micro=coef[1], update_per_sample=coef[2], update_per_token=coef[3],
                   per_update=stage["per_update"], read_base=0.0, read_per_sample=stage["read_per_sample"],
                   checkpoint_s=stage["checkpoint_s"])
