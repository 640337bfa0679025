"""The Redis-backed buffer: leased prompts, acked samples, pacing, replay, dead letters.

``buffer`` is the only code that knows Redis key names and commands (:mod:`buffer.keys`). A
process holds one client per role it plays (``LearnerClient``, ``ProducerClient``,
``WorkerClient``, ``GatewayClient``, ``MonitorClient``), all over one :class:`Store`::

    store = Store.connect(url, run_id, cfg)      # or Store(redis_client, run_id, cfg); or XClient.connect(...)
    learner, worker = LearnerClient(store), WorkerClient(store)

docs/architecture.md (Buffer) lists what each role calls; the design notes live in the module
docstrings (pacing and the replay limiter in :mod:`buffer.pacing`, leases in :mod:`buffer.prompts`).
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
    "Batch", "BadName", "BufferAuthError", "BufferClient", "BufferOutOfMemory", "BufferUnavailable", "Completion",
    "CorruptStateError", "DataError", "GatewayClient", "GroupSlice", "Lease", "LearnerClient", "MonitorClient",
    "ProducerClient", "PromptsExhausted", "RunKeys", "RunNotInitialised", "RunParamsMismatch", "Store", "WorkerClient",
    "groups_per_batch", "iter_prompts", "redact",
]
