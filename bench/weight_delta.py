"""Delta codec benchmark: how many bytes a version takes as a delta against the one before, and
what encoding and applying it cost, for a Llama-shaped model trained with AdamW from fp32 masters.

    .venv/bin/python bench/weight_delta.py            # quick: a 16 MB (bf16) model, 3 updates per lr
    .venv/bin/python bench/weight_delta.py --full     # Qwen2-0.5B's shape, 20 updates per lr

After each update the fp32 masters are cast to bfloat16, float16 and float32 (the wire dtypes)
and every version is encoded against the one before with :class:`weight_server.keyframes.KeyframePolicy`
(``delta=on``, so float32 is measured too; ``max_share`` 1: every delta is kept), then applied and
checked bit for bit against the published tensor hashes. The batches are random token ids with the
causal LM loss: the update sizes follow AdamW's normalised steps, which is what decides how many
16-bit values move. Reported per (lr, dtype), medians over versions: the share of elements changed,
delta bytes / whole bytes, encode and apply seconds, and the encode rate. Codec only: the transport
(TCP, shared memory) is :mod:`bench.weight_sync`'s.

Target (issue 63): bf16 at lr 1e-6, delta bytes <= 10% of the whole version.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import mode_parser, print_table, write_results  # noqa: E402

QUICK_SHAPE = dict(vocab_size=2048, hidden_size=384, intermediate_size=1024, num_hidden_layers=4,
                   num_attention_heads=6, num_key_value_heads=6)
LRS = (1e-6, 1e-5)


def build_model(full: bool):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from _models import QWEN2_05B

    torch.manual_seed(0)
    if full:
        return Qwen2ForCausalLM(Qwen2Config(**QWEN2_05B)).float()
    return LlamaForCausalLM(LlamaConfig(**QUICK_SHAPE, max_position_embeddings=256)).float()


def measure(lr: float, updates: int, full: bool) -> list[dict]:
    import torch

    from rlhf_core.choices import DeltaMode
    from weight_server import protocol as P
    from weight_server.keyframes import KeyframePolicy, apply
    from weight_server.tensors import TORCH_TO_WIRE, byte_view

    model = build_model(full)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    policy = KeyframePolicy(DeltaMode.on, keyframe_every=updates + 2, max_share=1.0)
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    names = [n for n, _ in model.named_parameters()]

    def snapshot(dt):
        return [p.detach().to(dt, copy=True).contiguous() for p in model.parameters()]

    prev = {dt: snapshot(dt) for dt in dtypes}
    per: dict = {dt: [] for dt in dtypes}
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    for step in range(updates):
        ids = torch.randint(0, vocab, (4, 64), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        for dt in dtypes:
            cur = snapshot(dt)
            old_v, new_v = [byte_view(t) for t in prev[dt]], [byte_view(t) for t in cur]
            sizes = [t.element_size() for t in cur]
            wire = [TORCH_TO_WIRE[dt]] * len(cur)
            t0 = time.perf_counter()
            delta = policy.encode(step, step + 1, 0, old_v, new_v, wire, sizes)
            enc = time.perf_counter() - t0
            assert delta is not None
            t0 = time.perf_counter()
            got = apply(old_v, delta, sizes)
            dec = time.perf_counter() - t0
            assert [P.tensor_hash(b) for b in got] == [P.tensor_hash(v) for v in new_v], f"{names[0]}: not bit-exact"
            whole = sum(len(v) for v in new_v)
            changed = sum(int((a != b).sum()) for a, b in zip(prev[dt], cur))
            per[dt].append(dict(changed=changed / sum(t.numel() for t in cur), share=delta.nbytes / whole,
                                enc_s=enc, dec_s=dec, whole=whole, delta=delta.nbytes))
            prev[dt] = cur
    rows = []
    for dt, runs in per.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        rows.append({
            "lr": lr, "dtype": TORCH_TO_WIRE[dt], "whole_MB": med["whole"] / 1e6, "delta_MB": med["delta"] / 1e6,
            "changed_%": 100 * med["changed"], "delta/whole_%": 100 * med["share"], "encode_s": med["enc_s"],
            "apply_s": med["dec_s"], "encode_MB/s": med["whole"] / 1e6 / med["enc_s"], "versions": len(runs),
        })
    return rows


def main() -> None:
    args = mode_parser(__doc__).parse_args()
    full = args.mode == "full"
    updates = 20 if full else 3
    rows = [row for lr in LRS for row in measure(lr, updates, full)]
    print_table(rows, title=f"weight deltas ({args.mode}): medians over {updates} versions per lr")
    bf16 = next(r for r in rows if r["lr"] == 1e-6 and r["dtype"] == "bfloat16")
    target = {"bf16_lr1e-6_delta_share_le_10%": bf16["delta/whole_%"] <= 10.0}
    print(f"target bf16 lr 1e-6 delta <= 10% of the whole: {bf16['delta/whole_%']:.2f}% -> "
          f"{'met' if target['bf16_lr1e-6_delta_share_le_10%'] else 'MISSED'}")
    write_results(f"weight_delta_{args.mode}", {"mode": args.mode, "updates": updates, "rows": rows, "targets": target})


if __name__ == "__main__":
    main()
