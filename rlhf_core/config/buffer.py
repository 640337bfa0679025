"""``buffer``: the Redis-backed buffer, its pacing and replay."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_core.choices import Sampling
from rlhf_core.errors import ConfigError


@dataclass
class BufferConfig:
    # redis:// or rediss:// URL (user:password@ for ACL). null: `rlhf-run` starts a private redis-server.
    url: str | None = None
    # the key namespace of this run; "auto": rlhf-run makes a unique one (so every job of a
    # multirun sweep gets its own) and prints it for workers you start yourself
    run_id: str = "auto"
    lease_timeout_s: float = 30.0  # a prompt held this long without heartbeat is re-delivered
    heartbeat_interval_s: float = 2.0
    max_deliveries: int = 3  # a prompt delivered this often goes to the dead-letter stream
    max_reuse: int = 1  # times each sample may be trained on
    # Batches admitted for generation beyond the one the learner reads next (capped by
    # algo.max_staleness). 1 gives samples about one version old and leaves one version of slack
    # under the staleness bound for groups that finish out of order (several workers); a single
    # worker then waits for each new version before its next batch, which 2 avoids (samples
    # about two versions old); null admits up to the staleness bound (AReaL pacing).
    lookahead: int | None = 1
    samples_per_insert: float | None = None  # Reverb-style rate limit; null = off
    min_size_to_sample: int = 1
    error_buffer: float = 64.0
    capacity: int = 100_000  # samples kept for replay; the stalest are evicted beyond it
    sampling: Sampling = Sampling.fifo
    max_record_bytes: int = 16 * 1024 * 1024
    dead_letter_maxlen: int = 10_000  # dead letters kept for inspection (MAXLEN ~); counters keep totals
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    connect_timeout_s: float = 5.0
    max_retry_s: float = 30.0

    def check(self) -> None:
        """Reuse, pacing, leases and the Redis URL."""
        if self.max_reuse < 1:
            raise ConfigError(f"buffer.max_reuse must be >= 1, got {self.max_reuse}")
        if self.lookahead is not None and self.lookahead < 0:
            raise ConfigError(f"buffer.lookahead must be >= 0 batches or null (up to algo.max_staleness), got {self.lookahead}")
        if self.samples_per_insert is not None and self.samples_per_insert <= 0:
            raise ConfigError(f"buffer.samples_per_insert must be > 0 or null, got {self.samples_per_insert}")
        if not self.heartbeat_interval_s > 0:
            raise ConfigError(f"buffer.heartbeat_interval_s must be > 0 seconds, got {self.heartbeat_interval_s}")
        if self.max_deliveries < 1:
            raise ConfigError(f"buffer.max_deliveries must be >= 1 (deliveries of a prompt before it is dead-lettered), "
                              f"got {self.max_deliveries}")
        if self.lease_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError(f"buffer.lease_timeout_s {self.lease_timeout_s} must exceed buffer.heartbeat_interval_s "
                              f"{self.heartbeat_interval_s}, or live workers would lose their leases")
        if self.url is not None and not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"buffer.url {self.url!r} must start with redis://, rediss:// or unix://")


def replay_mode(buf: BufferConfig) -> bool:
    """Whether ``buf`` runs the buffer in replay mode (a table whose samples may be drawn again)
    rather than FIFO: buffer.max_reuse > 1, buffer.samples_per_insert set or buffer.sampling=uniform."""
    return buf.max_reuse > 1 or buf.samples_per_insert is not None or buf.sampling != Sampling.fifo
