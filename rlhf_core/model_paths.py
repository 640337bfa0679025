"""Where a model comes from: a local HF-format folder, or a Hugging Face Hub id resolved to its
snapshot folder in the Hub client's local cache. No torch here: the launcher pins the paths
before any process starts (one download at most), and every child loads the same folder.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from rlhf_core.config import ConfigError, ModelConfig

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def resolve_path(value: str, setting: str, need: str = "config.json") -> Path:
    """A local folder (it wins over a Hub id of the same spelling), or the snapshot folder of a
    Hub id (``huggingface_hub.snapshot_download``: the cache only with ``HF_HUB_OFFLINE=1``), that
    holds the file ``need``; :class:`ConfigError` saying where it looked otherwise."""
    path = Path(value).expanduser()
    if path.exists():
        if not (path / need).exists():
            raise ConfigError(f"{setting}={value} is not a local HF-format model directory: it has no {need}; point it at "
                              "a folder written by save_pretrained, or at a Hugging Face Hub id such as Qwen/Qwen2.5-0.5B-Instruct")
        return path
    if not _HUB_ID.match(value) or value.startswith((".", "~")):
        raise ConfigError(f"{setting}={value}: no such folder (and it is not a Hugging Face Hub id of the form "
                          "org/name); point it at a folder written by save_pretrained")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    offline = bool(constants.HF_HUB_OFFLINE)
    try:
        found = Path(snapshot_download(value, local_files_only=offline))
    except LocalEntryNotFoundError:
        raise ConfigError(
            f"{setting}={value}: no such folder, and the Hub id is not in the Hugging Face cache ({constants.HF_HUB_CACHE})"
            + (" while HF_HUB_OFFLINE=1 forbids downloading it: download it once online (huggingface-cli download "
               f"{value}) or point {setting} at a local folder" if offline else
               ": it could not be downloaded either (no network?); set HF_HUB_OFFLINE=1 to use the cache only")
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise ConfigError(f"{setting}={value}: resolving the Hugging Face Hub id failed ({exc}); check the id, "
                          "HF_TOKEN for a gated model, or point it at a local folder") from None
    if not (found / need).exists():
        raise ConfigError(f"{setting}={value} resolved to {found}, which has no {need}: not a transformers model")
    return found


def pin_model_paths(model: ModelConfig) -> ModelConfig:
    """``model`` with every Hub id among its paths replaced by its local snapshot folder now: every
    process loads the very same files, even if the Hub's ``main`` moves, without the network."""
    pinned: dict[str, Any] = {}
    for key, need in (("path", "config.json"), ("tokenizer_path", "tokenizer_config.json"),
                      ("ref_path", "config.json"), ("critic_path", "config.json")):
        value = getattr(model, key)
        if value and not Path(str(value)).expanduser().exists():
            pinned[key] = str(resolve_path(str(value), f"model.{key}", need))
    return dataclasses.replace(model, **pinned) if pinned else model


def pin_reward_model_paths(models: Any) -> None:
    """The same for ``reward.models.<name>.path`` (in place; a mapping of specs)."""
    for name, spec in (models or {}).items():
        value = spec.get("path") if hasattr(spec, "get") else None
        if value and not Path(str(value)).expanduser().exists():
            spec["path"] = str(resolve_path(str(value), f"reward.models.{name}.path"))
