"""LoRA weight sync: bytes and publish -> applied time per update, whole model vs LoRA adapters.

    .venv/bin/python bench/lora.py            # quick: the tiny model and a 4-layer Qwen2-0.5B-shaped model (bf16)
    .venv/bin/python bench/lora.py --full     # the same and the whole Qwen2-0.5B shape (bf16, 494M parameters)
    .venv/bin/python bench/lora.py --gpu      # on a GPU: the 4-layer and the whole Qwen2-0.5B shape, models on CUDA

Each update goes the way a run sends it: the learner (this process) changes what trains (every
weight, or the adapters only), takes the CPU snapshot ``Learner.publish`` takes
(``learner.engines.full_parameters`` / ``trainable_parameters``) and publishes it to a weight
server (its own process); a worker (its own process) holds the policy in an hf engine, waits
for the version's announcement as the worker loop does between decoding steps, pulls it into
``HFEngine.weights_target()`` (the model, or with LoRA its adapter tensors) and calls
``update_weights``. publish -> applied runs from before the snapshot to the worker's apply
returning (one host, one monotonic clock). Both data paths: shared memory (same host, the
default) and TCP (``shm=off``: workers on other hosts). LoRA: r=16 on all linear layers
(``all-linear``: the output head excluded), alpha 32. Times are medians over rounds.

Also measured (tiny model, CPU): the hf engine's decoding throughput with and without adapters,
the price of applying them merge-free (two thin matmuls per adapted layer and step).

Targets: with LoRA, bytes per update <= 5% of the whole model's and publish -> applied
<= 10% of the whole model's, on models where that is meaningful (not the 95k-parameter tiny one:
r=16 on its 64-wide layers is a third of its weights).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import mode_parser, print_table, require_device, write_results  # noqa: E402

LORA = {"r": 16, "alpha": 32.0, "target_modules": ["all-linear"]}
PATHS = ("shm", "tcp")
#: model name -> how to build it: the tiny model, or the Qwen2-0.5B shape with these overrides
MODELS = {
    "tiny": {"tiny": True, "dtype": "float32"},
    "qwen2-0.5b-shape-4-layers": {"shape": {"num_hidden_layers": 4}, "dtype": "bfloat16"},
    "qwen2-0.5b-shape": {"shape": {}, "dtype": "bfloat16"},
}
MODES = {
    "quick": {"models": ["tiny", "qwen2-0.5b-shape-4-layers"], "reps": 3, "device": "cpu"},
    "full": {"models": ["tiny", "qwen2-0.5b-shape-4-layers", "qwen2-0.5b-shape"], "reps": 5, "device": "cpu"},
    "gpu": {"models": ["qwen2-0.5b-shape-4-layers", "qwen2-0.5b-shape"], "reps": 5, "device": "cuda"},
}
TARGETS = {"bytes_ratio_max": 0.05, "applied_ratio_max": 0.10}
WARMUP = 2  # publishes per path before timing: the server's slabs, staging buffers and mappings get their pages


def model_config(name: str, cache_dir: str, device: str, lora: bool):
    from rlhf_core.config import LoraConfig, ModelConfig

    spec = MODELS[name]
    adapters = LoraConfig(**LORA) if lora else LoraConfig()
    if spec.get("tiny"):
        return ModelConfig(cache_dir=cache_dir, device=device, lora=adapters)
    from _models import qwen2_05b_dir, tokenizer_dir

    path = qwen2_05b_dir(cache_dir, dtype=spec["dtype"], **spec["shape"])
    return ModelConfig(name="hf", path=str(path), tokenizer_path=str(tokenizer_dir(path)), dtype=spec["dtype"],
                       device=device, cache_dir=cache_dir, lora=adapters)


def server_main(shm: str, conn) -> None:
    from rlhf_core.config import WeightServerConfig
    from weight_server import WeightServer

    server = WeightServer(WeightServerConfig(shm=shm))
    conn.send((server.address, server.pub_address))
    server.serve_forever()


def worker_main(addresses: dict, conn) -> None:
    """A rollout worker's weight path: hf engine, announcements, pull into its target, update_weights.
    ``("load", model config)`` builds the engine (one process for every model: imports once)."""
    import torch

    from rlhf_core.config import WeightServerConfig
    from rlhf_core.models import load_policy, load_tokenizer
    from rollout_workers.hf_engine import HFEngine
    from weight_server import WeightSubscriber

    torch.set_num_threads(1)
    engine = target = subs = None
    while True:
        cmd = conn.recv()
        if cmd[0] == "exit":
            break
        if cmd[0] == "load":  # fresh subscribers too: each one's skip-unchanged state belongs to one target
            for sub in (subs or {}).values():
                sub.close()
            engine = target = None
            model_cfg = cmd[1]
            engine = HFEngine(load_policy(model_cfg), load_tokenizer(model_cfg), slots=1, max_model_len=64,
                              cuda_graphs=False)
            target = engine.weights_target()
            subs = {path: WeightSubscriber(*addresses[path], WeightServerConfig(shm="auto" if path == "shm" else "off"),
                                           worker_id=f"worker-{path}") for path in PATHS}
            conn.send("ready")
            continue
        _, path, want = cmd
        sub = subs[path]
        while (sub.poll_announcement(timeout_ms=1) or -1) < want:  # between decoding steps, non-blocking
            pass
        got = sub.pull(None, into=target)  # what WeightFollower.pull_newest does
        engine.update_weights(None, got[0])
        conn.send((time.monotonic(), got[0], sub.stats["pulls_shm"]))
    for sub in (subs or {}).values():
        sub.close()


class Rig:
    """Two weight servers (shm and TCP), one worker process, one publisher per server, for the
    whole benchmark (versions only grow across models: the servers hold whatever comes)."""

    def __init__(self) -> None:
        from rlhf_core.config import WeightServerConfig
        from weight_server import WeightPublisher

        ctx = mp.get_context("spawn")
        self.procs, addresses = [], {}
        for path in PATHS:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=server_main, args=("auto" if path == "shm" else "off", child), daemon=True)
            proc.start()
            self.procs.append(proc)
            addresses[path] = parent.recv()
        self.pipe, child = ctx.Pipe()
        worker = ctx.Process(target=worker_main, args=(addresses, child), daemon=True)
        worker.start()
        self.procs.append(worker)
        self.pubs = {path: WeightPublisher(addresses[path][0], WeightServerConfig(shm="auto" if path == "shm" else "off"))
                     for path in PATHS}
        self.version = 0

    def load(self, model_cfg) -> None:
        """The worker (re)builds its engine on this model."""
        self.pipe.send(("load", model_cfg))
        assert self.pipe.recv() == "ready"

    def update(self, model, lora: bool, path: str) -> dict:
        """One update: change what trains, snapshot, publish, until the worker applied it."""
        import torch

        from learner.engines import full_parameters, trainable_parameters

        with torch.no_grad():  # an optimizer step's worth of change in every tensor that trains
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(1e-3)
        self.version += 1
        self.pipe.send(("follow", path, self.version))
        t0 = time.monotonic()
        tensors = list(trainable_parameters(model, None) if lora else full_parameters(model, None))
        stats = self.pubs[path].publish(self.version, tensors)
        t_applied, got, shm_pulls = self.pipe.recv()
        assert got == self.version, (got, self.version)
        assert stats.via == path and (shm_pulls > 0) == (path == "shm"), (stats.via, shm_pulls)  # the path really taken
        return {"bytes": stats.bytes, "tensors": stats.tensors, "publish_s": stats.duration_s, "applied_s": t_applied - t0}

    def close(self) -> None:
        self.pipe.send(("exit",))
        for pub in self.pubs.values():
            pub.close()
        for proc in self.procs:
            proc.terminate()
            proc.join(10)


def measure_model(rig: Rig, name: str, cache_dir: str, device: str, reps: int) -> list[dict]:
    import torch

    from rlhf_core.models import load_policy

    rows = []
    for lora in (False, True):
        cfg = model_config(name, cache_dir, device, lora)
        torch.manual_seed(0)
        model = load_policy(cfg)  # the learner's copy
        rig.load(cfg)
        for path in PATHS:
            for _ in range(WARMUP):
                rig.update(model, lora, path)
            runs = [rig.update(model, lora, path) for _ in range(reps)]
            rows.append({
                "model": name, "weights": "lora r=16" if lora else "full", "path": path,
                "params": sum(p.numel() for p in model.parameters() if not lora or p.requires_grad),
                "bytes": runs[0]["bytes"], "tensors": runs[0]["tensors"],
                "publish_s": statistics.median(r["publish_s"] for r in runs),
                "applied_s": statistics.median(r["applied_s"] for r in runs),
                "applied_s_rounds": [r["applied_s"] for r in runs],
            })
        del model
    return rows


def ratios(rows: list[dict]) -> dict:
    out: dict = {}
    for r in rows:
        if r["weights"] == "full":
            continue
        full = next(f for f in rows if (f["model"], f["path"], f["weights"]) == (r["model"], r["path"], "full"))
        out.setdefault(r["model"], {})[r["path"]] = {"bytes": r["bytes"] / full["bytes"],
                                                     "applied": r["applied_s"] / full["applied_s"]}
    return out


def generation_overhead(cache_dir: str) -> dict:
    """hf engine tokens/s on the tiny model (CPU, one thread) with and without LoRA adapters."""
    import torch

    from rlhf_core import lora as lora_mod
    from rlhf_core.models import load_policy, load_tokenizer
    from rollout_workers.engine import GenRequest, SamplingParams
    from rollout_workers.hf_engine import HFEngine

    torch.set_num_threads(1)
    out = {}
    for lora in (False, True):
        cfg = model_config("tiny", cache_dir, "cpu", lora)
        model = load_policy(cfg).eval()
        if lora:
            with torch.no_grad():
                for p in lora_mod.adapter_parameters(model).values():
                    p.normal_(0, 0.05)
        tok = load_tokenizer(cfg)
        engine = HFEngine(model, tok, slots=32, seed=0, max_model_len=64)
        params = SamplingParams(max_new_tokens=16, ignore_eos=True)
        best = 0.0
        for rnd in range(3):  # the first round warms up
            for i in range(64):
                engine.add(GenRequest(f"{rnd}-{i}", tok(f"{i % 10}:")["input_ids"], params))
            t0, tokens = time.perf_counter(), 0
            while engine.has_work():
                tokens += sum(r.num_tokens for r in engine.step())
            if rnd:
                best = max(best, tokens / (time.perf_counter() - t0))
        out["lora_tokens_per_s" if lora else "base_tokens_per_s"] = best
    out["lora_over_base"] = out["lora_tokens_per_s"] / out["base_tokens_per_s"]
    return out


def main() -> None:
    ap = mode_parser(__doc__, MODES)
    ap.add_argument("--reps", type=int, default=None, help="timed updates per model, weights and path")
    ap.add_argument("--cache-dir", default=os.environ.get("RLHF_TEST_CACHE") or os.path.join(tempfile.gettempdir(), "rlhf-bench-cache"))
    args = ap.parse_args()
    name = args.mode
    cfg = dict(MODES[name])
    reps = args.reps or cfg["reps"]
    import torch

    require_device(cfg["device"], "")
    torch.set_num_threads(1)
    t_start = time.monotonic()
    rig = Rig()
    try:
        rows = [row for model in cfg["models"] for row in measure_model(rig, model, args.cache_dir, cfg["device"], reps)]
    finally:
        rig.close()
    got = ratios(rows)
    gen = generation_overhead(args.cache_dir) if cfg["device"] == "cpu" else None
    device = torch.cuda.get_device_name(0) if cfg["device"] == "cuda" else "cpu"
    print_table([{k: v for k, v in r.items() if k != "applied_s_rounds"} for r in rows],
                f"weight sync per update, full model vs LoRA ({device}; publish -> applied in one worker, median of {reps})")
    big = [m for m in got if m != "tiny"]
    met = {m: {p: r["bytes"] <= TARGETS["bytes_ratio_max"] and r["applied"] <= TARGETS["applied_ratio_max"]
               for p, r in got[m].items()} for m in big}
    for m, per in got.items():
        print(f"{m}: " + "; ".join(f"{p}: bytes {r['bytes']:.4f}x, publish -> applied {r['applied']:.3f}x of the full model's"
                                   for p, r in per.items()))
    if gen:
        print(f"hf engine, tiny model: {gen['base_tokens_per_s']:.0f} tokens/s without adapters, "
              f"{gen['lora_tokens_per_s']:.0f} with (x{gen['lora_over_base']:.2f})")
    print(f"targets (bytes <= {TARGETS['bytes_ratio_max']:.0%}, publish -> applied <= {TARGETS['applied_ratio_max']:.0%} "
          f"of the full model's) on {', '.join(big)}: {'met' if all(v for per in met.values() for v in per.values()) else 'NOT met'}")
    write_results("lora" if name == "quick" else f"lora_{name}", {
        "mode": name, "device": device,
        "config": {"lora": LORA, "models": {m: MODELS[m] for m in cfg["models"]}, "reps": reps, "warmup": WARMUP,
                   "paths": list(PATHS), "seconds": time.monotonic() - t_start},
        "results": rows, "ratios": got, "targets": TARGETS, "met": met, "generation_tiny_cpu": gen,
        "notes": [
            "bytes: what the weight server received per version (PublishStats.bytes): every parameter and persistent "
            "buffer of the model, or its LoRA adapters only; a bf16 model's adapters are bf16 too.",
            "publish -> applied: from before the learner's CPU snapshot to the worker's update_weights returning, the "
            "worker pulling after the version's announcement as between decoding steps (median over rounds).",
            "tiny: r=16 on 64-wide layers is a third of its 95k parameters, and a version of a few hundred kB is "
            "fixed costs (round trips, hashing set-up) either way; the targets are for the Qwen2-shaped models.",
        ],
    })


if __name__ == "__main__":
    main()
