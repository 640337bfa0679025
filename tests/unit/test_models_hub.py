"""model.path as a Hugging Face Hub id: resolved from a cache laid out as the Hub client lays it
out (``models--org--name/{blobs,refs,snapshots}``), with ``HF_HUB_OFFLINE=1`` so nothing can be
downloaded, through the same loaders every process uses."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_core import models
from rlhf_core.config import ConfigError, ModelConfig

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(tmp_path: Path, tiny_model_cfg, repo: str = "acme/tiny-policy") -> Path:
    """A Hub cache holding ``repo`` at revision ``main``: files in blobs/ named by their hash,
    snapshots/<commit>/ made of symlinks to them, refs/main naming the commit."""
    built = models.build_tiny_model(tiny_model_cfg.tiny, tmp_path / "built")
    cache = tmp_path / "hf" / "hub"
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "blobs").mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)
    snap = root / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    for f in sorted(built.iterdir()):
        data = f.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    return cache


def resolve_in_child(cache: Path, value: str) -> subprocess.CompletedProcess:
    """Resolve in a fresh process: huggingface_hub reads HF_HUB_OFFLINE / HF_HUB_CACHE at import."""
    code = ("import sys; from rlhf_core.model_paths import resolve_path; from rlhf_core.config import ConfigError\n"
            "try:\n    print(resolve_path(sys.argv[1], 'model.path'))\n"
            "except ConfigError as e:\n    print('ConfigError:', e); sys.exit(3)\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_HOME=str(cache.parent),
               PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    return subprocess.run([sys.executable, "-c", code, value], capture_output=True, text=True, env=env, timeout=120)


def test_a_hub_id_resolves_to_its_cached_snapshot_offline(tmp_path, tiny_model_cfg):
    cache = hub_cache(tmp_path, tiny_model_cfg)
    res = resolve_in_child(cache, "acme/tiny-policy")
    assert res.returncode == 0, res.stdout + res.stderr
    snap = Path(res.stdout.strip())
    assert snap == cache / "models--acme--tiny-policy" / "snapshots" / COMMIT
    assert (snap / "config.json").is_symlink() and (snap / "config.json").exists()


def test_an_uncached_hub_id_offline_says_where_it_looked_and_what_to_do(tmp_path, tiny_model_cfg):
    cache = hub_cache(tmp_path, tiny_model_cfg)
    res = resolve_in_child(cache, "acme/not-there")
    assert res.returncode == 3, res.stdout + res.stderr
    assert "not in the Hugging Face cache" in res.stdout and str(cache) in res.stdout
    assert "HF_HUB_OFFLINE=1 forbids downloading" in res.stdout


def test_the_policy_tokenizer_and_reward_model_load_by_hub_id(tmp_path, tiny_model_cfg, monkeypatch):
    cache = hub_cache(tmp_path, tiny_model_cfg)
    from huggingface_hub import constants

    # the constants are read at import; this process imported huggingface_hub already
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = ModelConfig(name="hf", path="acme/tiny-policy", tokenizer_path="acme/tiny-policy")
    snap = cache / "models--acme--tiny-policy" / "snapshots" / COMMIT
    assert models.model_dir(cfg) == snap
    policy = models.load_policy(cfg)
    assert policy.config.vocab_size == len(models.load_tokenizer(cfg))
    with pytest.raises(ConfigError, match="not in the Hugging Face cache"):
        models.load_reference(ModelConfig(name="hf", path="acme/tiny-policy", ref_path="acme/missing"))


def test_a_local_folder_wins_and_a_non_id_is_refused(tmp_path, tiny_model_cfg, monkeypatch):
    monkeypatch.chdir(tmp_path)
    built = models.build_tiny_model(tiny_model_cfg.tiny, tmp_path / "acme" / "tiny")
    assert models.resolve_path("acme/tiny", "model.path") == Path("acme/tiny")  # the folder, not the Hub
    assert built.exists()
    with pytest.raises(ConfigError, match="no such folder"):
        models.resolve_path("./nowhere/model", "model.path")
    with pytest.raises(ConfigError, match="not a local HF-format model directory: it has no config.json"):
        models.resolve_path(str(tmp_path), "model.path")


def test_the_launcher_pins_hub_ids_to_snapshot_folders(tmp_path, tiny_model_cfg, monkeypatch):
    from huggingface_hub import constants

    from rlhf_core.model_paths import pin_model_paths, pin_reward_model_paths

    cache = hub_cache(tmp_path, tiny_model_cfg)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    snap = str(cache / "models--acme--tiny-policy" / "snapshots" / COMMIT)
    local = str(models.build_tiny_model(tiny_model_cfg.tiny, tmp_path / "local"))
    pinned = pin_model_paths(ModelConfig(name="hf", path="acme/tiny-policy", ref_path=local))
    assert (pinned.path, pinned.ref_path, pinned.tokenizer_path) == (snap, local, None)  # local folders stay
    rms = {"rm": {"path": "acme/tiny-policy", "weight": 0.5}}
    pin_reward_model_paths(rms)
    assert rms == {"rm": {"path": snap, "weight": 0.5}}


def test_pinning_a_hub_id_keeps_the_gateways_model_id_as_the_user_named_it(tmp_path, tiny_model_cfg, monkeypatch):
    # Once: the gateway served the snapshot folder's name, a commit hash, as its model id
    from huggingface_hub import constants

    from gateway.openai_api import served_name
    from rlhf_core.config import Config
    from rlhf_run.supervisor import pin_paths

    cache = hub_cache(tmp_path, tiny_model_cfg)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    cfg = Config()
    cfg.model, cfg.gateway.enabled = ModelConfig(name="hf", path="acme/tiny-policy"), True
    pin_paths(cfg)
    assert cfg.model.path == str(cache / "models--acme--tiny-policy" / "snapshots" / COMMIT)
    assert served_name(cfg) == "tiny-policy"
