"""``run`` (budget, output, restarts, trackers), ``ray`` (each role's Ray actor: ``launcher=ray``) and
``gateway`` (the OpenAI-compatible front end whose rewarded sessions become samples)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlhf_core.choices import LearnerPlacement, Logger, WandbMode, WorkerPlacement
from rlhf_core.config.weight_server import LOOPBACK_HOSTS
from rlhf_core.errors import ConfigError


@dataclass
class RunConfig:
    max_seconds: float | None = None  # wall-clock budget of the whole run
    output_dir: str = "."
    log_level: str = "INFO"
    progress: bool = True
    learner_restarts: int = 3  # a crashed learner (not a user error) is restarted from its checkpoint this often
    # experiment trackers fed by the learner (extra `tracking`): any of tensorboard, wandb, mlflow
    loggers: list[Logger] = field(default_factory=list)
    tracker_project: str = "rlhf-service"  # wandb project / MLflow experiment
    wandb_mode: WandbMode | None = None  # null: wandb's own (WANDB_MODE)
    wandb_entity: str | None = None  # team or user; null: wandb's own (WANDB_ENTITY, else your default)
    mlflow_tracking_uri: str | None = None  # null: MLFLOW_TRACKING_URI, else file:<output dir>/mlruns
    log_samples_every: int = 50  # a table of sample responses and the workers' throughput every N updates (0: never)
    log_samples: int = 8  # rows in that table
    prometheus_port: int | None = None  # the run's own scrape target (from its Redis snapshot); 0 = any free port

    def check(self) -> None:
        """The trackers installed, the sample tables, the time budget and the learner's restarts."""
        import importlib.util

        for name in self.loggers:
            if importlib.util.find_spec(name) is None:  # each tracker's module is its name
                raise ConfigError(f"run.loggers names {name}, but {name} is not installed: "
                                  "pip install -e '.[tracking]' (or drop it from run.loggers)")
        if self.log_samples_every < 0 or self.log_samples < 0:
            raise ConfigError(f"run.log_samples_every and run.log_samples must be >= 0, got {self.log_samples_every}, "
                              f"{self.log_samples}")
        if self.max_seconds is not None and not math.isfinite(self.max_seconds):
            raise ConfigError(f"run.max_seconds must be a finite number of seconds or null, got {self.max_seconds}")
        if self.learner_restarts < 0:
            raise ConfigError(f"run.learner_restarts must be >= 0 (0: a crashed learner ends the run), "
                              f"got {self.learner_restarts}")


@dataclass
class RayRoleConfig:
    """What one role's Ray actor asks of a node (``rlhf-run launcher=ray``)."""

    num_cpus: float = 1.0  # logical CPUs (fractions share a core)
    num_gpus: float = 0.0  # fractions co-locate actors on one GPU (e.g. 0.5 for two workers)
    resources: dict[str, float] = field(default_factory=dict)  # custom node resources (ray start --resources)
    label_selector: dict[str, str] = field(default_factory=dict)  # node labels (ray start --labels)
    max_restarts: int = 5  # Ray restarts a dead actor (its process, or its node, lost) this often

    def check(self, name: str) -> None:
        """The demand of the role ``ray.<name>``."""
        if self.num_cpus < 0 or self.num_gpus < 0 or any(float(v) < 0 for v in self.resources.values()):
            raise ConfigError(f"ray.{name}: num_cpus, num_gpus and resources must be >= 0, got num_cpus={self.num_cpus}, "
                              f"num_gpus={self.num_gpus}, resources={dict(self.resources)}")
        if self.num_gpus > 1 and self.num_gpus != int(self.num_gpus):
            raise ConfigError(f"ray.{name}.num_gpus={self.num_gpus}: a fraction of a GPU must be below 1 (whole GPUs above)")
        if self.max_restarts < 0:
            raise ConfigError(f"ray.{name}.max_restarts must be >= 0, got {self.max_restarts}")


@dataclass
class RayWorkerConfig(RayRoleConfig):
    """Each worker (and the evaluator): one actor, placed by Ray where its demand fits."""

    # SPREAD: the workers over as many nodes as can hold one, so a lost node stops only its own
    # workers (with one node that fits they all go there: the launcher says so); DEFAULT: Ray's
    # own placement, which fills a node before using the next
    strategy: WorkerPlacement = WorkerPlacement.SPREAD


@dataclass
class RayLearnerConfig(RayRoleConfig):
    """The learner's ranks: one actor per rank, one placement-group bundle per rank."""

    ranks: int = 1  # data-parallel ranks (world size); > 1 needs learner.engine=deepspeed
    strategy: LearnerPlacement = LearnerPlacement.PACK  # the placement group's strategy
    # rank 0 on the node that runs rlhf-run, where the output folder is (metrics.jsonl, checkpoints,
    # trackers); false: anywhere, which needs an output folder on a filesystem every node mounts
    on_driver_node: bool = True
    max_restarts: int = 0  # the launcher restarts the learner from its checkpoint (run.learner_restarts)


@dataclass
class RayConfig:
    """``rlhf-run launcher=ray``: the roles as Ray actors (docs/cluster.md)."""

    # host:port of the cluster's GCS (what `ray start --head` prints); "auto": RAY_ADDRESS, else the
    # cluster this node joined with `ray start`; null: start a local Ray instance for this run
    address: str | None = None
    connect_timeout_s: float = 15.0  # no Ray cluster answers at ray.address within about this: a clear error
    placement_timeout_s: float = 120.0  # the learner's placement group / an actor not placed within this: an error
    # a local instance only: logical CPUs (null: the machine's cores, at least what the run asks for) and the
    # object store (the run moves weights over ZeroMQ and shared memory, not through Ray's store)
    num_cpus: float | None = None
    object_store_mb: int = 200
    worker: RayWorkerConfig = field(default_factory=RayWorkerConfig)  # each worker, and the evaluator
    learner: RayLearnerConfig = field(default_factory=RayLearnerConfig)
    weight_server: RayRoleConfig = field(default_factory=lambda: RayRoleConfig(num_cpus=0.0, max_restarts=0))
    redis: RayRoleConfig = field(default_factory=lambda: RayRoleConfig(num_cpus=0.0, max_restarts=0))

    def check(self) -> None:
        """The actors' demands and timeouts, whatever the launcher (``rlhf-run`` checks that the cluster
        has them once connected)."""
        for name in ("worker", "learner", "weight_server", "redis"):
            getattr(self, name).check(name)
        if self.learner.ranks < 1:
            raise ConfigError(f"ray.learner.ranks must be >= 1, got {self.learner.ranks}")
        if self.learner.num_cpus <= 0 and self.learner.num_gpus <= 0 and not self.learner.resources:
            raise ConfigError("ray.learner asks for nothing (num_cpus=0, num_gpus=0, no resources): a placement-group "
                              "bundle must ask for something; give it num_cpus > 0")
        if not (0 < self.connect_timeout_s < math.inf and 0 < self.placement_timeout_s < math.inf):
            raise ConfigError(f"ray.connect_timeout_s and ray.placement_timeout_s must be seconds > 0, got "
                              f"{self.connect_timeout_s}, {self.placement_timeout_s}")
        if self.num_cpus is not None and self.num_cpus <= 0 or self.object_store_mb < 75:
            raise ConfigError(f"ray.num_cpus must be > 0 (or null) and ray.object_store_mb >= 75 (Ray's minimum), got "
                              f"{self.num_cpus}, {self.object_store_mb}")


@dataclass
class GatewayConfig:
    """``rlhf-gateway`` (or ``rlhf-run gateway.enabled=true``): an OpenAI-compatible HTTP front end
    whose calls the rollout workers serve and whose rewarded sessions become training samples
    (docs/gateway.md). With it enabled, every worker of the run takes gateway calls."""

    enabled: bool = False
    host: str = "127.0.0.1"  # another address needs api_keys or api_key_file
    port: int = 8000  # 0: any free port (printed, and written to <output dir>/gateway.json)
    model_name: str | None = None  # the model id clients send; null: model.name, or model.path's last folder
    api_keys: list[str] = field(default_factory=list)  # accepted `Authorization: Bearer <key>` values
    api_key_file: str | None = None  # one key per line (lines starting with # are comments)
    session_ttl_s: float = 600.0  # a session without a call or a reward this long expires (counted, not trained)
    group_size: int | None = None  # rewarded sessions of one `group` appended together; null: algo.group_size
    max_request_bytes: int = 1_000_000  # a larger request body is refused (413)
    # a call asking for more is refused (400); a call that names none gets this many, at most what
    # is left of the context and of its session (rollout.max_episode_tokens)
    max_tokens: int = 512
    max_n: int = 8  # choices per call at most
    call_timeout_s: float = 120.0  # no answer from a worker within this: the call fails (503)
    # the Jinja chat template for /v1/chat/completions; null: the tokenizer's, or a plain
    # "role: content" one when it has none (the tiny model)
    chat_template: str | None = None

    def check(self) -> None:
        """Exposure without a key, the port, timeouts and caps (when the gateway is on)."""
        if not self.enabled:
            return
        if self.host not in LOOPBACK_HOSTS and not (self.api_keys or self.api_key_file):
            raise ConfigError(f"gateway.host={self.host} exposes the gateway beyond this machine; set gateway.api_keys "
                              "or gateway.api_key_file (clients then send Authorization: Bearer <key>)")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"gateway.port must be in [0, 65535] (0: any free port), got {self.port}")
        if self.session_ttl_s <= 0 or self.call_timeout_s <= 0:
            raise ConfigError(f"gateway.session_ttl_s and gateway.call_timeout_s must be > 0 seconds, got "
                              f"{self.session_ttl_s}, {self.call_timeout_s}")
        if self.max_tokens < 1 or self.max_n < 1 or self.max_request_bytes < 1024:
            raise ConfigError(f"gateway.max_tokens and gateway.max_n must be >= 1 and gateway.max_request_bytes >= 1024, "
                              f"got {self.max_tokens}, {self.max_n}, {self.max_request_bytes}")
        if self.group_size is not None and self.group_size < 1:
            raise ConfigError(f"gateway.group_size must be >= 1 or null (algo.group_size), got {self.group_size}")
