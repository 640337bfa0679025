"""Multi-turn episodes: is an environment's latency hidden, and does the tiny task learn from the
environment's answers?

1. **Latency** (the target). A worker's episode loop (:class:`rollout_workers.episodes.EpisodeRunner`
   on the `hf` engine, the tiny model on the CPU): ``concurrency`` episodes in flight at all
   times (a finished one is replaced at once, as the worker admits prompts), 4 turns each, every
   turn a fixed number of tokens (8 to 24, drawn per turn; no EOS stop) so both settings decode
   the same tokens; ``rollout.slots`` below the concurrency, as in a worker, where an episode
   waiting for its environment holds no slot. The environment sleeps ``latency_ms`` per step on
   the thread pool. Generated tokens/s with 50 ms against 0 ms, alternating rounds (best of each).
   Target: >= 0.8. A third row waits for every environment call before the next decoding step (no
   overlap): what the latency costs when it is not hidden. On a CPU a decoding step's cost grows
   with the batch, so fewer active slots cost less there than on a GPU; the ratio can exceed 1.
2. **Learning**. ``rlhf-run experiment=multi_turn`` (the environment answers each turn with the
   digit that comes next) against ``rollout.env.hints=false`` (it answers ``?``: the no-tool
   baseline), the same number of updates each; mean reward over the last updates, and the share
   of the engine's prompt tokens whose K/V an episode's last turn left (not prefilled again).

    .venv/bin/python bench/multi_turn.py [--quick|--full] [--skip-learning]

``--quick`` stays under about a minute on a free 2-core machine (a short learning run);
``--full`` runs more episodes and updates. JSON in ``bench/results/multi_turn.json``
(``multi_turn_full.json``).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from _common import mode_parser, print_table, write_results  # noqa: E402
from rlhf_core import metric_names as M  # noqa: E402

MODES = {
    "quick": dict(episodes=256, concurrency=64, slots=32, turns=4, repeats=2, updates=100, tail=20),
    "full": dict(episodes=1024, concurrency=64, slots=32, turns=4, repeats=5, updates=300, tail=50),
}
LATENCIES_MS = (0, 50)
TARGET = 0.8


class LatencyEnv:
    """``turns`` turns, each answered after ``latency_ms`` with a short observation."""

    def __init__(self, latency_ms: float = 0.0, turns: int = 4) -> None:
        self.latency_s, self.turns, self.step_no = latency_ms / 1000.0, turns, 0

    def reset(self, prompt):
        return None

    def step(self, turn):
        time.sleep(self.latency_s)
        self.step_no += 1
        return ("|ok|", 1.0, self.step_no >= self.turns)


class FixedLengths:
    """The engine, with every turn's ``max_new_tokens`` fixed by the episode and turn (same in both
    settings) and EOS ignored, so both settings decode exactly the same tokens."""

    def __init__(self, engine, seed: int = 0) -> None:
        self.engine, self.seed = engine, seed

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def add(self, request) -> None:
        from dataclasses import replace

        n = random.Random(f"{self.seed}/{request.request_id}").randint(8, 24)
        self.engine.add(replace(request, params=replace(request.params, max_new_tokens=n, ignore_eos=True)))


def latency_round(model, tokenizer, latency_ms: float, m: dict, overlap: bool = True) -> dict:
    """One round; ``overlap=False`` waits for every environment call before the next decoding step
    (what a loop without concurrency does: the reference that shows what hiding is worth)."""
    from rlhf_core.config import RolloutConfig
    from rlhf_core.records import Prompt
    from rollout_workers.engine import SamplingParams
    from rollout_workers.environment import EnvFactory
    from rollout_workers.episodes import EpisodeRunner
    from rollout_workers.hf_engine import HFEngine
    from rollout_workers.prompts import PromptRenderer

    engine = FixedLengths(HFEngine(model, tokenizer, slots=m["slots"], max_model_len=256))
    env = {"_target_": f"{__name__}.LatencyEnv", "latency_ms": latency_ms, "turns": m["turns"]}
    run = EpisodeRunner(engine, tokenizer, PromptRenderer(tokenizer, 32), SamplingParams(max_new_tokens=24),
                        EnvFactory(RolloutConfig(env=env)), max_turns=m["turns"], max_context=256,
                        threads=m["concurrency"], timeout_s=30.0)
    started = finished = tokens = 0
    busy = steps = 0
    t0 = time.perf_counter()
    while finished < m["episodes"]:
        while started < m["episodes"] and started - finished < m["concurrency"]:
            run.start(f"e{started}", Prompt(f"p{started}", f"{started % 10}:"))
            started += 1
        done = []
        while not overlap and run.waiting_for_env():
            done += run.poll(0.05)
        if engine.has_work():
            for result in engine.step():
                tokens += result.num_tokens
                run.on_result(result)
            steps += 1
            busy += engine.num_active()
        done += run.poll(0.0 if engine.has_work() else 0.002)
        assert all(ep.error is None for ep in done), [ep.error for ep in done if ep.error]
        finished += len(done)
    wall = time.perf_counter() - t0
    run.close()
    return {"latency_ms": latency_ms, "overlap": overlap, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "mean_active_slots": busy / max(steps, 1)}


def bench_latency(m: dict) -> dict:
    from rlhf_core.config import ModelConfig
    from rlhf_core.models import load_policy, load_tokenizer

    model_cfg = ModelConfig(cache_dir=m["cache_dir"])
    model, tokenizer = load_policy(model_cfg).eval(), load_tokenizer(model_cfg)
    latency_round(model, tokenizer, 0, dict(m, episodes=m["concurrency"]))  # warm-up
    rounds: dict[Any, list[dict]] = {ms: [] for ms in LATENCIES_MS}
    for _ in range(m["repeats"]):
        for ms in LATENCIES_MS:
            rounds[ms].append(latency_round(model, tokenizer, ms, m))
    # once, on one wave of episodes: without overlap it is ten times slower
    rounds["50 blocking"] = [latency_round(model, tokenizer, 50, dict(m, episodes=m["concurrency"]), overlap=False)]
    best = {ms: max(rs, key=lambda r: r["tokens_per_s"]) for ms, rs in rounds.items()}
    rows = [dict(best[k], rounds_tokens_per_s=[round(r["tokens_per_s"], 1) for r in rs]) for k, rs in rounds.items()]
    ratio = best[50]["tokens_per_s"] / best[0]["tokens_per_s"]
    blocking = best["50 blocking"]["tokens_per_s"] / best[0]["tokens_per_s"]
    print_table(rows, f"latency: {m['concurrency']} concurrent episodes of {m['turns']} turns, {m['slots']} slots, "
                      f"{m['episodes']} episodes per round (best of {m['repeats']})")
    print(f"tokens/s with a 50 ms environment / with 0 ms: {ratio:.3f} (target >= {TARGET}); "
          f"without overlap (every call waited for): {blocking:.3f}")
    return {"rows": rows, "ratio_50ms_over_0ms": ratio, "ratio_50ms_not_overlapped": blocking, "target": TARGET,
            "met": ratio >= TARGET}


def learning_run(out: Path, hints: bool, m: dict) -> dict:
    cmd = [str(Path(sys.executable).parent / "rlhf-run"), "experiment=multi_turn", f"rollout.env.hints={str(hints).lower()}",
           f"hydra.run.dir={out}", "run.progress=false", f"learner.max_updates={m['updates']}", "rollout.num_workers=1",
           f"model.cache_dir={m['cache_dir']}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        raise SystemExit(f"rlhf-run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / M.METRICS_FILE).read_text().splitlines() if line.strip()]
    rewards = [r[M.REWARD_MEAN] for r in rows]
    tail = rewards[-m["tail"]:]
    # the worker's engine at its last heartbeat: prompt tokens whose K/V a finished turn left behind
    last = json.loads((out / "timeline.jsonl").read_text().splitlines()[-1])
    (worker,) = [c["stats"] for c in last["consumers"].values() if M.WORKER_ENGINE_PROMPT in c.get("stats", {})]
    return {"hints": hints, "updates": len(rows), "reward_first": rewards[0], "reward_last_mean": sum(tail) / len(tail),
            "prompt_tokens_reused": worker[M.WORKER_ENGINE_REUSED] / max(1, worker[M.WORKER_ENGINE_PROMPT]),
            "wall_s": time.perf_counter() - t0}


def bench_learning(m: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        rows = [learning_run(Path(tmp) / f"hints-{h}", h, m) for h in (True, False)]
    print_table(rows, f"learning: experiment=multi_turn, {m['updates']} updates, reward mean over the last {m['tail']}")
    gain = rows[0]["reward_last_mean"] - rows[1]["reward_last_mean"]
    print(f"with the environment's answers - without: {gain:+.3f}")
    return {"rows": rows, "reward_gain_over_no_tool": gain, "learns_past_baseline": gain > 0}


def main() -> None:
    ap = mode_parser(__doc__)
    ap.add_argument("--skip-learning", action="store_true", help="the latency part only")
    ap.add_argument("--episodes", type=int, help="episodes per latency round (the mode's by default)")
    ap.add_argument("--updates", type=int, help="updates per learning run (the mode's by default)")
    ap.add_argument("--cache-dir", default=os.environ.get("RLHF_TEST_CACHE") or "/tmp/rlhf-bench-cache")
    args = ap.parse_args()
    name = args.mode
    m = dict(MODES[name], cache_dir=args.cache_dir)
    for key in ("episodes", "updates"):
        if getattr(args, key):
            m[key] = getattr(args, key)
    m["tail"] = min(m["tail"], m["updates"])
    torch.set_num_threads(1)
    payload = {"mode": name, "config": m, "latency": bench_latency(m)}
    if not args.skip_learning:
        payload["learning"] = bench_learning(m)
    write_results("multi_turn" if name == "quick" else "multi_turn_full", payload)


if __name__ == "__main__":
    main()
