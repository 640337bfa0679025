"""Which versions travel as deltas, and what a worker holding some version is sent.

The server keeps, beside its whole versions, the newest keyframe's number and the version deltas
since it (each one the per-tensor entries of :mod:`weight_server.delta` against the version
before). :class:`KeyframePolicy` decides per publish: a keyframe every ``keyframe_every``
versions, or whenever the delta is not below ``delta_max_share`` of the whole version.
:func:`plan_pull` says what a worker is sent: the deltas after the version it holds when that
version is the keyframe or a later one, else the newest whole version. After applying, the worker
checks the tensor hashes of the layout the learner published; a mismatch means a whole pull.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from rlhf_core.choices import DeltaMode
from rlhf_core.config import WeightServerConfig
from weight_server import delta as D
from weight_server import protocol as P

log = logging.getLogger(__name__)

_DELTA_DTYPES = {DeltaMode.auto: frozenset({"bfloat16", "float16"}),
                 DeltaMode.on: frozenset({"bfloat16", "float16", "float32", "float64"})}


@dataclass(frozen=True)
class VersionDelta:
    """Version ``version`` as entries against ``base`` (``version - 1``), one per tensor in layout order."""

    base: int
    version: int
    entries: tuple[bytes, ...]

    @property
    def nbytes(self) -> int:
        return sum(len(e) for e in self.entries)


@dataclass(frozen=True)
class PullPlan:
    """What to send a worker: the deltas in order (``whole`` False), or the newest whole version."""

    whole: bool
    deltas: tuple[int, ...] = ()


@dataclass(frozen=True)
class KeyframePolicy:
    mode: DeltaMode = DeltaMode.off
    keyframe_every: int = 10
    max_share: float = 0.5

    @classmethod
    def of(cls, cfg: WeightServerConfig) -> KeyframePolicy:
        cfg.check_delta()
        return cls(DeltaMode(cfg.delta), cfg.keyframe_every, cfg.delta_max_share)

    def tries_delta(self, dtype: str) -> bool:
        """Whether tensors of wire dtype ``dtype`` are encoded as deltas at all (others go whole)."""
        return dtype in _DELTA_DTYPES.get(self.mode, frozenset())

    def encode(self, base: int, version: int, since_keyframe: int, old: Sequence[memoryview], new: Sequence[memoryview],
               dtypes: Sequence[str], itemsizes: Sequence[int]) -> VersionDelta | None:
        """``version`` as a delta against ``base``, ``since_keyframe`` deltas after the newest
        keyframe; None: send it as a keyframe (delta off, a keyframe due, a version gap, or a
        delta not below ``max_share`` of the whole)."""
        if self.mode == DeltaMode.off or since_keyframe + 1 >= self.keyframe_every or version != base + 1 or len(old) != len(new):
            return None
        entries = tuple(D.encode_entry(o, n, size, self.tries_delta(dt)) for o, n, dt, size in zip(old, new, dtypes, itemsizes))
        whole = sum(len(n) for n in new)
        delta = VersionDelta(base, version, entries)
        return delta if delta.nbytes < self.max_share * whole else None


def apply(old: Sequence[bytes | bytearray | memoryview], delta: VersionDelta, itemsizes: Sequence[int]) -> list[bytearray]:
    """The tensors of ``delta.version`` from those of ``delta.base`` (the caller verifies the hashes)."""
    if len(old) != len(delta.entries):
        raise D.DeltaError(f"v{delta.version} delta has {len(delta.entries)} tensors, the base {len(old)}")
    return [D.decode(o, e, size) for o, e, size in zip(old, delta.entries, itemsizes)]


def apply_verified(held: Sequence[bytes | memoryview], deltas: Sequence[VersionDelta], layout: P.Layout) -> list[bytearray] | None:
    """The tensors of ``layout``'s version from those of the version ``held`` and the chain of
    ``deltas`` after it, each tensor checked against the hash the learner published; None (logged:
    pull the whole version instead) when an entry does not decode or a hash differs."""
    sizes = [P.DTYPE_ITEMSIZE[t.dtype] for t in layout.tensors]
    got: Sequence[bytes | bytearray | memoryview] = held
    try:
        for d in deltas:
            got = apply(got, d, sizes)
    except D.DeltaError as exc:
        log.warning("a delta did not apply (%s); pulling the whole version", exc)
        return None
    bad = [t.name for t, b in zip(layout.tensors, got) if P.tensor_hash(b) != t.hash]
    if bad or len(got) != len(layout.tensors):
        log.warning("%d tensor(s) differ from the published hashes after applying deltas (e.g. %r); pulling the whole version",
                    len(bad), bad[:1])
        return None
    return [b if isinstance(b, bytearray) else bytearray(b) for b in got]


def plan_pull(held: int | None, newest: int, keyframe: int | None, deltas: Sequence[int]) -> PullPlan:
    """What a worker holding ``held`` (None: nothing) is sent to reach ``newest``, given the
    newest ``keyframe`` and the versions whose deltas the server keeps (each against the one before)."""
    if held is None or keyframe is None or held < keyframe or held >= newest:
        return PullPlan(whole=held is None or held != newest)
    wanted = tuple(range(held + 1, newest + 1))
    if not set(wanted) <= set(deltas):
        return PullPlan(whole=True)
    return PullPlan(whole=False, deltas=wanted)
