"""learner.checkpoint: exact resume (bit for bit on CPU), atomicity, pruning, RNG, HF export."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import resource
import shutil
import signal

import numpy as np
import pytest
import torch

from learner.checkpoint import CheckpointError, export_hf, latest_checkpoint, list_checkpoints, load_latest, save_checkpoint
from learner.engine_factory import make_engine
from learner.update import PolicyUpdater
from learner_helpers import digit_reward, generate_samples, tiny_config, train
from rlhf_core.models import load_critic, load_policy, load_tokenizer


@pytest.fixture(scope="module")
def base(tiny_model_cfg):
    return load_policy(tiny_model_cfg)


@pytest.fixture(scope="module")
def batches(base):
    return [generate_samples(base, [[20 + i, 30], [21, 30 + i]], 4, 5, seed=i, reward_fn=digit_reward, tag=f"b{i}")
            for i in range(4)]


def resume_cfg(tiny_model_cfg, **extra):
    # a schedule that moves every step, two minibatches, two epochs, running reward statistics
    over = {"learner.warmup_steps": 2, "learner.lr_schedule": "cosine", "learner.max_updates": 6,
            "learner.num_minibatches": 2, "learner.ppo_epochs": 2, "algo.normalize_rewards": True,
            "learner.lr": 3e-3, **extra}
    return tiny_config(tiny_model_cfg, **over)


def build(base, cfg, critic_model=None):
    engine = make_engine(cfg, copy.deepcopy(base))
    critic = make_engine(cfg, copy.deepcopy(critic_model)) if critic_model is not None else None
    return PolicyUpdater(cfg, engine, None, critic)


def state_of(up):
    out = {f"p.{n}": p.detach().clone() for n, p in up.engine.module.named_parameters()}
    for i, st in up.engine.optimizer.state_dict()["state"].items():
        out.update({f"o.{i}.{k}": v.clone() for k, v in st.items()})
    if up.critic is not None:
        out.update({f"c.{n}": p.detach().clone() for n, p in up.critic.module.named_parameters()})
    return out


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_resume_continues_bit_for_bit(estimator, base, batches, tiny_model_cfg, tmp_path):
    cfg = resume_cfg(tiny_model_cfg, **{"algo.estimator": estimator})
    critic_model = load_critic(tiny_model_cfg) if estimator == "gae" else None
    # the critic's head has dropout: the RNG streams must continue exactly too
    torch.manual_seed(0)
    straight = build(base, cfg, critic_model)
    for v, b in enumerate(batches):
        last = train(straight, b, v)

    torch.manual_seed(0)
    first = build(base, cfg, critic_model)
    for v, b in enumerate(batches[:2]):
        train(first, b, v)
    save_checkpoint(tmp_path, "v00000002", first.engine, first.critic, {"version": 2, "updater": first.state_dict()})
    del first
    torch.manual_seed(123)  # a restarted process starts from other RNG states
    resumed = build(base, cfg, critic_model)  # fresh weights, fresh optimizer: everything comes from disk
    extra = load_latest(tmp_path, resumed.engine, resumed.critic)
    assert extra["version"] == 2
    resumed.load_state_dict(extra["updater"])
    for v, b in enumerate(batches[2:], start=2):
        again = train(resumed, b, v)

    a, b = state_of(straight), state_of(resumed)
    assert a.keys() == b.keys() and len(a) > 20
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert resumed.engine.lr == straight.engine.lr and resumed.engine.global_step == straight.engine.global_step == 16
    assert again["loss/policy"] == last["loss/policy"] and again["reward/running_mean"] == last["reward/running_mean"]


def test_resume_trains_with_the_configs_optimizer_settings(base, batches, tiny_model_cfg, tmp_path, caplog):
    # `rlhf-run resume=<folder> learner.lr=...` changes the run's settings (docs/usage.md), but the
    # optimizer's param groups and LambdaLR's base_lrs in the checkpoint carried the old lr, betas,
    # eps and weight decay, and the resumed run trained on with them (the critic's too)
    cfg = resume_cfg(tiny_model_cfg, **{"algo.estimator": "gae"})
    critic_model = load_critic(tiny_model_cfg)
    first = build(base, cfg, critic_model)
    train(first, batches[0], 0)  # 2 epochs x 2 minibatches: 4 optimizer steps
    save_checkpoint(tmp_path, "v00000001", first.engine, first.critic, {"version": 1})
    new = resume_cfg(tiny_model_cfg, **{"algo.estimator": "gae", "learner.lr": 1e-4, "learner.critic_lr": 2e-4,
                                        "learner.weight_decay": 0.1, "learner.adam_betas": [0.8, 0.99],
                                        "learner.adam_eps": 1e-6, "learner.max_updates": 12})
    resumed = build(base, new, critic_model)
    with caplog.at_level("INFO", logger="learner.engines"):
        load_latest(tmp_path, resumed.engine, resumed.critic)
    # step 4 of the new schedule: warm-up 2, then cosine over 12 x 4 = 48 steps down to 0.1:
    # 0.1 + 0.9 * 0.5 * (1 + cos(pi * 2 / 46)) = 0.995806
    factor = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 2 / 46))
    for engine, lr in ((resumed.engine, 1e-4), (resumed.critic, 2e-4)):
        group = engine.optimizer.param_groups[0]
        assert engine.global_step == 4 and engine.lr == pytest.approx(lr * factor, rel=1e-12)
        assert (group["weight_decay"], tuple(group["betas"]), group["eps"]) == (0.1, (0.8, 0.99), 1e-6)
    assert "lr 0.003 -> 0.0001" in caplog.text and "weight_decay 0.0 -> 0.1" in caplog.text
    train(resumed, batches[1], 1)  # the schedule goes on from there: step 8 at the new lr
    assert resumed.engine.lr == pytest.approx(1e-4 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 6 / 46))))


def test_rng_states_are_restored(base, tiny_model_cfg, tmp_path):
    eng = make_engine(tiny_config(tiny_model_cfg), copy.deepcopy(base))
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    save_checkpoint(tmp_path, "a", eng, None, {})
    draws = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    load_latest(tmp_path, eng)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert draws[0] == again[0] and draws[1] == again[1] and torch.equal(draws[2], again[2])


def test_atomic_layout_latest_pointer_and_pruning(base, tiny_model_cfg, tmp_path):
    eng = make_engine(tiny_config(tiny_model_cfg), copy.deepcopy(base))
    assert load_latest(tmp_path / "none", eng) is None
    for i in range(4):
        save_checkpoint(tmp_path, f"v{i}", eng, None, {"version": i}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["v2", "v3"]
    assert (tmp_path / "latest").read_text().strip() == "v3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "v2", "v3"]  # no temp dirs left
    # a crash mid-save leaves a .tmp dir: ignored, and cleaned by the next save of that name
    (tmp_path / ".tmp-v4" / "policy").mkdir(parents=True)
    assert load_latest(tmp_path, eng)["version"] == 3
    # "latest" naming a checkpoint that is gone: fall back to the newest complete one
    (tmp_path / "latest").write_text("v9\n")
    assert latest_checkpoint(tmp_path).name == "v3"
    # re-saving an existing name replaces it
    save_checkpoint(tmp_path, "v2", eng, None, {"version": 22}, keep=2)
    assert json.loads((tmp_path / "v2" / "extra.json").read_text()) == {"version": 22}
    assert [p.name for p in list_checkpoints(tmp_path)] == ["v3", "v2"] and latest_checkpoint(tmp_path).name == "v2"
    # a crash between a re-save's two renames: v2 moved aside, the new v2 complete but still .tmp-v2;
    # it is the newest state (its batches were acked), not v3
    os.rename(tmp_path / "v2", tmp_path / ".old-v2")
    shutil.copytree(tmp_path / ".old-v2", tmp_path / ".tmp-v2")
    (tmp_path / ".tmp-v2" / "extra.json").write_text(json.dumps({"version": 23}))
    assert latest_checkpoint(tmp_path).name == ".tmp-v2" and load_latest(tmp_path, eng)["version"] == 23


def test_bad_names_and_unserialisable_state_are_refused(base, tiny_model_cfg, tmp_path):
    eng = make_engine(tiny_config(tiny_model_cfg), copy.deepcopy(base))
    with pytest.raises(CheckpointError, match="bad checkpoint name"):
        save_checkpoint(tmp_path, "../x", eng, None, {})
    with pytest.raises(CheckpointError, match="JSON-serialisable"):
        save_checkpoint(tmp_path, "v1", eng, None, {"t": torch.zeros(1)})
    assert list_checkpoints(tmp_path) == []


def test_missing_critic_state_is_a_clear_error(base, tiny_model_cfg, tmp_path):
    cfg = tiny_config(tiny_model_cfg)
    save_checkpoint(tmp_path, "v1", make_engine(cfg, copy.deepcopy(base)), None, {})
    critic = make_engine(cfg, load_critic(tiny_model_cfg))
    with pytest.raises(CheckpointError, match="no critic state"):
        load_latest(tmp_path, make_engine(cfg, copy.deepcopy(base)), critic)


def test_export_hf_loads_with_transformers_and_gives_the_same_logits(base, batches, tiny_model_cfg, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    up = build(base, tiny_config(tiny_model_cfg))
    train(up, batches[0], 0)  # trained weights, not the initial ones
    out = export_hf(up.engine, load_tokenizer(tiny_model_cfg), tmp_path / "final")
    assert (out / "model.safetensors").exists() and not (tmp_path / ".tmp-final").exists()
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tok("3:4567")["input_ids"]])
    with torch.no_grad():
        want = up.engine.module.eval()(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
        initial = base(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(got, initial)
    assert len(tok) == 99 and tok.decode(ids[0]) == "3:4567"


@contextlib.contextmanager
def file_size_limit(limit: int):
    """Writes past ``limit`` bytes of a file fail (EFBIG) in this process, as on a full disk."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an error from write(), not a killed process
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)


def test_a_save_the_disk_cannot_hold_stops_with_one_line_and_keeps_the_previous_checkpoint(base, tiny_model_cfg, tmp_path):
    eng = make_engine(tiny_config(tiny_model_cfg), copy.deepcopy(base))
    save_checkpoint(tmp_path, "v1", eng, None, {"version": 1}, keep=1)
    with file_size_limit(16 * 1024), pytest.raises(CheckpointError) as err:
        save_checkpoint(tmp_path, "v2", eng, None, {"version": 2}, keep=1)
    msg = str(err.value)
    assert f"cannot write checkpoint {tmp_path / 'v2'} (RuntimeError: " in msg, msg  # torch's words for EFBIG
    assert "free on its disk" in msg and "learner.checkpoint_dir" in msg and "resume" in msg and "\n" not in msg
    # the partial one is gone (its space back), the previous one kept (keep=1 prunes only after a save)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "v1"]
    assert load_latest(tmp_path, eng) == {"version": 1}
    save_checkpoint(tmp_path, "v2", eng, None, {"version": 2}, keep=1)  # room again: the next save goes through
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "v2"]
