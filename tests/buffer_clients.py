"""The buffer's role clients over one store, for a test that plays several roles in one process
(enqueues prompts, claims them as a worker, reads them as the learner, checks the monitor's counters)."""

from __future__ import annotations

from buffer import BufferClient, GatewayClient, LearnerClient, MonitorClient, ProducerClient, Store, WorkerClient


class Clients(BufferClient):
    """One client per role, sharing ``store`` (and so its cached run parameters), as one process's would."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.producer, self.worker, self.learner = ProducerClient(store), WorkerClient(store), LearnerClient(store)
        self.gateway, self.monitor = GatewayClient(store), MonitorClient(store)
