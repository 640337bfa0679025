"""This service against TRL's ``GRPOTrainer``, side by side in one invocation.

Both train the same model directory with the same tokenizer, prompts, reward function, group
size, samples per update, response length, learning rate (and schedule, clipping, AdamW
settings) and number of updates, one after the other: TRL first (in a child process with torch's
own number of threads, one per core, as a user runs it; ``--trl-threads N`` sets another: on the
2-core machine, quiet, one thread trained 709 samples/s against 773 with two in the quick mode
(``vs_trl_quick_2026-12-01_trl_threads_{1,2}.json``), while beside other jobs two threads were
3x slower, 78-80 against 242-936 samples/s, spin-waiting for each other on the tiny model's
small products), then this service asynchronously
(``algo.max_staleness=2``, one worker with ``buffer.lookahead=2`` and two batches of slots: the
one-worker setting docs/usage.md recommends) and synchronously (``algo.max_staleness=0``), its
learner and worker with one torch thread each (what ``rlhf-run`` gives them on two cores). A
shell's ``OMP_NUM_THREADS`` reaches neither side. Reported per run:
trained samples/s, wall-clock and the mean batch reward over the last quarter of the updates;
the ratios to TRL go into the JSON, each seed's (its three runs back to back) and their median over
seeds. Target on the CPU machine: async >= 2x TRL at equal reward.

Reward: per update both sides compute the same thing. Given the same completions, TRL's
``GRPOTrainer`` as configured here and this service's learner give the same gradient (cosine
1.000000 over 40 updates, weights within 2e-6 after them); the norms differ by 0.1%, TRL adding
1e-4 to the group's std where this service adds 1e-6. The async run trains on samples up to two
versions old (their IS weight at most 1.14, none truncated). Between seeds the reward is not the
same: on the default task most runs level off at 0.17-0.20 over the last quarter of 1,200
updates and about one in three climbs further, to 0.22-0.29, on either side (13 seeds each: TRL
0.211, sync 0.212, async 0.204, standard errors 0.008, 0.009, 0.005). So a reward difference
between a few seeds' means says little; the summary's ``{async,sync}_reward_vs_trl`` is each
side's mean minus TRL's with twice its standard error over the seeds, the runs being the units
(none with one seed).

Modes:

- ``--quick`` (default): the default task and tiny model, 600 updates of 32 samples (group 4,
  6 new tokens, lr 3e-4), one seed; under 3 minutes on the 2-core machine.
- ``--full``: the same with 1,200 updates and 3 seeds (the per-seed spread of the reward).
- ``--gpu``: a Qwen2-0.5B-shaped model built from its config (random bf16 weights), batch 64,
  group 8, 128 prompt + 256 new tokens, on CUDA.
- ``--gpu-check``: the ``--gpu`` code path on a CPU, with a 2-layer model and a few updates.

Speed: trained samples/s in steady state, over the same training window on both sides: from the
end of update K to the end of the last update, the samples trained in it being (updates after K)
x batch. K is the mode's ``warmup_updates`` (in the JSON's config), by one rule: at least the
async run's ``buffer.lookahead`` + 1 = 3, because its worker goes on generating while the learner
runs its first updates (on a GPU the first one compiles, 12 s on an H100) and so enters the
window with up to ``lookahead`` batches already made (a head start of a quarter of an 8-update
run); the GPU modes take exactly that (updates of seconds each, on scarce device time), the CPU
modes (600 and 1,200 updates) 20, the warm-up their CPU-per-update figures always skipped, so
that on a CPU speed and cost cover the same updates. Start-up (a model load, a compile) is
outside the window on both sides. ``--updates`` must be larger than K. TRL's updates
are timed by a callback at the end of each optimizer step, this service's by the learner's
metrics rows (their ``time``, written at the end of each update). Each run's JSON row also keeps
the first-to-last-update figures (``first_to_last``), the window this bench used before.

Cost: CPU milliseconds per update of every process of each system over the same window (after
the first K updates; TRL's one process; this service's learner, workers, launcher with its
weight server, and redis-server), which says where the time goes and, unlike wall time, barely
moves with the machine's other load.

    .venv/bin/python bench/vs_trl.py [--quick|--full|--gpu|--gpu-check] [--updates N] [--seeds N] [--trl-threads N] [--no-sync]

Needs TRL (the ``baseline`` extra: ``pip install -c constraints-cpu.txt -e .[baseline]``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the repository root first: bench/buffer.py must not shadow the `buffer` package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import print_table, require_device, write_results  # noqa: E402

ASYNC_LOOKAHEAD = 2  # the async run's buffer.lookahead: batches its worker may make ahead of the learner
CPU_WARMUP = 20  # the warm-up the CPU-per-update figures used before the speed window skipped one too
# warmup_updates (K): the updates both sides train before the speed window opens (the module's docstring)
MODES: dict[str, dict[str, Any]] = {
    "quick": dict(model="tiny", device="cpu", dtype="float32", updates=600, seeds=1, batch=32, group=4,
                  prompt_tokens=None, new_tokens=6, lr=3e-4, micro_batch=32, warmup_updates=CPU_WARMUP),
    "full": dict(model="tiny", device="cpu", dtype="float32", updates=1200, seeds=3, batch=32, group=4,
                 prompt_tokens=None, new_tokens=6, lr=3e-4, micro_batch=32, warmup_updates=CPU_WARMUP),
    "gpu": dict(model="qwen2-0.5b", device="cuda", dtype="bfloat16", updates=30, seeds=1, batch=64, group=8,
                prompt_tokens=128, new_tokens=256, lr=1e-6, micro_batch=16, warmup_updates=ASYNC_LOOKAHEAD + 1),
    # warm-up + 2 updates: a window of two
    "gpu-check": dict(model="qwen2-0.5b", shape=dict(num_hidden_layers=2, vocab_size=4096), device="cpu",
                      dtype="float32", updates=5, seeds=1, batch=8, group=4, prompt_tokens=16, new_tokens=8, lr=1e-6,
                      micro_batch=8, warmup_updates=ASYNC_LOOKAHEAD + 1),
}
assert all(m["warmup_updates"] >= ASYNC_LOOKAHEAD + 1 for m in MODES.values()), "the async head start must be used up"
NUM_PROMPTS = 256


# ---------------------------------------------------------------------- the shared task

def prompts(spec: dict[str, Any], seed: int) -> list[dict[str, Any]]:
    """The prompt records both sides train on: the built-in count_up prompts for the tiny model;
    for a real-sized model, ``prompt_tokens`` random words of its tokenizer (same count_up reward)."""
    from rlhf_core.tasks import count_up_prompts

    rows = [{"prompt": p.text, "start": p.metadata["start"]} for p in count_up_prompts(NUM_PROMPTS, seed, 0)]
    if spec["prompt_tokens"]:
        import random

        rng = random.Random(seed)
        vocab = spec.get("shape", {}).get("vocab_size", 151936)
        for r in rows:  # the digit stays first: the reward reads the start from it
            r["prompt"] = f"{r['start']}: " + " ".join(f"t{rng.randrange(4, vocab)}" for _ in range(spec["prompt_tokens"] - 1))
    return rows


def model_path(spec: dict[str, Any], cache: Path) -> Path:
    if spec["model"] == "tiny":
        from rlhf_core.config import ModelConfig
        from rlhf_core.models import model_dir

        return model_dir(ModelConfig(cache_dir=str(cache)))
    from _models import qwen2_05b_dir

    return qwen2_05b_dir(cache, dtype="bfloat16" if spec["dtype"] == "bfloat16" else "float32", **spec.get("shape", {}))


def tokenizer_path(spec: dict[str, Any], path: Path) -> Path:
    if spec["model"] == "tiny":
        return path
    from _models import tokenizer_dir

    return tokenizer_dir(path)


def count_up(prompts: list[str], completions: list[str], start: list[int], **_: Any) -> list[float]:
    """The default task's reward in TRL's signature (the dataset's ``start`` column comes as a keyword)."""
    from rlhf_core.tasks import count_up_reward

    return [count_up_reward(p, c, [], {"start": s}) for p, c, s in zip(prompts, completions, start)]


# ---------------------------------------------------------------------- the speed window

def steady_window(times: list[float], trained: list[int], warmup: int) -> dict[str, Any]:
    """Trained samples/s from the end of update ``warmup`` to the end of the last one.

    ``times[i]``: when update i + 1 ended (one clock, any origin); ``trained[i]``: samples trained
    by then, cumulative. The window holds the updates after ``warmup``; its samples are theirs
    (updates after ``warmup`` x batch when every batch is full). ``warmup=1`` is the first-to-last
    window. Raises ValueError without an update after ``warmup``.
    """
    if warmup < 1 or len(times) <= warmup or len(trained) != len(times):
        raise ValueError(f"a window after {warmup} update(s) needs more than {warmup} timed updates "
                         f"(got {len(times)} times, {len(trained)} sample counts)")
    window_s = times[-1] - times[warmup - 1]
    samples = trained[-1] - trained[warmup - 1]
    return {"warmup_updates": warmup, "window_updates": len(times) - warmup, "training_window_s": window_s,
            "samples": samples, "trained_samples_per_s": samples / window_s if window_s > 0 else 0.0}


def check_updates(spec: dict[str, Any]) -> None:
    """Refuse a run whose speed window would be empty."""
    if spec["updates"] <= spec["warmup_updates"]:
        raise SystemExit(f"--updates {spec['updates']}: must be larger than this mode's warm-up of "
                         f"{spec['warmup_updates']} updates (the speed window opens after them), e.g. "
                         f"--updates {spec['warmup_updates'] + 8}")


# ---------------------------------------------------------------------- TRL (child process)

def trl_child(spec_file: str, out_file: str) -> None:
    """Train with TRL's GRPOTrainer as ``spec_file`` says; write timings and rewards to ``out_file``."""
    spec = json.loads(Path(spec_file).read_text())
    import torch

    if spec["trl_threads"]:  # OMP_NUM_THREADS says the same; this is what trains
        torch.set_num_threads(spec["trl_threads"])
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    step_times: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
            if spec["device"] == "cuda":
                torch.cuda.synchronize()
            step_times.append(time.monotonic())

    tok = AutoTokenizer.from_pretrained(spec["tokenizer_path"])
    bf16 = spec["dtype"] == "bfloat16"
    args = GRPOConfig(
        output_dir=spec["output_dir"], max_steps=spec["updates"],
        # one optimizer step per `batch` samples, accumulated over micro-batches as this service does
        per_device_train_batch_size=spec["micro_batch"], gradient_accumulation_steps=spec["batch"] // spec["micro_batch"],
        num_generations=spec["group"], max_completion_length=spec["new_tokens"], learning_rate=spec["lr"],
        # this service's schedule and optimizer: cosine to 0.1 x lr, no warm-up, clip 1.0, AdamW defaults
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1}, warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        beta=0.0, loss_type="dapo", scale_rewards="group", epsilon=0.2, temperature=1.0, top_p=1.0, top_k=0,
        num_iterations=1, logging_steps=1, report_to="none", save_strategy="no", seed=spec["seed"],
        use_cpu=spec["device"] == "cpu", bf16=bf16,
        model_init_kwargs={"dtype": torch.bfloat16 if bf16 else torch.float32},
    )
    trainer = GRPOTrainer(model=spec["model_path"], reward_funcs=[count_up], args=args,
                          train_dataset=Dataset.from_list(spec["prompts"]), processing_class=tok,
                          callbacks=[StepTimes()])
    t0 = time.monotonic()
    trainer.train()
    wall = time.monotonic() - t0
    rewards = [row["reward"] for row in trainer.state.log_history if "reward" in row]
    Path(out_file).write_text(json.dumps({"step_times": step_times, "train_wall_s": wall, "rewards": rewards,
                                          "threads": torch.get_num_threads()}))


def run_trl(spec: dict[str, Any], path: Path, seed: int, workdir: Path) -> dict[str, Any]:
    child = {**spec, "model_path": str(path), "tokenizer_path": str(tokenizer_path(spec, path)), "seed": seed, "prompts": prompts(spec, seed),
             "output_dir": str(workdir / f"trl-s{seed}")}
    spec_file, out_file = workdir / f"trl-s{seed}.json", workdir / f"trl-s{seed}.out.json"
    spec_file.write_text(json.dumps(child))
    t0 = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the service's 1 is not TRL's
    if spec["trl_threads"]:
        env["OMP_NUM_THREADS"] = str(spec["trl_threads"])
    child = subprocess.Popen([sys.executable, __file__, "--trl-child", str(spec_file), str(out_file)], env=env)
    cpu_samples = sample_cpu(child)  # (monotonic time, CPU seconds) of the child, until it exits
    wall = time.monotonic() - t0
    if child.returncode:
        raise SystemExit(f"the TRL child exited with {child.returncode}")
    res = json.loads(out_file.read_text())
    times, rewards = res["step_times"], res["rewards"]
    k = spec["warmup_updates"]
    if len(times) <= k:
        raise SystemExit(f"TRL timed {len(times)} updates of {spec['updates']}: none after the warm-up of {k}")
    trained = [spec["batch"] * (i + 1) for i in range(len(times))]  # every TRL step trains one full batch
    steady, first = steady_window(times, trained, k), steady_window(times, trained, 1)
    tail = rewards[-max(1, len(rewards) // 4):]
    return {"system": "trl", "seed": seed, "updates": len(times), "threads": res["threads"], "wall_s": wall,
            "warmup_updates": k, "window_updates": steady["window_updates"],
            "training_window_s": steady["training_window_s"],
            "trained_samples_per_s": steady["trained_samples_per_s"],
            "first_to_last": {"training_window_s": first["training_window_s"],
                              "trained_samples_per_s": first["trained_samples_per_s"]},
            "reward_start": rewards[0] if rewards else None,
            "reward_last_quarter": statistics.fmean(tail) if tail else None,
            "cpu_ms_per_update": trl_cpu_per_update(cpu_samples, times, warmup=k)}


def sample_cpu(proc: subprocess.Popen, interval_s: float = 0.25) -> list[tuple[float, float]]:
    """Cumulative CPU seconds (its threads and children) of ``proc`` every ``interval_s`` until it exits."""
    import psutil

    ps, out = psutil.Process(proc.pid), []
    while proc.poll() is None:
        try:
            t = ps.cpu_times()
            out.append((time.monotonic(), t.user + t.system + t.children_user + t.children_system))
        except psutil.NoSuchProcess:
            break
        time.sleep(interval_s)
    proc.wait()
    return out


def trl_cpu_per_update(samples: list[tuple[float, float]], step_times: list[float],
                       warmup: int = CPU_WARMUP) -> dict[str, float]:
    """TRL's CPU ms per update over its steps after ``warmup``: from the end of step ``warmup``, as
    this service's window opens once ``warmup`` updates are in its metrics file."""
    if warmup < 1 or len(step_times) <= warmup:
        return {}
    inside = [(t, c) for t, c in samples if step_times[warmup - 1] <= t <= step_times[-1]]
    if len(inside) < 2:
        return {}
    (t0, c0), (t1, c1) = inside[0], inside[-1]
    updates = sum(t0 <= t <= t1 for t in step_times) - 1
    return {"trl": 1e3 * (c1 - c0) / updates, "total": 1e3 * (c1 - c0) / updates} if updates > 0 else {}


# ---------------------------------------------------------------------- this service

def service_overrides(spec: dict[str, Any], path: Path, seed: int, data_file: Path | None, cache: Path) -> list[str]:
    o = [f"model.cache_dir={cache}",
        f"learner.max_updates={spec['updates']}", f"learner.batch_size={spec['batch']}",
        f"learner.micro_batch_size={spec['micro_batch']}", f"algo.group_size={spec['group']}",
        f"rollout.max_new_tokens={spec['new_tokens']}", f"learner.lr={spec['lr']}",
        f"learner.seed={seed}", f"rollout.seed={seed}", f"data.seed={seed}",
        "rollout.num_workers=1", "run.progress=false", "learner.checkpoint_every=1000",
    ]
    if spec["model"] != "tiny":
        o += ["model=hf", f"model.path={path}", f"model.tokenizer_path={tokenizer_path(spec, path)}", f"model.dtype={spec['dtype']}", f"model.device={spec['device']}",
              f"rollout.max_prompt_tokens={spec['prompt_tokens']}", "data=jsonl", f"data.path={data_file}"]
    return o


def run_service(name: str, spec: dict[str, Any], path: Path, seed: int, staleness: int, workdir: Path,
                data_file: Path | None, cache: Path) -> dict[str, Any]:
    from e2e import run_one

    overrides = service_overrides(spec, path, seed, data_file, cache) + [f"algo.max_staleness={staleness}"]
    if staleness > 0:
        # One worker: two batches admitted ahead, decoded in one wave, so the worker never waits for
        # a new version to be published and pulled (docs/usage.md, "Staleness vs lookahead")
        overrides += [f"buffer.lookahead={ASYNC_LOOKAHEAD}", f"rollout.slots={ASYNC_LOOKAHEAD * spec['batch']}"]
    else:  # one batch a wave (the default 32 slots are the CPU batch)
        overrides += [f"rollout.slots={spec['batch']}"]
    k = spec["warmup_updates"]
    row = run_one(f"{name}-s{seed}", overrides, workdir, cpu_warmup=k)
    if row["exit_code"] != 0:
        raise SystemExit(f"rlhf-run ({name}) exited with {row['exit_code']}; see {workdir / row['mode']}")
    from rlhf_core import metric_names as M
    from rlhf_run.summary import read_metrics

    # the learner's rows, one per update (a re-trained update's later row), each written as it ended
    metrics = read_metrics(workdir / row["mode"])
    if len(metrics) <= k:
        raise SystemExit(f"rlhf-run ({name}) wrote {len(metrics)} update rows: none after the warm-up of {k}")
    steady = steady_window([r[M.TIME] for r in metrics], [r[M.SAMPLES_TRAINED] for r in metrics], k)
    return {"system": name, "seed": seed, "updates": row["updates"], "wall_s": row["wall_s"],
            "warmup_updates": k, "window_updates": steady["window_updates"],
            "training_window_s": steady["training_window_s"], "trained_samples_per_s": steady["trained_samples_per_s"],
            # the run's own summary: its learner's first to last update
            "first_to_last": {"training_window_s": row["training_window_s"],
                              "trained_samples_per_s": row["trained_samples_per_s"]},
            "reward_start": row["reward_start"], "reward_last_quarter": row["reward_last_quarter"],
            "staleness_mean": row["staleness_mean"], "learner_compute_s": row["learner_compute_s"],
            "learner_wait_s": row["learner_wait_s"], "learner_read_s": row["learner_read_s"], "learner_mfu": row["learner_mfu"],
            "generated_tokens_per_s": row["generated_tokens_per_s"], "cpu_ms_per_update": row["cpu_ms_per_update"]}


# ---------------------------------------------------------------------- main

def reward_vs_trl(rows: list[dict[str, Any]], system: str) -> dict[str, Any]:
    """``system``'s mean last-quarter reward over seeds minus TRL's, with twice the standard error of
    that difference (the runs are the units: the seeds spread far more than one run's batches), and
    whether it is equal or better: not below -2 SE. Margin and verdict are None with one seed."""
    def rewards(name: str) -> list[float]:
        return [r["reward_last_quarter"] for r in rows if r["system"] == name and r["reward_last_quarter"] is not None]

    base, mine = rewards("trl"), rewards(system)
    if not base or not mine:
        return {"diff": None, "margin_2se": None, "equal_or_better": None}
    diff = statistics.fmean(mine) - statistics.fmean(base)
    if min(len(base), len(mine)) < 2:
        return {"diff": diff, "margin_2se": None, "equal_or_better": None}
    margin = 2 * math.sqrt(statistics.variance(base) / len(base) + statistics.variance(mine) / len(mine))
    return {"diff": diff, "margin_2se": margin, "equal_or_better": diff >= -margin}


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    systems = [s for s in ("trl", "async", "sync") if any(r["system"] == s for r in rows)]
    for system in systems:
        mine = [r for r in rows if r["system"] == system]
        rewards = [r["reward_last_quarter"] for r in mine if r["reward_last_quarter"] is not None]
        out[system] = {
            "trained_samples_per_s": statistics.median(r["trained_samples_per_s"] for r in mine),
            "reward_last_quarter": statistics.fmean(rewards) if rewards else None,
            "reward_spread": (max(rewards) - min(rewards)) if len(rewards) > 1 else None,
            "wall_s": statistics.fmean(r["wall_s"] for r in mine),
            # CPU of every process of the system per update (see bench/_common.CpuPerUpdate)
            "cpu_ms_per_update": statistics.median(r["cpu_ms_per_update"].get("total", math.nan) for r in mine),
        }
    for system in systems[1:]:
        out[f"{system}_reward_vs_trl"] = reward_vs_trl(rows, system)
    # side by side: each seed's runs against its own TRL run (back to back), then the median over seeds
    rate = {(r["system"], r["seed"]): r["trained_samples_per_s"] for r in rows}
    seeds = sorted({r["seed"] for r in rows})
    for system in systems[1:]:
        per_seed = [rate[system, seed] / (rate["trl", seed] or 1e-9) for seed in seeds]
        out[f"{system}_over_trl_per_seed"] = per_seed
        out[f"{system}_over_trl"] = statistics.median(per_seed)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = ap.add_mutually_exclusive_group()
    for m in MODES:
        group.add_argument(f"--{m}", action="store_true")
    ap.add_argument("--updates", type=int, default=None)
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--trl-threads", type=int, default=None,
                    help="torch threads of TRL's process (default: torch's own, one per core, as a user runs it)")
    ap.add_argument("--no-sync", action="store_true",
                    help="leave the sync run out (no target needs it; on a GPU it saves a third of the bench's time)")
    ap.add_argument("--cache-dir", default=os.environ.get("RLHF_TEST_CACHE") or "~/.cache/rlhf-service",
                    help="where the models are built (the tiny one as rlhf-run builds it)")
    ap.add_argument("--trl-child", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_child:
        return trl_child(*args.trl_child)
    mode = next((m for m in MODES if getattr(args, m.replace("-", "_"))), "quick")
    spec = dict(MODES[mode])
    spec["updates"] = args.updates or spec["updates"]
    spec["trl_threads"] = args.trl_threads
    check_updates(spec)
    seeds = args.seeds or spec["seeds"]
    require_device(spec["device"])
    try:
        import trl  # noqa: F401
    except ImportError:
        sys.exit("TRL is not installed: pip install -c constraints-cpu.txt -e '.[baseline]'")
    os.environ["OMP_NUM_THREADS"] = "1"  # this service's children, one thread each; TRL's child gets its own
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-vs-trl-") as tmp:
        workdir = Path(tmp)
        cache = Path(args.cache_dir).expanduser()
        path = model_path(spec, cache)
        for seed in range(seeds):
            data_file = None
            if spec["model"] != "tiny":
                data_file = workdir / f"prompts-s{seed}.jsonl"
                data_file.write_text("".join(json.dumps(r) + "\n" for r in prompts(spec, seed)))
            # the three back to back per seed: a change in the machine's load hits all of them
            rows.append(run_trl(spec, path, seed, workdir))
            rows.append(run_service("async", spec, path, seed, 2, workdir, data_file, cache))
            if not args.no_sync:
                rows.append(run_service("sync", spec, path, seed, 0, workdir, data_file, cache))
    s = summarise(rows)
    print_table(rows, f"{mode}: TRL GRPOTrainer vs this service (same model, task, samples, lr, updates)")
    print(f"\nasync / TRL trained samples/s after the first {spec['warmup_updates']} updates: "
          f"{s['async_over_trl']:.2f}x (median over {seeds} seed(s) of each seed's "
          f"ratio; target >= 2x on CPU, 5x on an H100)" + (f"; sync / TRL: {s['sync_over_trl']:.2f}x" if "sync" in s else ""))
    systems = [k for k in ("trl", "async", "sync") if k in s]
    print("CPU per update, all processes: " + ", ".join(f"{k} {s[k]['cpu_ms_per_update']:.0f} ms" for k in systems))
    print("reward over the last quarter: " + ", ".join(
        f"{k} {s[k]['reward_last_quarter']:.3f}" for k in systems if s[k]['reward_last_quarter'] is not None))
    for k in systems[1:]:
        g = s[f"{k}_reward_vs_trl"]
        if g["margin_2se"] is not None:
            print(f"{k} - TRL: {g['diff']:+.3f} +- {g['margin_2se']:.3f} (2 SE over {seeds} seeds): "
                  + ("equal or better" if g["equal_or_better"] else "lower"))
    write_results("vs_trl" if mode == "quick" else f"vs_trl_{mode.replace('-', '_')}", {
        "mode": mode, "config": {**spec, "seeds": seeds}, "runs": rows, "summary": s,
        "async_over_trl": s["async_over_trl"], "sync_over_trl": s.get("sync_over_trl"),
        "async_over_trl_per_seed": s["async_over_trl_per_seed"], "sync_over_trl_per_seed": s.get("sync_over_trl_per_seed"),
        "target": {"async_over_trl_cpu": 2.0, "async_over_trl_h100": 5.0},
        "notes": "trained samples/s in steady state: over the training window from the end of update "
                 "config.warmup_updates (K) to the end of the last, (updates - K) x batch samples, on both sides "
                 "(K >= the async run's buffer.lookahead + 1, so the samples its worker made during the first updates "
                 "are used up before the window opens; the CPU modes skip 20, the warm-up of the CPU figures); "
                 "each run's first_to_last: the window from the end of the first update, used before; "
                 "cpu_ms_per_update over the same updates; reward = mean batch reward over "
                 "the last quarter of the updates; TRL runs in its own process with trl_threads torch threads (null: "
                 "torch's own, one per core; its rows' threads), this service's learner and worker with one thread each (one worker); neither side "
                 "checkpoints during the run (TRL save_strategy=no, learner.checkpoint_every=1000)",
    })


if __name__ == "__main__":
    main()
