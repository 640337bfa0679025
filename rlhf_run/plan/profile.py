"""A profile: the measured cost of every stage of the pipeline, as small fitted models, in JSON.

``rlhf-plan profile`` writes one; ``simulate`` and ``search`` read it. Every cost is in seconds of
work as measured alone on an idle core (``kind: cpu``) or device (``kind: gpu``); the simulator
decides how long that work takes when processes share the cores. A profile describes one model
and one pair of engines (its ``identity``, :func:`check_identity`).

The cost models are the sections' methods (``Generation.decode_s``, ``Learner.update_s``, ...):
linear in rows, context and tokens, floored on a GPU by the compute (``flops_per_token``). The
worker loop's: ``per_iteration`` (one pass: announcement poll, score collection), a claim round
trip, ``per_prompt`` (render + add a group's requests), an emit round trip plus ``per_sample_emit``,
scoring per batch and per sample. Weight sync: snapshot on the learner's main thread, send on its
publish thread, pull in each worker.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf_core.errors import UserError

SCHEMA = 2  # 2: machine.contention fitted to a run; reference_s and slowdown gone
KINDS = ("cpu", "gpu")


class ProfileError(UserError):
    """A profile file that cannot be used: missing, malformed, or for another model or engine."""


@dataclass
class Lengths:
    """An empirical distribution of token counts."""

    values: list[int]
    weights: list[float]

    def mean(self) -> float:
        total = sum(self.weights)
        return sum(v * w for v, w in zip(self.values, self.weights)) / total if total else 0.0


@dataclass
class Generation:
    decode_base: float
    decode_per_row: float
    decode_per_ctx_token: float
    prefill_base: float
    prefill_per_row: float
    prefill_per_token: float
    prompt_tokens: Lengths
    response_tokens: Lengths
    max_new_tokens: int
    flops_per_token: float = 0.0  # GPU: 2 x parameters (the compute floor of a pass)
    flops_per_s: float = 0.0  # GPU: FLOP/s a decoding or prefill pass reaches
    cuda_graph_buckets: bool = False  # decoding rows rounded up to a power of two (hf engine on CUDA)

    def decode_s(self, rows: int, ctx: float) -> float:
        if self.cuda_graph_buckets and rows > 1:
            rows = 1 << (rows - 1).bit_length()
        t = self.decode_base + self.decode_per_row * rows + self.decode_per_ctx_token * ctx
        if self.flops_per_s > 0:
            t = max(t, self.flops_per_token * rows / self.flops_per_s)
        return t

    def prefill_s(self, rows: int, tokens: int) -> float:
        t = self.prefill_base + self.prefill_per_row * rows + self.prefill_per_token * tokens
        if self.flops_per_s > 0:
            t = max(t, self.flops_per_token * tokens / self.flops_per_s)
        return t


@dataclass
class Worker:
    per_iteration: float
    claim_call: float
    per_prompt: float
    emit_call: float
    per_sample_emit: float
    score_batch: float
    score_sample: float


@dataclass
class Learner:
    update_base: float
    update_per_micro: float
    update_per_sample: float
    update_per_token: float
    per_update: float
    read_base: float
    read_per_sample: float
    checkpoint_s: float
    flops_per_token: float = 0.0  # GPU: 6 x parameters (forward and backward)
    flops_per_s: float = 0.0  # GPU: per device, peak x MFU
    grad_bytes: float = 0.0  # GPU: bytes of one gradient (reduced every step)
    intra_node_bytes_per_s: float = 0.0  # GPU: per-device collective bandwidth inside a node
    inter_node_bytes_per_s: float = 0.0  # GPU: per-device collective bandwidth across nodes
    checkpoint_bytes: float = 0.0  # GPU: bytes of a checkpoint, shared among the learner's nodes
    checkpoint_bytes_per_s: float = 0.0  # GPU: what one node writes per second

    def update_s(self, samples: int, tokens: float, micro_batch: int, devices: int = 1, zero_stage: int = 0,
                 gpus_per_node: int = 8) -> float:
        micro = math.ceil(samples / max(1, devices * micro_batch))
        t = self.update_base + self.update_per_micro * micro
        t += (self.update_per_sample * samples + self.update_per_token * tokens) / devices
        if self.flops_per_s > 0:
            t += self.flops_per_token * tokens / (self.flops_per_s * devices)
            t += self.comm_s(devices, zero_stage, gpus_per_node)
        return t

    def checkpoint_time(self, devices: int = 1, gpus_per_node: int = 8) -> float:
        t = self.checkpoint_s
        if self.checkpoint_bytes_per_s > 0:
            t += self.checkpoint_bytes / (self.checkpoint_bytes_per_s * math.ceil(devices / gpus_per_node))
        return t

    def comm_s(self, devices: int, zero_stage: int, gpus_per_node: int = 8) -> float:
        """Gradient traffic of one step (no overlap with compute assumed): a ring all-reduce
        (ZeRO 0-1) or reduce-scatter (2-3) of the gradient, plus ZeRO-3's two all-gathers of the
        parameters (forward and backward). Bandwidth: NVLink inside a node, the NIC across."""
        if devices <= 1 or self.grad_bytes <= 0:
            return 0.0
        bw = self.intra_node_bytes_per_s if devices <= gpus_per_node else self.inter_node_bytes_per_s
        if bw <= 0:
            return 0.0
        ring = (devices - 1) / devices * self.grad_bytes / bw
        return {0: 2 * ring, 1: 2 * ring, 2: ring + ring, 3: ring + 3 * ring}.get(zero_stage, 2 * ring)


@dataclass
class Sync:
    bytes: float
    transport: str  # shm | tcp
    snapshot_base: float
    snapshot_per_byte: float
    send_base: float
    send_per_byte: float
    pull_base: float
    pull_per_byte: float
    server_bytes_per_s: float = 0.0  # > 0: the weight server's egress, shared by concurrent pulls

    def snapshot_s(self) -> float:
        return self.snapshot_base + self.snapshot_per_byte * self.bytes

    def send_s(self) -> float:
        return self.send_base + self.send_per_byte * self.bytes

    def pull_s(self, concurrent: int = 1) -> float:
        t = self.pull_base + self.pull_per_byte * self.bytes
        if self.server_bytes_per_s > 0:
            t = max(t, self.pull_base + self.bytes * max(1, concurrent) / self.server_bytes_per_s)
        return t


@dataclass
class Machine:
    cores: float = 2.0  # cpu: cores the run's processes share
    contention: float = 1.0  # cpu: slowdown of each busy thread while two or more are busy (fitted to a run)
    background: float = 0.0  # cpu: cores kept busy by other work during the calibration
    launcher_per_s: float = 0.0  # cpu: core-seconds per second of the launcher's own work
    handoff_s: float = 0.0  # cpu: wall seconds before a thread woken by another runs, a core free
    handoff_busy_s: float = 0.0  # cpu: added per runnable thread beyond the cores (see plan.des)
    gpus_per_node: int = 8  # gpu
    device_memory_bytes: float = 0.0  # gpu: memory of one device


@dataclass
class Profile:
    kind: str
    identity: dict[str, Any]
    source: dict[str, Any]
    machine: Machine
    generation: Generation
    worker: Worker
    learner: Learner
    sync: Sync
    schema: int = SCHEMA
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path


_SECTIONS = {"machine": Machine, "generation": Generation, "worker": Worker, "learner": Learner, "sync": Sync}


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ProfileError(f"{where} must be a JSON object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    missing = sorted(n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
    if unknown or missing:
        raise ProfileError(f"{where}: " + "; ".join(
            ([f"unknown key(s) {unknown}"] if unknown else []) + ([f"missing key(s) {missing}"] if missing else [])))
    kwargs = dict(data)
    for name in ("prompt_tokens", "response_tokens"):
        if name in kwargs:
            kwargs[name] = _build(Lengths, kwargs[name], f"{where}.{name}")
    return cls(**kwargs)


def from_dict(data: dict[str, Any], where: str = "profile") -> Profile:
    if not isinstance(data, dict):
        raise ProfileError(f"{where} is not a JSON object")
    if data.get("schema") != SCHEMA:
        raise ProfileError(f"{where} has schema {data.get('schema')!r}; this rlhf-plan reads schema {SCHEMA}: "
                           "make a new profile with `rlhf-plan profile`")
    if data.get("kind") not in KINDS:
        raise ProfileError(f"{where}: kind must be one of {KINDS}, got {data.get('kind')!r}")
    body = {k: v for k, v in data.items() if k not in _SECTIONS}
    unknown = sorted(set(body) - {"kind", "identity", "source", "schema", "notes"})
    if unknown:
        raise ProfileError(f"{where}: unknown key(s) {unknown}")
    sections = {name: _build(cls, data.get(name), f"{where}.{name}") for name, cls in _SECTIONS.items()}
    return Profile(kind=data["kind"], identity=dict(data.get("identity") or {}), source=dict(data.get("source") or {}),
                   notes=list(data.get("notes") or []), **sections)


def load(path: str | Path) -> Profile:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ProfileError(f"profile {path} does not exist: make one with `rlhf-plan profile --out {path}`") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ProfileError(f"profile {path} cannot be read as JSON ({exc}): make a new one with `rlhf-plan profile`") from None
    return from_dict(data, where=f"profile {path}")


# ---- identity: which model and engines a profile's costs belong to --------------------------


def identity_of(cfg: Any) -> dict[str, Any]:
    """The model and engines a run config asks about (what a profile must match)."""
    model = cfg.model
    if model.name == "tiny":
        t = model.tiny
        name = f"tiny(hidden {t.hidden_size}, {t.num_layers} layers, {t.num_heads} heads, mlp {t.intermediate_size})"
    else:
        name = str(model.path)
    return {"model": name, "dtype": str(model.dtype), "lora_r": int(model.lora.r or 0),
            "rollout_engine": str(cfg.rollout.engine), "learner_engine": str(cfg.learner.engine),
            "device": "cuda" if str(model.device).startswith(("cuda", "auto")) else str(model.device)}


IDENTITY_KEYS = ("model", "dtype", "lora_r", "rollout_engine", "learner_engine", "device")


def check_identity(profile: Profile, cfg: Any, path: str | Path = "the profile") -> None:
    """Refuse a profile measured on another model or engine than ``cfg`` asks about."""
    asked = identity_of(cfg)
    have = profile.identity
    diff = [k for k in IDENTITY_KEYS if k in have and have[k] != asked[k]]
    if diff:
        pairs = ", ".join(f"{k} {have[k]!r} (profile) vs {asked[k]!r} (asked)" for k in diff)
        raise ProfileError(
            f"{path} was measured for another setup than the one asked about: {pairs}. Stage costs do not "
            "transfer between models or engines: profile this one first (`rlhf-plan profile --out p.json` with the "
            "same overrides), or drop the overrides that change the model or engine")
