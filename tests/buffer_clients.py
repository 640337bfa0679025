"""The buffer's role clients over one store, for a test that plays several roles in one process
(enqueues prompts, claims them as a worker, reads them as the learner, checks the monitor's counters)."""

from __future__ import annotations

from buffer import GatewayClient, LearnerClient, MonitorClient, ProducerClient, Store, WorkerClient
from rlhf_core.config import BufferConfig


class Clients:
    """One client per role, sharing ``store`` (and so its cached run parameters), as one process's would."""

    def __init__(self, store: Store) -> None:
        self.store, self.redis, self.keys = store, store.redis, store.keys
        self.producer, self.worker, self.learner = ProducerClient(store), WorkerClient(store), LearnerClient(store)
        self.gateway, self.monitor = GatewayClient(store), MonitorClient(store)

    @classmethod
    def connect(cls, url: str | None = None, run_id: str | None = None, cfg: BufferConfig | None = None,
                setting: str = "buffer.url") -> Clients:
        return cls(Store.connect(url, run_id, cfg, setting))

    def close(self) -> None:
        self.store.close()
