"""A GPU profile of a 7B-shaped model from published figures, and the at-scale table.

The costs of each stage come from published numbers and the hardware's data sheet, each named
in :data:`SOURCES`; the workload (prompt and response lengths) is an assumption, stated.

Model: Qwen2.5-7B's shape (28 layers, hidden 3,584, 4 KV heads of 128, vocab 152,064,
7.6 B parameters), bf16. Devices: H100 SXM 80 GB, 8 per node.
"""

from __future__ import annotations

from typing import Any

from rlhf_run.plan.profile import Generation, Learner, Lengths, Machine, Profile, Sync, Worker

SHAPE = {"params": 7.6e9, "layers": 28, "hidden": 3584, "kv_heads": 4, "head_dim": 128, "vocab": 152064}
SHAPE["kv_bytes_per_token"] = 2 * SHAPE["layers"] * SHAPE["kv_heads"] * SHAPE["head_dim"] * 2  # K and V, bf16

H100 = {"bf16_flops": 989e12, "hbm_bytes_per_s": 3.35e12, "memory_bytes": 80e9, "nvlink_bytes_per_s": 450e9,
        "nic_bytes_per_s": 50e9}

#: where each number comes from
SOURCES = {
    "h100": "NVIDIA H100 SXM5 data sheet: 989 TFLOPS dense BF16, 3.35 TB/s HBM3, 80 GB, NVLink 4 900 GB/s "
            "(450 GB/s each way); DGX H100: 8 ConnectX-7 400 Gb/s NICs, one per GPU (50 GB/s)",
    "decode_efficiency": "vLLM decode of Llama-3.1-8B, one request, A100 40 GB: ~75 tokens/s, about 77% of the "
                         "memory-bandwidth roofline (J. Musgrave, 'vLLM throughput-latency sweep on NVIDIA A100', "
                         "vLLM 0.23): a decoding step reads the weights and the KV cache at 77% of HBM bandwidth",
    "vllm_cpu_overhead": "vLLM v0.6.0 performance update (blog.vllm.ai, 2024-09-05): host-side scheduling was the "
                         "bottleneck of Llama 8B on one H100 before multi-step scheduling; 1 ms of host time per "
                         "step is assumed to remain",
    "train_mfu": "Megatron-Core: up to 47% MFU on H100 clusters (NVIDIA Megatron-LM README; ~400 TFLOPS/GPU of "
                 "989); 40% is taken for a 7B model under DeepSpeed ZeRO",
    "prefill_mfu": "assumption: a prefill pass reaches 50% of peak (large GEMMs, as training's 40-47%)",
    "weight_sync": "this repository's weight server measured on an H100 machine "
                   "(bench/results/weight_sync_full_h100.json, 1 GB, TCP): publish 2.3 GB/s, one puller 2.2 GB/s, "
                   "4 pullers 5.3 GB/s together (the server's egress, CPU-bound: hashing and ZeroMQ)",
    "nccl_broadcast": "what-if (not in this service): an NCCL broadcast from the learner to every worker at the "
                      "NIC's 50 GB/s, as OpenRLHF, verl and NeMo-RL move weights (pipelined: the time of one copy)",
    "checkpoint": "assumption: ZeRO-sharded checkpoint of 16 bytes/parameter written at 2 GB/s per learner node",
    "workload": "assumption: prompts of 256 tokens, responses of 128-4,096 tokens with a long tail (mean ~935), "
                "groups of 8; a reasoning-RL-like shape",
}


def published_7b(transport: str = "weight_server") -> Profile:
    """The 7B profile; ``transport``: ``weight_server`` (this service, measured) or ``nccl`` (what-if)."""
    p, hw = SHAPE["params"], H100
    weight_bytes = 2 * p
    mem_bw = hw["hbm_bytes_per_s"] * 0.77
    gen = Generation(
        decode_base=weight_bytes / mem_bw + 1e-3, decode_per_row=0.0, decode_per_ctx_token=SHAPE["kv_bytes_per_token"] / mem_bw,
        prefill_base=weight_bytes / mem_bw, prefill_per_row=0.0, prefill_per_token=0.0,
        prompt_tokens=Lengths([256], [1.0]),
        response_tokens=Lengths([128, 256, 512, 1024, 2048, 4096], [0.10, 0.20, 0.30, 0.20, 0.15, 0.05]),
        max_new_tokens=4096, flops_per_token=2 * p, flops_per_s=0.5 * hw["bf16_flops"])
    worker = Worker(per_iteration=1e-4, claim_call=1e-3, per_prompt=1e-4, emit_call=1e-3, per_sample_emit=2e-4,
                    score_batch=1e-3, score_sample=1e-4)
    learner = Learner(update_base=0.05, update_per_micro=0.005, update_per_sample=0.0, update_per_token=0.0,
                      per_update=0.02, read_base=0.0, read_per_sample=5e-4, checkpoint_s=0.0,
                      flops_per_token=6 * p, flops_per_s=0.40 * hw["bf16_flops"], grad_bytes=2 * p,
                      intra_node_bytes_per_s=hw["nvlink_bytes_per_s"], inter_node_bytes_per_s=hw["nic_bytes_per_s"],
                      checkpoint_bytes=16 * p, checkpoint_bytes_per_s=2e9)
    if transport == "nccl":
        sync = Sync(bytes=weight_bytes, transport="nccl", snapshot_base=0.0, snapshot_per_byte=1 / hw["nvlink_bytes_per_s"],
                    send_base=0.01, send_per_byte=1 / hw["nic_bytes_per_s"], pull_base=0.01,
                    pull_per_byte=1 / hw["nic_bytes_per_s"], server_bytes_per_s=0.0)
    else:
        sync = Sync(bytes=weight_bytes, transport="tcp", snapshot_base=0.0, snapshot_per_byte=1 / 25e9,
                    send_base=0.05, send_per_byte=1 / 2.3e9, pull_base=0.05, pull_per_byte=1 / 2.2e9,
                    server_bytes_per_s=5.3e9)
    return Profile(
        kind="gpu",
        identity={"model": "published:qwen2.5-7b-shape", "dtype": "bfloat16", "lora_r": 0, "rollout_engine": "vllm",
                  "learner_engine": "deepspeed", "device": "cuda", "shape": dict(SHAPE)},
        source={"how": "published", "sources": dict(SOURCES), "transport": transport},
        machine=Machine(gpus_per_node=8, device_memory_bytes=hw["memory_bytes"]),
        generation=gen, worker=worker, learner=learner, sync=sync,
        notes=["per-stage costs from published figures (source.sources); no GPU measured them here"])


def table(gpus: list[int], transport: str = "weight_server", max_staleness: int = 4,
          batch_sizes: tuple[int, ...] = (512, 1024, 2048, 4096), updates: int = 30,
          simulations: int | None = 26) -> list[dict[str, Any]]:
    """Best plan per GPU count: predicted trained samples/s and tokens/s, staleness, the split.

    Each count's plans are searched by branch and bound (:func:`rlhf_run.plan.search.search`,
    without ties) within its share of ``simulations`` (new simulations for the whole table, shared
    out evenly over the counts still to search; None: no limit), the results cached across counts.
    A row says how many plans there were and were simulated, ``exact`` when the bound closed, else
    ``gap``. The pick's staleness bound is the least that runs the same simulation."""
    from rlhf_run.plan.records import Plan
    from rlhf_run.plan.search import Request, search, tightest_staleness

    profile = published_7b(transport)
    tokens = profile.generation.response_tokens.mean() + profile.generation.prompt_tokens.mean()
    rows: list[dict[str, Any]] = []
    cache: dict = {}
    left = simulations
    for i, n in enumerate(gpus):
        base = Plan(group_size=8, batch_size=batch_sizes[0], micro_batch_size=1, checkpoint_every=50, lookahead=1,
                    reward_batch_size=64)
        request = Request(base=base, gpus=n, nodes=max(1, n // 8), max_staleness=max_staleness, batch_sizes=batch_sizes)
        stats: dict[str, Any] = {}
        share = None if left is None else max(1, -(-left // (len(gpus) - i)))
        best = search(request, profile, top=1, updates=updates, ties=False, cache=cache, stats=stats,
                      simulate_at_most=share)[0]
        if left is not None:
            left = max(0, left - stats["simulated"])
        r, plan = best.result, tightest_staleness(best.plan, best.result)
        rows.append({
            "gpus": n, "learner_gpus": plan.learner_devices, "rollout_gpus": plan.workers, "slots": plan.slots,
            "batch_size": plan.batch_size, "micro_batch_size": plan.micro_batch_size, "zero_stage": plan.zero_stage,
            "max_staleness": plan.max_staleness, "lookahead": plan.lookahead,
            "trained_samples_per_s": r.trained_samples_per_s, "trained_tokens_per_s": r.trained_samples_per_s * tokens,
            "staleness_mean": r.staleness_mean, "learner_idle_frac": r.learner_idle_frac,
            "plans": stats["candidates"], "simulated": stats["simulated"], "exact": stats["exact"],
            "gap": round(stats["gap"], 4),
        })
    return rows
