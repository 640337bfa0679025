"""The learner's read path: rank 0 reads a batch and checks its samples' end-of-sequence tokens
against the learner's (a few misfits are dead-lettered, most of them stop the learner); every
rank gets the rest (broadcast as wire bytes) and collates them into a
:class:`learner.batch.TrainBatch` (which checks token ids and groups)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from buffer import LearnerClient, MonitorClient
from learner.batch import BatchError, Collator
from learner.engines import all_reduce_max, broadcast_samples
from rlhf_core.config import Config, ConfigError
from rlhf_core.errors import FailureWindow, UserError
from rlhf_core.records import Sample

log = logging.getLogger(__name__)

#: what rlhf_core.records.validate_sample says about token ids beyond the run's vocabulary
VOCAB_DEAD_LETTER = "outside the vocabulary"


class TokenizerMismatchError(UserError):
    """Workers tokenize with another vocabulary than the learner's model: nothing can be trained."""


def check_tokenizer(tokenizer: Any, model: torch.nn.Module, stop_strings: Iterable[str] = ()) -> frozenset[int]:
    """Refuse a tokenizer that does not fit the model; return the end-of-sequence ids the workers
    stop generation at (the tokenizer's and the model's generation config's, as the workers do),
    which every sample is checked against (a tokenizer mismatch). None with ``stop_strings``: a
    response may then stop on any token."""
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    eos: set[int] = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos.update([int(gen_eos)] if isinstance(gen_eos, int) else [int(t) for t in gen_eos or []])
    if tokenizer is not None and vocab is not None:
        specials = {name: getattr(tokenizer, f"{name}_token_id", None) for name in ("eos", "pad", "bos")}
        out = {n: i for n, i in specials.items() if isinstance(i, int) and not 0 <= i < vocab}
        if len(tokenizer) > vocab or out:
            raise ConfigError(
                f"the tokenizer ({len(tokenizer)} tokens; special ids {specials}) does not fit the model's vocabulary "
                f"of {vocab} (model.path={getattr(config, 'name_or_path', '?')}): model.tokenizer_path must name the "
                "tokenizer the model was trained with"
            )
    return frozenset() if stop_strings else frozenset(eos)


def stop_token_misfits(samples: Sequence[Sample], eos_ids: frozenset[int] | set[int]) -> list[tuple[int, str]]:
    """``(index, why)`` of the samples that contradict the learner's end-of-sequence ids.

    A worker stops a response at its first end-of-sequence token, so (without stop strings)
    a ``"stop"`` response ends on one of ``eos_ids`` and no response holds one before its last
    token. A worker whose tokenizer has other special tokens breaks one of the two. Multi-turn
    episodes (samples with a ``loss_mask``) are not checked: each turn may end on one, the chat
    template writes others between turns, and an episode stops when its environment says so.
    """
    single = [i for i, s in enumerate(samples) if s.loss_mask is None]
    if len(single) < len(samples):
        return [(single[i], why) for i, why in stop_token_misfits([samples[i] for i in single], eos_ids)]
    eos = np.fromiter(sorted(eos_ids), dtype=np.int64)
    if not eos.size or not samples:
        return []
    # the common case in one vectorised pass: no EOS inside a response, every "stop" ends on one
    is_eos = np.isin(np.concatenate([s.response_ids for s in samples]), eos)
    last = np.cumsum([len(s.response_ids) for s in samples]) - 1
    stopped = np.asarray([s.finish_reason == "stop" for s in samples])
    if is_eos.sum() == is_eos[last].sum() and is_eos[last][stopped].all():
        return []
    out = []
    for i, s in enumerate(samples):
        r = s.response_ids
        inside = np.flatnonzero(np.isin(r[:-1], eos))
        if s.finish_reason == "stop" and int(r[-1]) not in eos_ids:
            out.append((i, f"finished with 'stop' on token {int(r[-1])}, which is not one of them"))
        elif inside.size:
            out.append((i, f"holds token {int(r[inside[0]])} at position {int(inside[0])}, where generation should "
                           "have stopped"))
    return out


def split_stop_token_misfits(samples: Sequence[Sample], eos_ids: frozenset[int] | set[int],
                             recent: FailureWindow) -> tuple[list[Sample], list[tuple[Sample, str]]]:
    """The samples to train on and, each with what is wrong with it, those to dead-letter: the
    ones that contradict the learner's end-of-sequence ids (:func:`stop_token_misfits`; no
    ``eos_ids``, no check). A few such samples are a worker's fault; when most recent ones are
    (``recent`` says so), the workers and the learner use different tokenizers and nothing can
    be trained: :class:`BatchError`, and the batch stays in the buffer."""
    bad = dict(stop_token_misfits(samples, eos_ids))
    misfits = [(samples[i], f"sample {samples[i].sample_id!r} from worker {samples[i].worker_id or '?'} does not fit "
                            f"the learner's end-of-sequence token ids {sorted(eos_ids)}: it {why}") for i, why in bad.items()]
    if any([recent.record(i in bad) for i in range(len(samples))]) and misfits:
        raise BatchError(
            f"{misfits[0][1]}. The workers use a tokenizer with other special "
            "tokens than the learner's: point model.path / model.tokenizer_path of workers and learner at the same "
            "tokenizer, and start a new run (buffer.run_id): this batch stays in the buffer. (With "
            "rollout.stop_strings set a response may also stop on other tokens, and this check is off)"
        )
    return [s for i, s in enumerate(samples) if i not in bad], misfits


@dataclass
class Read:
    """A batch as every rank trains it."""

    samples: list[Sample]
    version: int  # the learner version its staleness is measured against (agreed by every rank)
    staleness: list[int]  # per sample: ``version`` - its oldest token's version
    ids: list[Any] | None  # rank 0: the buffer's ids of the batch, acked once a checkpoint holds it
    decode_s: float  # rank 0's decoding of the batch (learner/time_read_s)


class BatchReader:
    """Reads batches for one learner rank (only rank 0 talks to the buffer) and collates them.

    ``restored_version`` is the checkpoint's: the batches read before a crash and not in the
    checkpoint (pending for ``consumer``) are read against it until they are all back."""

    def __init__(self, cfg: Config, buffer: LearnerClient, consumer: str, rank0: bool, eos_ids: frozenset[int],
                 collate: Collator, restored_version: int) -> None:
        self.cfg, self.buffer, self.consumer, self.rank0 = cfg, buffer, consumer, rank0
        self.monitor = MonitorClient(buffer.store)  # the dead letters, read when no batch comes
        self.eos_ids, self.collate, self.restored_version = eos_ids, collate, restored_version
        self.used_up = False  # rank 0: the buffer said no batch can come any more from the prompts (LearnerClient.exhausted)
        self._misfits = FailureWindow(window=64, max_share=0.5, min_count=8)  # samples vs the learner's EOS ids
        self._last_batch_time = time.time()  # dead letters older than this are not a reason to stop
        # Read before a crash and not in the checkpoint: trained again from the restored weights.
        self._replay = set(buffer.pending_for(consumer)) if rank0 else set()

    def read_version(self, version: int) -> int:
        """The learner version a read filters staleness against: ``version``, except while the
        batches read before a crash are delivered again. Those were admitted against the versions
        of the lost updates (>= the checkpoint's), and the restored weights are the checkpoint's;
        measured against the newer number a bump above the lost versions gave, they could be
        dropped as stale, which would lose them to the crash."""
        return self.restored_version if self._replay else version

    def read(self, version: int) -> Read | None:
        """Rank 0 reads a batch (waiting up to 1 s) for the learner at ``version``; every rank gets
        the same samples. None when nothing came: then rank 0 checks the dead letters for a
        tokenizer mismatch, and whether any batch can still come (``LearnerClient.exhausted``). Collective."""
        # newest: while re-delivered batches are read against the checkpoint's version, the
        # version being sent on the publish thread may already have made samples
        batch = self.buffer.read_batch(self.consumer, self.read_version(version), self.cfg.learner.batch_size,
                                       timeout_s=1.0, newest=version) if self.rank0 else None
        if batch is not None:
            batch.samples = self._drop_stop_token_misfits(batch.samples)
            if not batch.samples:  # all dead-lettered: acked untrained, its admission back (pacing would stall)
                self.buffer.discard(batch)
                batch = None
        samples = broadcast_samples(batch.samples if batch is not None else [] if self.rank0 else None)
        if not samples:
            if self.rank0:
                self._check_dead_letters()
                # the run's own prompts are its only source (no rlhf-gateway): it ends once they are used up
                if self.cfg.data.source != "none" and not self.cfg.gateway.enabled:
                    self.used_up = self.buffer.exhausted(self.consumer, self.read_version(version),
                                                         self.cfg.learner.batch_size, self.cfg.data.epochs)
            return None
        self._last_batch_time = time.time()
        # the version staleness is measured against (agreed: only rank 0 knows the replay)
        read_version = batch.learner_version if batch is not None else -1
        read_version = int(all_reduce_max(torch.tensor([float(read_version)])).item())
        if batch is not None and self._replay:
            # re-delivered entries come first: a batch without one means none is coming back
            self._replay = self._replay - set(batch.ids) if self._replay & set(batch.ids) else set()
        return Read(samples, read_version, [read_version - s.oldest_version for s in samples],
                    list(batch.ids) if batch is not None else None, batch.decode_s if batch is not None else 0.0)

    def _drop_stop_token_misfits(self, samples: list[Sample]) -> list[Sample]:
        """Dead-letter the few samples whose end-of-sequence tokens contradict the learner's: a
        record that fails the check, left in the buffer, would be re-delivered after every restart.
        When most recent samples misfit (more than half of the last 64, once 8 are seen), the
        tokenizers differ: BatchError, and the batch stays in the buffer."""
        keep, misfits = split_stop_token_misfits(samples, self.eos_ids, self._misfits)
        for s, reason in misfits:
            log.warning("dead-lettering %s", reason)
            self.buffer.dead_letter(reason, s.worker_id or "?", s.encode())
        return keep

    def _check_dead_letters(self) -> None:
        """Rank 0, after a read that found nothing: if a whole batch worth of samples was dead-lettered
        since the last batch because of token ids beyond the learner's vocabulary, the workers use
        another tokenizer and no batch will ever come; stop with a message that says so."""
        want = self.cfg.learner.batch_size
        try:
            recent = self.monitor.dead_letters(count=want)
        except Exception:  # noqa: BLE001  # a diagnostic must never stop training
            log.debug("cannot read dead letters", exc_info=True)
            return
        vocab = [d for d in recent if d["kind"] == "sample" and VOCAB_DEAD_LETTER in d["reason"]
                 and _float(d["ts"]) >= self._last_batch_time]
        if len(vocab) < want:
            return
        producers = sorted({d["producer"] for d in vocab})
        raise TokenizerMismatchError(
            f"no batch can form: the last {len(vocab)} samples from worker(s) {', '.join(producers)} were "
            f"dead-lettered by the buffer ({vocab[-1]['reason']}). The learner's model has {self.collate.vocab_size} "
            "tokens, so the workers tokenize with another tokenizer: point model.path / model.tokenizer_path of "
            "workers and learner at the same model, then restart them"
        )


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0
