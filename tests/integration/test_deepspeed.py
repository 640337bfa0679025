"""DeepSpeed ZeRO on CPU (gloo): same trajectory as plain torch, checkpoints, 2 processes + publishing.

DeepSpeed runs in child processes (this file is also their script: ``python test_deepspeed.py
single|multi ...``) so the pytest process never initialises torch.distributed. Over gloo the
learner skips DeepSpeed's shm op, so nothing is compiled (``learner.engine_deepspeed.init_distributed``).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
UPDATES = 3
# Adam divides by sqrt(v): for a near-zero gradient, float rounding (which differs with the CPU's
# kernels and the reduction order across ranks) moves a weight by up to ~lr per step. Weights
# are compared within a few percent of that, while the updates themselves move them > 1e-3.
PARAM_TOL = 0.05 * 3e-3 * UPDATES


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")]))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


# ------------------------------------------------------------------ shared by test and children
def make_cfg(cache: str, engine: str, stage: int = 2):
    from learner_helpers import tiny_config
    from rlhf_core.config import ModelConfig

    return tiny_config(ModelConfig(cache_dir=cache), **{
        "learner.engine": engine, "learner.zero_stage": stage, "learner.lr": 3e-3, "learner.grad_clip": 1.0,
        "learner.micro_batch_size": 3, "learner.warmup_steps": 1, "learner.lr_schedule": "cosine",
        "learner.max_updates": 5, "algo.kl_coef": 0.02,
    })


def make_batches(base):
    from learner_helpers import digit_reward, generate_samples

    return [generate_samples(base, [[20 + i, 30], [21, 30, 4 + i]], 4, 5, seed=i, reward_fn=digit_reward, tag=f"b{i}")
            for i in range(UPDATES)]


def train(cfg, base, batches, ref):
    """UPDATES updates; returns (updater, [loss/policy per update], [grad norm per update])."""
    from learner.engine_factory import make_engine
    from learner.update import PolicyUpdater
    from learner_helpers import batch_of

    up = PolicyUpdater(cfg, make_engine(cfg, copy.deepcopy(base)), ref)
    metrics = [up.update(batch_of(up, b), v) for v, b in enumerate(batches)]
    return up, [m["loss/policy"] for m in metrics], [m["learner/grad_norm"] for m in metrics]


def full_state(engine) -> dict:
    return dict(engine.named_full_parameters())  # collective under ZeRO-3: every rank iterates


# ------------------------------------------------------------------ child processes
def child_single(cache: str, out: str, ckpt: str) -> None:
    """torch, ZeRO-2, ZeRO-3, ZeRO-2 with optimizer offload, ZeRO-3 with gradient checkpointing,
    in one process; then a ZeRO-3 checkpoint round trip, and ZeRO-3 gathering and exporting a
    model whose head is tied to its input embeddings."""
    import torch

    from learner.checkpoint import load_latest, save_checkpoint
    from learner.engine_factory import make_engine
    from learner.engines import shutdown_distributed
    from learner.update import PolicyUpdater
    from learner_helpers import batch_of
    from rlhf_core.models import load_policy

    base = load_policy(make_cfg(cache, "torch").model)
    ref = copy.deepcopy(base).eval()
    batches = make_batches(base)
    result, states = {}, {}
    variants = {"zero2": ("deepspeed", 2, {}), "zero3": ("deepspeed", 3, {}),
                "zero2_offload": ("deepspeed", 2, {"offload_optimizer": True}),
                "zero3_grad_ckpt": ("deepspeed", 3, {"gradient_checkpointing": True}),
                "zero2_bf16": ("deepspeed", 2, {"bf16": True})}
    for name, (engine, stage, opts) in {"torch": ("torch", 1, {}), **variants}.items():
        cfg = make_cfg(cache, engine, stage)
        cfg.learner.offload_optimizer = opts.get("offload_optimizer", False)
        cfg.learner.bf16 = opts.get("bf16", False)
        model = base
        if opts.get("gradient_checkpointing"):
            model = copy.deepcopy(base)
            model.gradient_checkpointing_enable()
        up, losses, norms = train(cfg, model, batches, ref)
        states[name] = full_state(up.engine)
        result[name] = {"loss": losses, "grad_norm": norms, "dtype": str(next(iter(states[name].values())).dtype)}
    for name in variants:
        result[name]["max_param_diff"] = max(float((states[name][k].float() - states["torch"][k]).abs().max())
                                             for k in states["torch"])
        result[name]["same_names"] = sorted(states[name]) == sorted(states["torch"])
    result["changed_from_init"] = max(float((states["torch"][k] - v.detach()).abs().max()) for k, v in base.named_parameters())

    # ZeRO-3 checkpoint: save after 1 update, continue 1 update; a fresh engine loads and does the same
    cfg = make_cfg(cache, "deepspeed", 3)
    first = PolicyUpdater(cfg, make_engine(cfg, copy.deepcopy(base)), ref)
    first.update(batch_of(first, batches[0]), 0)
    save_checkpoint(ckpt, "v1", first.engine, None, {"version": 1, "updater": first.state_dict()})
    first.update(batch_of(first, batches[1]), 1)
    want = full_state(first.engine)
    second = PolicyUpdater(cfg, make_engine(cfg, copy.deepcopy(base)), ref)
    extra = load_latest(ckpt, second.engine)
    second.load_state_dict(extra["updater"])
    second.update(batch_of(second, batches[1]), 1)
    got = full_state(second.engine)
    result["ckpt"] = {"version": extra["version"], "max_diff": max(float((got[k] - want[k]).abs().max()) for k in want),
                      "lr_equal": first.engine.lr == second.engine.lr, "steps": second.engine.global_step}
    # resumed with another lr and weight decay: the run's, not the checkpoint's (docs/usage.md: resume)
    from learner.engines import lr_lambda

    changed = make_cfg(cache, "deepspeed", 3)
    changed.learner.lr, changed.learner.weight_decay = 1e-4, 0.1
    third = make_engine(changed, copy.deepcopy(base))
    load_latest(ckpt, third)
    result["ckpt"]["resumed_changed"] = {
        "lr": third.lr, "want_lr": 1e-4 * lr_lambda(changed.learner)(third.global_step),
        "weight_decay": third.optimizer.param_groups[0]["weight_decay"], "steps": third.global_step}

    # a head tied to the input embeddings (Qwen2-0.5B, Llama-3.2-1B), as the torch engine names it
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from learner.checkpoint import export_hf
    from learner.engines import full_parameters
    from rlhf_core.models import tiny_model_config

    tied_cfg = tiny_model_config(cfg.model.tiny)
    tied_cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    tied = LlamaForCausalLM(tied_cfg).eval()
    x = torch.tensor([[5, 40, 41, 20, 21]])
    with torch.no_grad():
        want_logits = tied(input_ids=x).logits
    torch_names = sorted(n for n, _ in full_parameters(tied, None))
    engine = make_engine(cfg, tied)
    export_hf(engine, None, Path(ckpt).parent / "tied-export")
    with torch.no_grad():
        exported = AutoModelForCausalLM.from_pretrained(Path(ckpt).parent / "tied-export").eval()
        diff = float((exported(input_ids=x).logits - want_logits).abs().max())
    result["tied"] = {"names": sorted(full_state(engine)), "torch_names": torch_names, "export_logit_diff": diff,
                      "export_tied": exported.lm_head.weight is exported.model.embed_tokens.weight}
    Path(out).write_text(json.dumps(result))
    shutdown_distributed()


def child_multi(cache: str, out_dir: str, address: str) -> None:
    """2 ranks, ZeRO-3: rank 0's batches broadcast, updates, gather, rank 0 publishes."""
    import torch
    from safetensors.torch import save_file

    from learner.checkpoint import load_latest, save_checkpoint
    from learner.engine_deepspeed import init_distributed
    from learner.engine_factory import make_engine
    from learner.engines import broadcast_samples, shutdown_distributed
    from learner.update import PolicyUpdater
    from learner_helpers import batch_of
    from rlhf_core.config import WeightServerConfig
    from rlhf_core.models import load_policy

    init_distributed()
    rank = torch.distributed.get_rank()
    cfg = make_cfg(cache, "deepspeed", 3)
    base = load_policy(cfg.model)
    ref = copy.deepcopy(base).eval()
    local = make_batches(base) if rank == 0 else [None] * UPDATES
    batches = [broadcast_samples(b) for b in local]  # only rank 0 reads the buffer
    up = PolicyUpdater(cfg, make_engine(cfg, copy.deepcopy(base)), ref)
    metrics = [up.update(batch_of(up, b), v) for v, b in enumerate(batches)]
    losses = [m["loss/policy"] for m in metrics]
    # the tokens learner/tflops counts for this device: TFLOPS x time / (6 x params)
    flop_tokens = [m["learner/tflops"] * 1e12 * m["learner/time_compute_s"] / (6 * up.total_params) for m in metrics]
    state = full_state(up.engine)
    ckpt = Path(out_dir) / "ckpt"
    save_checkpoint(ckpt, f"v{UPDATES}", up.engine, None, {"version": UPDATES})
    fresh = make_engine(cfg, copy.deepcopy(base))
    extra = load_latest(ckpt, fresh)
    reloaded = full_state(fresh)
    if rank == 0:
        from weight_server import WeightPublisher

        with WeightPublisher(address, WeightServerConfig()) as pub:
            stats = pub.publish(UPDATES, state)
        save_file(state, str(Path(out_dir) / "published.safetensors"))
        (Path(out_dir) / "rank0.json").write_text(json.dumps({
            "losses": losses, "world": up.engine.world_size, "tensors": stats.tensors, "version": extra["version"],
            "reload_diff": max(float((reloaded[k] - state[k]).abs().max()) for k in state),
            "num_samples": sum(len(b) for b in batches), "flop_tokens": flop_tokens,
            "batch_tokens": [sum(len(x.prompt_ids) + len(x.response_ids) for x in b) for b in batches],
        }))
    else:
        assert state == {} and reloaded == {}, "only rank 0 receives gathered tensors"
        (Path(out_dir) / "rank1.json").write_text(json.dumps({"losses": losses, "samples": [len(b) for b in batches]}))
    # rank 1 must not tear gloo down while rank 0 is still publishing: it aborted ("terminate called
    # without an active exception") in CI when it reached destroy_process_group first
    shutdown_distributed()


def child_lora(cache: str, out: str, ckpt: str) -> None:
    """LoRA (model.lora.r=4) under torch, ZeRO-2 and ZeRO-3: the adapters alone train and are
    gathered for publishing; a ZeRO-3 checkpoint holds them without the frozen base weights and
    restores them; the ZeRO-3 export is the merged model."""
    import torch

    from learner.checkpoint import export_hf, load_latest, save_checkpoint
    from learner.engine_factory import make_engine
    from learner.engines import shutdown_distributed
    from rlhf_core import lora
    from rlhf_core.config import LoraConfig
    from rlhf_core.models import load_policy

    def lora_cfg(engine: str, stage: int):
        cfg = make_cfg(cache, engine, stage)
        cfg.model.lora = LoraConfig(r=4, alpha=8.0, target_modules=["all-linear", "lm_head"])
        cfg.algo.kl_coef = 0.0  # no reference model: the adapters' own trajectory
        return cfg

    batches = make_batches(load_policy(make_cfg(cache, "torch").model))
    result, published = {}, {}
    for name, (engine, stage) in {"torch": ("torch", 1), "zero2": ("deepspeed", 2), "zero3": ("deepspeed", 3)}.items():
        cfg = lora_cfg(engine, stage)
        torch.manual_seed(0)  # the same initial adapters (peft draws lora_A from the global RNG)
        model = load_policy(cfg.model)
        frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        up, losses, norms = train(cfg, model, batches, None)
        published[name] = dict(up.engine.named_trainable_parameters())
        full = full_state(up.engine)
        result[name] = {"loss": losses, "grad_norm": norms, "names": sorted(published[name]),
                        "adapter_names": sorted(lora.adapter_parameters(up.engine.module)),
                        "frozen_max_change": max(float((full[n] - v).abs().max()) for n, v in frozen.items())}
        if stage == 3:
            save_checkpoint(ckpt, "v3", up.engine, None, {"version": 3})
            torch.manual_seed(1)  # other initial adapters: the checkpoint must replace them
            fresh = make_engine(cfg, load_policy(cfg.model))
            load_latest(ckpt, fresh)
            restored = dict(fresh.named_trainable_parameters())
            result["ckpt_diff"] = max(float((restored[k] - v).abs().max()) for k, v in published[name].items())
            result["ckpt_bytes"] = sum(f.stat().st_size for f in Path(ckpt).rglob("*") if f.is_file())
            export_hf(up.engine, None, Path(ckpt).parent / "export")
            from transformers import AutoModelForCausalLM

            exported = AutoModelForCausalLM.from_pretrained(Path(ckpt).parent / "export").eval()
            x = torch.tensor([[5, 40, 41, 20, 21]])
            with torch.no_grad():
                want = load_policy(cfg.model)
                want.load_state_dict({**want.state_dict(), **published[name]})
                result["export_logit_diff"] = float((exported(input_ids=x).logits - want.eval()(input_ids=x).logits).abs().max())
    for name in ("zero2", "zero3"):
        result[name]["max_param_diff"] = max(float((published[name][k] - v).abs().max()) for k, v in published["torch"].items())
    result["model_bytes"] = sum(p.numel() * 4 for p in load_policy(make_cfg(cache, "torch").model).parameters())
    Path(out).write_text(json.dumps(result))
    shutdown_distributed()


# ------------------------------------------------------------------ tests
@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lora_trains_adapters_only_under_zero2_and_zero3(model_cache, tmp_path):
    out = tmp_path / "lora.json"
    proc = subprocess.run([sys.executable, str(HERE), "lora", str(model_cache), str(out), str(tmp_path / "ckpt")],
                          env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    r = json.loads(out.read_text())
    torch_run = r["torch"]
    assert torch_run["names"] == torch_run["adapter_names"] and len(torch_run["names"]) == 30  # 15 layers x (A, B)
    for stage in ("zero2", "zero3"):
        ds = r[stage]
        assert ds["names"] == torch_run["names"]  # what is published: the adapters, gathered
        assert ds["loss"] == pytest.approx(torch_run["loss"], rel=1e-4, abs=1e-6)
        assert ds["grad_norm"] == pytest.approx(torch_run["grad_norm"], rel=1e-4)
        assert ds["max_param_diff"] < PARAM_TOL
        assert ds["frozen_max_change"] == 0.0
    assert torch_run["frozen_max_change"] == 0.0
    assert r["ckpt_diff"] == 0.0
    assert r["ckpt_bytes"] < r["model_bytes"]  # adapters, optimizer state for them, no base weights
    assert r["export_logit_diff"] < 1e-4


@pytest.fixture(scope="module")
def single_run(model_cache, tmp_path_factory):
    d = tmp_path_factory.mktemp("ds-single")
    out = d / "result.json"
    proc = subprocess.run([sys.executable, str(HERE), "single", str(model_cache), str(out), str(d / "ckpt")],
                          env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", ["zero2", "zero3", "zero2_offload", "zero3_grad_ckpt"])
def test_zero_matches_plain_torch_for_a_few_updates(single_run, stage):
    torch_run, ds = single_run["torch"], single_run[stage]
    assert len(ds["loss"]) == UPDATES and ds["same_names"]
    assert ds["loss"] == pytest.approx(torch_run["loss"], rel=1e-4, abs=1e-6)
    assert ds["grad_norm"] == pytest.approx(torch_run["grad_norm"], rel=1e-4)
    assert ds["max_param_diff"] < PARAM_TOL
    assert single_run["changed_from_init"] > 1e-3  # the comparison is between trained weights
    assert ds["dtype"] == "torch.float32"


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_zero2_bf16_trains_in_bf16_close_to_fp32(single_run):
    bf16, fp32 = single_run["zero2_bf16"], single_run["torch"]
    assert bf16["dtype"] == "torch.bfloat16"  # the weights published are the bf16 training weights
    assert bf16["loss"] == pytest.approx(fp32["loss"], abs=2e-3)
    assert bf16["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=5e-2)
    # bf16 keeps 8 significant bits: the RMSNorm weights sit near 1.0, where bf16's spacing is 7.8e-3
    assert 1e-5 < bf16["max_param_diff"] < 2e-2


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_zero3_checkpoint_round_trip(single_run):
    ck = single_run["ckpt"]
    assert ck["version"] == 1 and ck["lr_equal"] and ck["steps"] == 2
    assert ck["max_diff"] == 0.0
    changed = ck["resumed_changed"]  # the optimizer's groups and the schedule held the checkpoint's
    assert changed["steps"] == 1 and changed["lr"] == pytest.approx(changed["want_lr"], rel=1e-12)
    assert changed["weight_decay"] == 0.1


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_zero3_gathers_a_tied_head_once_under_the_torch_engines_name(single_run):
    # module.named_parameters() lists a Parameter shared by two modules once (model.embed_tokens);
    # ZeRO-3 walked module by module and yielded it again as lm_head.weight, so every worker
    # (its target lists the torch names) refused every version
    tied = single_run["tied"]
    assert tied["names"] == tied["torch_names"] and "lm_head.weight" not in tied["names"]
    assert tied["export_tied"] and tied["export_logit_diff"] < 1e-5


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_process_zero3_trains_gathers_and_publishes(model_cache, tmp_path):
    import torch
    from safetensors.torch import load_file

    from rlhf_core.config import WeightServerConfig
    from rlhf_core.models import load_policy
    from servers import free_port
    from weight_server import WeightServer, WeightSubscriber

    ws_cfg = WeightServerConfig()
    server = WeightServer(ws_cfg).start()
    try:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
               str(HERE), "multi", str(model_cache), str(tmp_path), server.address]
        proc = subprocess.run(cmd, env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=280)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        with WeightSubscriber(server.address, server.pub_address, ws_cfg, worker_id="test") as sub:
            version, pulled = sub.pull()
    finally:
        server.stop()
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert r0["world"] == 2 and r0["version"] == UPDATES and r0["reload_diff"] == 0.0
    assert r1["samples"] == [8] * UPDATES and r0["num_samples"] == 8 * UPDATES  # every rank saw rank 0's batches
    assert r0["losses"] == r1["losses"]  # metrics are reduced over ranks
    # TFLOPS and MFU are per device: half of each batch's tokens (once: all of them, so 2x on 2 ranks)
    assert r0["flop_tokens"] == pytest.approx([n / 2 for n in r0["batch_tokens"]], rel=1e-6)
    published = load_file(str(tmp_path / "published.safetensors"))
    assert version == UPDATES and sorted(pulled) == sorted(published) and r0["tensors"] == len(published)
    assert all(torch.equal(pulled[k], published[k]) for k in published)
    # the gathered full weights equal a single-process torch run of the same updates
    base = load_policy(make_cfg(str(model_cache), "torch").model)
    up, losses, _ = train(make_cfg(str(model_cache), "torch"), base, make_batches(base), copy.deepcopy(base).eval())
    want = full_state(up.engine)
    assert sorted(want) == sorted(published)
    assert max(float((published[k] - want[k]).abs().max()) for k in want) < PARAM_TOL
    assert r0["losses"] == pytest.approx(losses, rel=1e-4, abs=1e-6)


if __name__ == "__main__":
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    mode, *args = sys.argv[1:]
    {"single": child_single, "multi": child_multi, "lora": child_lora}[mode](*args)
