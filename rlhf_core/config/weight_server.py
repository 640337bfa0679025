"""``weight_server``: addresses, limits, authentication and the shared-memory data path."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_core.choices import DeltaMode, ShmMode, WeightServerAuth
from rlhf_core.errors import ConfigError

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


@dataclass
class WeightServerConfig:
    host: str = "127.0.0.1"
    port: int = 0  # ROUTER port for publish/pull; 0 = pick a free one
    pub_port: int = 0  # PUB port for announcements; 0 = pick a free one
    address: str | None = None  # clients: tcp://host:port of the ROUTER (set by the launcher)
    pub_address: str | None = None
    keep_versions: int = 2
    chunk_bytes: int = 4 * 1024 * 1024
    max_inflight_chunks: int = 8
    auth: WeightServerAuth = WeightServerAuth.none
    secret: str | None = None  # hmac shared secret
    curve_server_public: str | None = None
    curve_server_secret: str | None = None
    curve_client_public: str | None = None
    curve_client_secret: str | None = None
    curve_authorized_dir: str | None = None  # server: folder of authorised client *.key files (curve)
    persist_dir: str | None = None
    max_header_bytes: int = 64 * 1024
    max_manifest_bytes: int = 16 * 1024 * 1024  # cap on the headers that carry a tensor list
    max_tensors: int = 100_000
    max_frame_bytes: int = 64 * 1024 * 1024  # ZMQ_MAXMSGSIZE: a peer sending a larger frame is dropped
    max_version_bytes: int = 64 * 1024**3
    max_uploads: int = 4  # uploads in progress at once (a newer version of a name supersedes its older upload)
    # their total bytes; null = twice the largest version held, at least 1 GiB (nothing held yet: max_version_bytes)
    max_upload_bytes: int | None = None
    request_timeout_s: float = 5.0  # clients: wait this long for each reply before calling the server down
    retry_timeout_s: float = 60.0  # publisher: keep retrying (exponential backoff) this long
    announce_interval_s: float = 1.0  # the server re-announces its newest versions this often (late joiners)
    upload_timeout_s: float = 30.0  # the server drops an upload that sent nothing for this long
    address_file: str | None = None  # the server writes {"address", "pub_address", "pid"} JSON here
    # Same-host data path: "auto" keeps version slabs in files under shm_dir and moves the bytes
    # through them when publisher/worker prove they see the same files; "off" = TCP only
    # (either side's "off" means TCP).
    shm: ShmMode = ShmMode.auto
    shm_dir: str = "/dev/shm"  # a tmpfs; the server makes a private rlhf-ws-<pid>-<random>/ folder in it
    # Versions as deltas against the version before (weight_server/keyframes.py decides): off; auto =
    # 16-bit float tensors only (fp32 changes in every element each step: xor+zlib saves about half
    # at a cost of ~40 MB/s of encoding); on = every floating tensor. A keyframe (whole version)
    # every keyframe_every versions, or whenever the delta is not below delta_max_share of the whole.
    delta: DeltaMode = DeltaMode.off
    keyframe_every: int = 10
    delta_max_share: float = 0.5

    def check(self) -> None:
        """Versions kept, exposure without authentication, shared memory, the HMAC secret. The weight
        server calls this too, so a server built without going through ``validate`` (tests,
        embedding) refuses the same settings with the same messages."""
        if self.keep_versions < 1:
            raise ConfigError(f"weight_server.keep_versions must be >= 1, got {self.keep_versions}")
        if self.host not in LOOPBACK_HOSTS and self.auth == WeightServerAuth.none:
            raise ConfigError(f"weight_server.host={self.host} exposes the weight server beyond this machine; set "
                              "weight_server.auth=curve (preferred) or weight_server.auth=hmac with weight_server.secret")
        self.check_shm()
        self.check_delta()
        if self.delta != DeltaMode.off:  # the codec and the keyframe policy exist; the server and subscriber do not use them yet
            raise ConfigError(f"weight_server.delta={self.delta} is not available yet: versions travel whole "
                              "(docs/architecture.md, Version deltas); leave weight_server.delta=off")
        if self.max_uploads < 1 or (self.max_upload_bytes is not None and self.max_upload_bytes < 1):
            raise ConfigError(f"weight_server.max_uploads must be >= 1 and weight_server.max_upload_bytes >= 1 (or null), "
                              f"got {self.max_uploads}, {self.max_upload_bytes}")
        if self.auth == WeightServerAuth.hmac and not self.secret:
            raise ConfigError("weight_server.auth=hmac needs weight_server.secret (a long random string shared by all "
                              "processes)")

    def check_delta(self) -> None:
        """The delta settings."""
        if self.delta not in list(DeltaMode):
            raise ConfigError(f"weight_server.delta must be one of {', '.join(DeltaMode)}, got {self.delta!r} "
                              "(auto: 16-bit float tensors travel as deltas; on: every floating tensor; off: whole versions)")
        if not isinstance(self.keyframe_every, int) or self.keyframe_every < 1:
            raise ConfigError(f"weight_server.keyframe_every must be an int >= 1 (1 = every version whole), "
                              f"got {self.keyframe_every!r}")
        if not 0.0 < self.delta_max_share <= 1.0:
            raise ConfigError(f"weight_server.delta_max_share must be in (0, 1] (a delta at least this share of the whole "
                              f"version goes as a keyframe instead), got {self.delta_max_share!r}")

    def check_shm(self) -> None:
        """The shared-memory settings (the server and its clients check them too)."""
        if self.shm not in list(ShmMode):
            raise ConfigError(f"weight_server.shm must be one of {', '.join(ShmMode)}, got {self.shm!r} "
                              "(auto: same-host peers move weights through shared memory; off: TCP only)")
        if not isinstance(self.shm_dir, str) or not self.shm_dir.startswith("/"):
            raise ConfigError(f"weight_server.shm_dir must be an absolute path to a tmpfs folder such as /dev/shm, "
                              f"got {self.shm_dir!r}")
