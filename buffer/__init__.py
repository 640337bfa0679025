"""The Redis-backed buffer: leased prompts, acked samples, pacing, replay, dead letters.

``buffer`` is the only code that knows Redis key names and commands (:mod:`buffer.keys`). A
process holds one client per role it plays, over one :class:`Store` (connection, keys, scripts,
cached run parameters)::

    store = Store.connect(url, run_id, cfg)      # or Store(redis_client, run_id, cfg); or XClient.connect(...)
    # every client: run_params(), initialised(), publish_stats(component, stats), dead_letter(reason, producer, raw), close()
    learner = LearnerClient(store)   # init_run(batch_size, group_size, max_staleness, ...), set_learner_version(v, updates),
                                     # read_batch(consumer, version, batch_size, timeout_s) -> Batch | None,
                                     # commit(batch) / commit_ids(ids) / discard(batch), pending_for, exhausted
    producer = ProducerClient(store) # enqueue_prompts(prompts), fill_prompts(source_fn, epochs, low_watermark), fill_state
    worker = WorkerClient(store)     # claim(consumer, max_prompts, block_s) -> leases, heartbeat(consumer, version, stats),
                                     # complete(lease, samples) / complete_many([prepare(lease, samples), ...]), release
    gateway = GatewayClient(store)   # append_group(producer, samples, kept), keep_rewarded, rewarded_kept, forget_rewarded
    monitor = MonitorClient(store)   # metrics(), stats(component), dead_letters(n), admission_budget(),
                                     # set_worker_target(n), expire_leases(consumer), delete_run()

Design notes live in the module docstrings: the pacing rule and the replay rate limiter (in
Python and in Lua) in :mod:`buffer.pacing`, leases in :mod:`buffer.prompts`, groups and FIFO
consumption in :mod:`buffer.samples`, the replay table in :mod:`buffer.replay`, atomicity in
:mod:`buffer.scripts`, retries in :mod:`buffer.connection`, the roles in :mod:`buffer.client`,
the one-way layering of the modules under the clients in :mod:`buffer.store`.
"""

from buffer.client import BufferClient, GatewayClient, MonitorClient, ProducerClient
from buffer.connection import BufferAuthError, BufferOutOfMemory, BufferUnavailable, CorruptStateError, redact
from buffer.datasets import DataError, iter_prompts
from buffer.keys import BadName, RunKeys
from buffer.learner_client import LearnerClient, RunParamsMismatch
from buffer.prompts import Lease, PromptsExhausted
from buffer.samples import Batch, GroupSlice, groups_per_batch
from buffer.store import RunNotInitialised, Store
from buffer.worker_client import Completion, WorkerClient

__all__ = [
    "Batch",
    "BadName",
    "BufferAuthError",
    "BufferClient",
    "BufferOutOfMemory",
    "BufferUnavailable",
    "Completion",
    "CorruptStateError",
    "DataError",
    "GatewayClient",
    "GroupSlice",
    "Lease",
    "LearnerClient",
    "MonitorClient",
    "ProducerClient",
    "PromptsExhausted",
    "RunKeys",
    "RunNotInitialised",
    "RunParamsMismatch",
    "Store",
    "WorkerClient",
    "groups_per_batch",
    "iter_prompts",
    "redact",
]
