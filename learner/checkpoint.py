"""Exact, atomic checkpoints of the learner, and the final HF-format export.

Layout under ``root_dir``::

    latest                 one line: the name of the newest complete checkpoint
    v00000012/             one checkpoint (the caller names it)
        policy/            the engine's state (torch: model.pt, optimizer.pt, scheduler.pt, masters.pt for a bf16 model;
                           DeepSpeed: its own save_checkpoint, every rank's partition)
        critic/            the same for the critic, when there is one
        rng/rank<r>.json   python and numpy RNG states of rank r
        rng/rank<r>.pt     torch CPU (and CUDA) RNG states of rank r
        extra.json         the caller's state: learner version, updater state, buffer commit ids ...
        meta.json          step name, sequence number, world size, format

A checkpoint is written into ``.tmp-<name>`` and renamed into place only when complete, and
``latest`` is replaced with ``os.replace``: a crash at any moment leaves the previous checkpoint
intact and ``latest`` pointing at a complete one. The newest ``keep`` checkpoints are kept; older
ones are pruned only after the new one is in place. A save that fails (a full disk) removes its
incomplete ``.tmp-<name>`` and raises :class:`CheckpointError` naming the folder and the free space.

Nothing is unpickled: JSON for our own state, ``torch.load(weights_only=True)`` for tensors.
(DeepSpeed's engine state is read by DeepSpeed's own loader; those files are ours too.)
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from learner.engines import TrainEngine, barrier, rank_and_world
from rlhf_core import lora
from rlhf_core.errors import UserError, free_space

LATEST = "latest"
FORMAT = 1


class CheckpointError(UserError):
    """A checkpoint that cannot be written or read; the message names the file."""


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _rng_state() -> tuple[dict[str, Any], dict[str, Any]]:
    version, state, gauss = random.getstate()
    np_state = np.random.get_state()
    assert isinstance(np_state, tuple)  # legacy=True, the default: (name, keys, pos, has_gauss, gauss)
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np_state
    as_json = {
        "python": [version, list(state), gauss],
        "numpy": [np_name, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
    }
    tensors: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state_all()
    return as_json, tensors


def _set_rng_state(as_json: dict[str, Any], tensors: dict[str, Any]) -> None:
    version, state, gauss = as_json["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = as_json["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available() and len(tensors["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(tensors["cuda"])


def _meta(path: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return meta if (path / "extra.json").exists() else None


def list_checkpoints(root_dir: str | Path) -> list[Path]:
    """Complete checkpoints under ``root_dir``, oldest first (by their sequence number)."""
    return [p for _, p in _numbered(root_dir)]


def _numbered(root_dir: str | Path) -> list[tuple[int, Path]]:
    """(sequence number, folder) of each complete checkpoint under ``root_dir``, oldest first."""
    root = Path(root_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if p.is_dir() and not p.name.startswith("."):
            meta = _meta(p)
            if meta is not None:
                found.append((int(meta.get("seq", 0)), p))
    return sorted(found)


def save_checkpoint(
    root_dir: str | Path,
    step_name: str,
    engine: TrainEngine,
    critic_engine: TrainEngine | None = None,
    extra: dict[str, Any] | None = None,
    keep: int = 3,
) -> Path:
    """Write a complete checkpoint atomically; call it on EVERY rank (DeepSpeed saves are collective).

    Args:
        root_dir: the checkpoint folder (shared by all ranks).
        step_name: this checkpoint's folder name, e.g. ``"v00000012"``; an existing one is replaced.
        engine, critic_engine: what to save.
        extra: the caller's JSON-serialisable state (learner version, ``PolicyUpdater.state_dict()``,
            buffer commit ids, incarnation id ...), returned by :func:`load_latest`.
        keep: newest checkpoints kept (older ones are deleted), >= 1.

    Returns:
        The checkpoint's folder.
    """
    if not step_name or "/" in step_name or step_name.startswith(".") or step_name == LATEST:
        raise CheckpointError(f"bad checkpoint name {step_name!r}: a plain folder name not starting with '.'")
    try:
        extra_text = json.dumps(extra or {}, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint extra state must be JSON-serialisable: {exc}") from None
    root = Path(root_dir)
    rank, world = rank_and_world()
    tmp, final = root / f".tmp-{step_name}", root / step_name
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left over by a crash mid-save
        (tmp / "rng").mkdir(parents=True)
    barrier()
    try:
        _write(root, tmp, final, step_name, engine, critic_engine, extra_text, keep, rank, world)
    except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as a RuntimeError
        if rank == 0 and _meta(tmp) is None:  # incomplete: its space back (a complete one may be the newest state)
            shutil.rmtree(tmp, ignore_errors=True)
        raise _write_failed(root, final, exc) from exc
    barrier()
    return final


def _write_failed(root: Path, final: Path, exc: BaseException) -> CheckpointError:
    reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
    return CheckpointError(
        f"cannot write checkpoint {final} ({reason}); {free_space(root)} (learner.checkpoint_dir={root}): make room there "
        "or point learner.checkpoint_dir at a larger disk (each checkpoint needs the room of one more while it is "
        "written), then resume the run (rlhf-run resume=<output folder>): the previous checkpoint is intact and "
        "the batches trained since it were not acked, so they are trained again"
    )


def _write(root: Path, tmp: Path, final: Path, step_name: str, engine: TrainEngine, critic_engine: TrainEngine | None,
           extra_text: str, keep: int, rank: int, world: int) -> None:
    """Write every rank's part into ``tmp``, then (rank 0) move it into place, point ``latest`` at
    it and prune: the steps of :func:`save_checkpoint` that write to disk."""
    engine.save_state(tmp / "policy")
    if critic_engine is not None:
        critic_engine.save_state(tmp / "critic")
    rng_json, rng_tensors = _rng_state()
    _write_json(tmp / "rng" / f"rank{rank}.json", rng_json)
    torch.save(rng_tensors, tmp / "rng" / f"rank{rank}.pt")
    barrier()
    if rank == 0:
        seq = max((n for n, _ in _numbered(root)), default=0) + 1
        (tmp / "extra.json").write_text(extra_text)
        _write_json(tmp / "meta.json", {"step_name": step_name, "seq": seq, "world_size": world,
                                        "format": FORMAT, "time": time.time()})
        _fsync_dir(tmp)
        old = root / f".old-{step_name}"
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)  # the commit point of the checkpoint itself
        _fsync_dir(root)
        pointer = root / ".latest.tmp"
        pointer.write_text(step_name + "\n")
        os.replace(pointer, root / LATEST)  # the commit point of "latest"
        _fsync_dir(root)
        shutil.rmtree(old, ignore_errors=True)
        for stale in list_checkpoints(root)[: -max(1, keep)]:
            shutil.rmtree(stale, ignore_errors=True)


def latest_checkpoint(root_dir: str | Path) -> Path | None:
    """The folder ``latest`` names, or (if that is missing or broken) the newest complete one.

    A crash between the two renames of a re-save under the same name (the folder moved aside,
    the new one not yet in place) leaves ``latest`` naming a folder that is gone while the new
    checkpoint, complete, is still ``.tmp-<name>``: that one is the newest, not an older name."""
    root = Path(root_dir)
    try:
        name = (root / LATEST).read_text().strip()
    except OSError:
        name = ""
    for candidate in ((name, f".tmp-{name}") if name else ()):
        if _meta(root / candidate) is not None:
            return root / candidate
    found = list_checkpoints(root)
    return found[-1] if found else None


def load_latest(root_dir: str | Path, engine: TrainEngine, critic_engine: TrainEngine | None = None) -> dict[str, Any] | None:
    """Restore the newest checkpoint into the engines and this rank's RNGs; call on every rank.

    Returns:
        The ``extra`` dict given to :func:`save_checkpoint`, or None when there is no checkpoint.
    """
    path = latest_checkpoint(root_dir)
    if path is None:
        return None
    rank, _ = rank_and_world()
    try:
        engine.load_state(path / "policy")
        if critic_engine is not None:
            if not (path / "critic").is_dir():
                raise CheckpointError(f"checkpoint {path} has no critic state, but this run trains a critic (algo.estimator=gae)")
            critic_engine.load_state(path / "critic")
        rng = path / "rng" / f"rank{rank}.json"
        if not rng.exists():  # resumed with more ranks than saved: start from rank 0's streams
            rng = path / "rng" / "rank0.json"
        _set_rng_state(json.loads(rng.read_text()), torch.load(rng.with_suffix(".pt"), weights_only=True))
        return json.loads((path / "extra.json").read_text())
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"cannot restore checkpoint {path}: {exc}; delete it to fall back to an older one") from exc


def export_hf(engine: TrainEngine, tokenizer: Any, out_dir: str | Path) -> Path:
    """Final export with ``save_pretrained`` (safetensors) + the tokenizer, loadable by
    ``transformers`` as is. A model with LoRA adapters is exported merged (``W0 + scaling * B @ A``
    under the base model's names, :func:`rlhf_core.lora.merged_state_dict`): a plain checkpoint
    that needs no peft. Call on every rank (ZeRO-3 gathers); rank 0 writes, atomically."""
    out = Path(out_dir)
    state = dict(engine.named_full_parameters())
    if engine.is_rank0 and lora.has_adapters(engine.module):
        state = lora.merged_state_dict(engine.module, state)
    if engine.is_rank0:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".tmp-{out.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        engine.module.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        old = out.parent / f".old-{out.name}"
        if out.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    barrier()
    return out
