"""The tiny model and tokenizer are built locally and loaded through from_pretrained."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from learner.update import has_dropout
from rlhf_core import models
from rlhf_core.config import ConfigError, ModelConfig


def test_tiny_builds_once_and_loads_through_from_pretrained(tiny_model_cfg):
    path = models.model_dir(tiny_model_cfg)
    assert (path / "config.json").exists() and (path / "tokenizer.json").exists()
    mtime = (path / "config.json").stat().st_mtime
    assert models.model_dir(tiny_model_cfg) == path  # cached: same dir, not rebuilt
    assert (path / "config.json").stat().st_mtime == mtime
    policy = models.load_policy(tiny_model_cfg)
    tok = models.load_tokenizer(tiny_model_cfg)
    assert policy.config.vocab_size == len(tok) == 99
    assert policy.config._name_or_path == str(path)  # really came from the directory


def test_tiny_is_deterministic_in_its_seed(tiny_model_cfg, tmp_path):
    a = models.load_policy(tiny_model_cfg)
    other = replace(tiny_model_cfg, cache_dir=str(tmp_path))
    b = models.load_policy(other)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    c = models.load_policy(replace(other, tiny=replace(other.tiny, seed=1)))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


# Run by each of two gloo ranks: transformers' save_pretrained writes on rank 0 only.
RANK_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    import torch.distributed as dist
    from rlhf_core.config import ModelConfig
    from rlhf_core import models

    dist.init_process_group("gloo")
    rank, cache = dist.get_rank(), Path(sys.argv[1])
    cfg = ModelConfig(cache_dir=str(cache / "shared"))
    shared = models.load_policy(cfg)                      # both ranks build the same folder at once
    alone = models.build_tiny_model(cfg.tiny, cache / f"rank{rank}-alone")   # each rank by itself
    reloaded = models.load_policy(ModelConfig(path=str(alone)))
    (cache / f"rank{rank}.json").write_text(json.dumps({
        "shared": sorted(p.name for p in models.model_dir(cfg).iterdir()),
        "alone": sorted(p.name for p in alone.iterdir()),
        "same": all((a == b).all().item() for a, b in zip(shared.parameters(), reloaded.parameters())),
    }))
    dist.barrier()
    dist.destroy_process_group()
""")


@pytest.mark.timeout(180)
def test_every_torch_distributed_rank_builds_a_loadable_tiny_model(tmp_path):
    # rank 1 used to rename a folder holding only the tokenizer into place: no rank could load it
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(Path(models.__file__).parents[1]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(got["shared"]), got
        assert got["alone"] == got["shared"] and got["same"], got
    assert not [p for p in (tmp_path / "shared").iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_char_tokenizer_round_trips_text(tiny_model_cfg):
    tok = models.load_tokenizer(tiny_model_cfg)
    text = "count: 1 2 3 -> 4!"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text
    assert tok.eos_token == models.EOS and tok.pad_token_id == 0 and tok.padding_side == "left"


def test_dtype_from_config(tiny_model_cfg):
    model = models.load_policy(replace(tiny_model_cfg, dtype="bfloat16"))
    assert next(model.parameters()).dtype == torch.bfloat16


def test_reference_is_frozen_and_critic_has_value_head(tiny_model_cfg):
    ref = models.load_reference(tiny_model_cfg)
    assert not any(p.requires_grad for p in ref.parameters()) and not ref.training
    critic = models.load_critic(tiny_model_cfg)
    out = critic(input_ids=torch.tensor([[5, 6, 7]]))
    assert out.logits.shape == (1, 3, 1)
    # no dropout: a train-mode pass (the update's) gives the eval-mode values (its old_values);
    # transformers' head would drop 10% of the features without classifier_dropout=0
    assert not has_dropout(critic)
    critic.train()
    torch.testing.assert_close(critic(input_ids=torch.tensor([[5, 6, 7]])).logits, out.logits, rtol=0, atol=0)


def test_reward_model_from_local_dir(tiny_model_cfg, tmp_path):
    path = models.build_tiny_model(tiny_model_cfg.tiny, tmp_path / "rm", head="sequence")
    rm, tok = models.load_reward_model(path, tiny_model_cfg)
    out = rm(**tok(["ab", "abc"], return_tensors="pt", padding=True))
    assert out.logits.shape == (2, 1)


def test_errors_a_user_can_cause(tmp_path, tiny_model_cfg):
    with pytest.raises(ConfigError, match="not a local HF-format model directory"):
        models.model_dir(ModelConfig(path=str(tmp_path)))
    with pytest.raises(ConfigError, match="needs model.path"):
        models.model_dir(ModelConfig(name="qwen"))
    with pytest.raises(ConfigError, match="dtype 'float8' is not one of"):
        models.torch_dtype("float8")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            models.resolve_device("cuda")
    with pytest.raises(ConfigError, match="has no config.json"):
        models.load_reward_model(tmp_path, tiny_model_cfg)
    broken = tmp_path / "broken"  # a folder an older build left without its model
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{}")
    with pytest.raises(OSError, match="delete it and start again"):
        models.build_tiny_model(tiny_model_cfg.tiny, broken)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # its temporary copy is gone
