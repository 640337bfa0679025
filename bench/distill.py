"""On-policy distillation against RL on the task reward alone, at equal updates, on the tiny setup.

1. A teacher: the default GRPO run on the built-in ``count_up`` task, exported in HF format
   (``learner.export_dir``), cached under ``~/.cache/rlhf-service/bench-distill/`` by its settings
   (a later run of the same mode reuses it; the JSON says whether it was trained now and how long
   that took).
2. From the fresh tiny model, each seed, the same settings but the signal: ``experiment=distill``
   with that teacher (the teacher's per-token advantage alone), and GRPO on the task reward alone
   at the same learning rate (``--full``: also at the default one, its own best).
3. Every final policy and the teacher, sampled alike (each prompt digit, ``EVAL_SAMPLES`` samples at
   the rollout's temperature, one seed): the mean ``count_up`` reward, "reward reached". From each
   run's ``metrics.jsonl``: the distilled student's reverse KL to the teacher
   (``distill/reverse_kl``, k1 per token, KL(mu || teacher)) over its first and last tenth of
   updates, and the teacher pass's share of the learner's compute (``distill/time_teacher_s`` over
   ``learner/time_compute_s``); from ``summary.json``: wall time and learner compute.

Targets (the issue's): the reverse KL falls by at least half within 300 updates, and the
student's reward approaches the teacher's (here: at least 0.8 of it).

    python bench/distill.py            # quick: teacher 1200 updates (the default run; trained on the first run only), students 100 updates, 1 seed
    python bench/distill.py --full     # teacher 4000 updates, students 300 updates x 3 seeds, RL at both learning rates
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root first (bench/buffer.py)
from _common import mode_parser, print_table, write_results  # noqa: E402
from e2e import compose  # noqa: E402

MODES = {
    "quick": {"teacher_updates": 1200, "updates": 100, "seeds": 1, "rl_default_lr": False},
    "full": {"teacher_updates": 4000, "updates": 300, "seeds": 3, "rl_default_lr": True},
}
EVAL_SAMPLES = 64  # per prompt digit
COMMON = ["run.progress=false", "learner.checkpoint_every=1000"]
TARGETS = {"reverse_kl_last_over_first_max": 0.5, "student_over_teacher_reward_min": 0.8}
CACHE = Path("~/.cache/rlhf-service/bench-distill").expanduser()


def launch(overrides: list[str], out: Path) -> dict[str, Any]:
    """One ``rlhf-run`` under ``overrides`` into ``out``; its summary, wall time and metrics rows."""
    from rlhf_core.metric_names import METRICS_FILE
    from rlhf_run.launch import run_launcher
    from rlhf_run.summary import SUMMARY_FILE

    t0 = time.monotonic()
    code = run_launcher(compose(COMMON + overrides), out)
    wall = time.monotonic() - t0
    if code != 0:
        sys.exit(f"rlhf-run {' '.join(overrides)} failed (exit {code}); see {out}/logs")
    rows = [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines() if line.strip()]
    return {"summary": json.loads((out / SUMMARY_FILE).read_text()), "wall_s": wall, "rows": rows}


def teacher(updates: int) -> tuple[Path, dict[str, Any]]:
    """The cached teacher of ``updates`` default GRPO updates (trained and exported if missing)."""
    overrides = [f"learner.max_updates={updates}"]
    key = hashlib.sha256(json.dumps(COMMON + overrides).encode()).hexdigest()[:12]
    folder, info_file = CACHE / f"teacher-{updates}u-{key}", CACHE / f"teacher-{updates}u-{key}.json"
    if folder.is_dir() and info_file.exists():
        return folder, {**json.loads(info_file.read_text()), "trained_now": False}
    with tempfile.TemporaryDirectory(prefix="bench-distill-teacher-") as tmp:
        run = launch(overrides + [f"learner.export_dir={folder}"], Path(tmp))
    info = {"path": str(folder), "overrides": overrides, "updates": run["summary"]["steps"], "train_wall_s": run["wall_s"],
            "reward_end": run["summary"]["reward_end"]}
    info_file.write_text(json.dumps(info, indent=2) + "\n")
    return folder, {**info, "trained_now": True}


def eval_reward(path: Path, rollout: Any, seed: int = 0) -> float:
    """The mean ``count_up`` reward of ``EVAL_SAMPLES`` samples to each prompt digit, as the workers
    sample them (the rollout's temperature and length, up to the first end-of-sequence token)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_core.sampling import process_logits, sample_tokens
    from rlhf_core.tasks import count_up_reward
    from rlhf_core.turns import encode

    model, tok = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    gen, rewards = torch.Generator().manual_seed(seed), []
    with torch.no_grad():
        for d in range(10):
            prompt = encode(tok, f"{d}:")
            ids = torch.tensor([prompt] * EVAL_SAMPLES)
            for _ in range(rollout.max_new_tokens):  # every row the same length: no padding, no cache
                logits = model(input_ids=ids, use_cache=False).logits[:, -1]
                ids = torch.cat([ids, sample_tokens(process_logits(logits, rollout.temperature), gen)[:, None]], 1)
            for row in ids[:, len(prompt):].tolist():
                resp = row[: row.index(tok.eos_token_id)] if tok.eos_token_id in row else row
                rewards.append(count_up_reward(f"{d}:", tok.decode(resp, skip_special_tokens=True), resp, {"start": d}))
    return statistics.fmean(rewards)


def tenth(rows: list[dict[str, Any]], key: str, last: bool) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    if not values:
        return None
    n = max(1, len(values) // 10)
    return statistics.fmean(values[-n:] if last else values[:n])


def student(method: str, overrides: list[str], seed: int, updates: int, tmp: Path, rollout: Any) -> dict[str, Any]:
    from rlhf_core import metric_names as M

    out = tmp / f"{method}-s{seed}"
    seeded = [f"learner.max_updates={updates}", f"learner.seed={seed}", f"rollout.seed={seed}", f"data.seed={seed}",
              f"learner.export_dir={out / 'export'}"]
    run = launch(overrides + seeded, out)
    rows, s = [r for r in run["rows"] if M.REWARD_MEAN in r], run["summary"]
    teacher_s = sum(r.get(M.DISTILL_TEACHER_S, 0.0) for r in rows)
    compute_s = sum(r[M.TIME_COMPUTE_S] for r in rows)
    kl_first, kl_last = tenth(rows, M.DISTILL_REVERSE_KL, False), tenth(rows, M.DISTILL_REVERSE_KL, True)
    step = max(1, len(rows) // 10)
    return {
        "method": method, "seed": seed, "updates": s["steps"],
        "eval_reward": eval_reward(out / "export", rollout, seed),
        "batch_reward_last_tenth": tenth(rows, M.REWARD_MEAN, True),
        "reverse_kl_first_tenth": kl_first, "reverse_kl_last_tenth": kl_last,
        "reverse_kl_last_over_first": kl_last / kl_first if kl_first and kl_last is not None else None,
        "reverse_kl_k3_last_tenth": tenth(rows, M.DISTILL_REVERSE_KL_K3, True),
        "wall_s": run["wall_s"], "training_window_s": s["training_window_s"],
        "learner_compute_s": s["throughput"]["learner_compute_s"],
        "teacher_pass_share": teacher_s / compute_s if teacher_s else None,
        "teacher_pass_ms_median": 1000 * statistics.median(r[M.DISTILL_TEACHER_S] for r in rows) if teacher_s else None,
        "update_ms_median": 1000 * statistics.median(r[M.TIME_COMPUTE_S] for r in rows),
        "reverse_kl_curve": [[r[M.UPDATES], r[M.DISTILL_REVERSE_KL]] for r in rows[::step] if M.DISTILL_REVERSE_KL in r],
        "entropy_last_tenth": tenth(rows, "loss/entropy", True),
    }


def mean_of(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.fmean(values) if values else None


def main() -> None:
    args = mode_parser(__doc__).parse_args()
    mode = MODES[args.mode]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t_start = time.monotonic()
    teacher_dir, teacher_info = teacher(mode["teacher_updates"])
    rollout = compose([]).rollout  # the sampling settings every run here trains with
    teacher_reward = eval_reward(teacher_dir, rollout)
    distill_lr = compose(["experiment=distill"]).learner.lr
    methods = {"distill": ["experiment=distill", f"distill.teacher.path={teacher_dir}"],
               "rl_same_lr": [f"learner.lr={distill_lr}"]}
    if mode["rl_default_lr"]:
        methods["rl_default_lr"] = []
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-distill-") as tmp:
        for seed in range(mode["seeds"]):  # the methods of one seed back to back: a change of load hits them all
            runs += [student(name, ov, seed, mode["updates"], Path(tmp), rollout) for name, ov in methods.items()]
    print_table([{k: v for k, v in r.items() if not k.endswith("_curve")} for r in runs],
                f"students, {mode['updates']} updates each (teacher: {teacher_info['updates']} GRPO updates, "
                f"eval reward {teacher_reward:.3f})")
    summary = {m: {k: mean_of([r for r in runs if r["method"] == m], k) for k in
                   ("eval_reward", "batch_reward_last_tenth", "reverse_kl_first_tenth", "reverse_kl_last_tenth",
                    "reverse_kl_last_over_first", "wall_s", "training_window_s", "learner_compute_s", "teacher_pass_share",
                    "update_ms_median", "entropy_last_tenth")} for m in methods}
    d, rl = summary["distill"], summary["rl_same_lr"]
    kl_ok = all(r["reverse_kl_last_over_first"] <= TARGETS["reverse_kl_last_over_first_max"] for r in runs if r["method"] == "distill")
    ratio = d["eval_reward"] / max(teacher_reward, 1e-9)
    print_table([{"method": m, **v} for m, v in summary.items()], f"mean over {mode['seeds']} seed(s)")
    print(f"\nreverse KL to the teacher: {d['reverse_kl_first_tenth']:.3f} -> {d['reverse_kl_last_tenth']:.3f} "
          f"(x{d['reverse_kl_last_over_first']:.3f}; halved in every seed: {'yes' if kl_ok else 'no'})")
    print(f"eval reward: distilled {d['eval_reward']:.3f} ({ratio:.2f} of the teacher's {teacher_reward:.3f}), "
          f"RL at the same lr {rl['eval_reward']:.3f}" + (f", RL at the default lr {summary['rl_default_lr']['eval_reward']:.3f}"
                                                           if "rl_default_lr" in summary else ""))
    print(f"teacher pass: {100 * d['teacher_pass_share']:.1f}% of the distilled student's learner compute; "
          f"update {d['update_ms_median']:.1f} ms (median) vs {rl['update_ms_median']:.1f} ms without a teacher")
    write_results("distill" if args.mode == "quick" else "distill_full", {
        "mode": args.mode, "config": {**mode, "eval_samples_per_prompt": EVAL_SAMPLES, "distill_lr": distill_lr,
                                      "methods": methods, "common": COMMON},
        "teacher": {**teacher_info, "eval_reward": teacher_reward},
        "summary": summary, "runs": runs,
        "student_over_teacher_reward": ratio, "distill_over_rl_same_lr_reward": d["eval_reward"] / max(rl["eval_reward"], 1e-9),
        "targets": {**TARGETS, "reverse_kl_halved_every_seed": kl_ok,
                    "student_approaches_teacher": ratio >= TARGETS["student_over_teacher_reward_min"]},
        "bench_wall_s": time.monotonic() - t_start,
    })


if __name__ == "__main__":
    main()
