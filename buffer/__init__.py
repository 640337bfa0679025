"""The Redis-backed buffer: leased prompts, acked samples, pacing, replay, dead letters.

``buffer`` is the only code that knows Redis key names and commands (:mod:`buffer.keys`);
workers, the learner and the monitor use this API::

    buf = Buffer.connect(url, run_id, cfg)          # or Buffer(redis_client, run_id, cfg)
    buf.init_run(batch_size=32, group_size=4, max_staleness=2, max_response_tokens=None, vocab_size=None)
    buf.run_params() -> dict
    # producer
    buf.enqueue_prompts(prompts) -> int
    buf.fill_prompts(lambda epoch: iter_prompts(data_cfg, epoch), epochs, low_watermark) -> int
    # worker
    leases = buf.claim(consumer, max_prompts, block_s)      # within the admission budget
    buf.heartbeat(consumer, version, stats) -> lost lease ids   # and, every lease timeout, retire_consumers()
    buf.complete(lease, samples) -> "appended" | "empty" | "duplicate"   (atomic append + ack)
    buf.complete_many([(lease, samples) or buf.prepare(lease, samples), ...])   # one round trip
    buf.release(lease)                                       # give back un-done
    buf.dead_letter(reason, producer, raw, kind="sample")
    buf.admission_budget() -> int
    buf.expire_leases(consumer) -> int                       # its process is known dead: reclaimable now
    # learner
    buf.set_learner_version(v, updates)                     # the updates its weights hold: pacing counts them
    batch = buf.read_batch(consumer, learner_version, batch_size, timeout_s)   # Batch | None
    buf.commit(batch) / buf.commit_ids(ids)                  # after publish + checkpoint
    buf.pending_for(consumer) -> ids
    # monitor / admin
    buf.metrics() -> dict;  buf.dead_letters(n);  buf.delete_run()

Design notes live in the module docstrings: the pacing rule and the replay rate limiter (in
Python and in Lua) in :mod:`buffer.pacing`, leases in :mod:`buffer.prompts`, groups and FIFO
consumption in :mod:`buffer.samples`, the replay table in :mod:`buffer.replay`, atomicity in
:mod:`buffer.scripts`, retries in :mod:`buffer.connection`, the one-way layering of the modules
under this facade in :mod:`buffer.store`.
"""

from buffer.client import Buffer, Completion, RunNotInitialised, RunParamsMismatch
from buffer.connection import BufferAuthError, BufferOutOfMemory, BufferUnavailable, CorruptStateError, redact
from buffer.datasets import DataError, iter_prompts
from buffer.keys import BadName, RunKeys
from buffer.prompts import Lease, PromptsExhausted
from buffer.samples import Batch, GroupSlice, groups_per_batch

__all__ = [
    "Batch",
    "BadName",
    "Buffer",
    "BufferAuthError",
    "BufferOutOfMemory",
    "BufferUnavailable",
    "Completion",
    "CorruptStateError",
    "DataError",
    "GroupSlice",
    "Lease",
    "PromptsExhausted",
    "RunKeys",
    "RunNotInitialised",
    "RunParamsMismatch",
    "groups_per_batch",
    "iter_prompts",
    "redact",
]
