"""The allowed values of every choice in the config, written once, as ``str`` Enums.

They type the config schema (``rlhf_core.config``: OmegaConf refuses any other value at
composition, naming the key and these values) and key the learner's registry
(``learner/algorithms/``: one module registers itself under each estimator and policy loss). A
member's name is its value, which is what OmegaConf matches a YAML value against, and a member
equals that string (``Estimator.grpo == "grpo"``).
"""

from __future__ import annotations

from enum import Enum, StrEnum


def check_choice(name: str, value: object, choices: type[Enum]) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices``' values (for arguments of code
    called without a composed config)."""
    allowed = [e.value for e in choices]
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; allowed: {', '.join(map(repr, allowed))}")


class Estimator(StrEnum):
    """``algo.estimator``: the advantage estimator, and with it the family of losses."""

    grpo = "grpo"  # group-relative, scaled by the group's std (learner/algorithms/group_relative.py)
    dr_grpo = "dr_grpo"  # group-relative, mean-centred only
    rloo = "rloo"  # leave-one-out baseline
    reinforce_pp = "reinforce_pp"  # learner/algorithms/reinforce_pp.py
    gae = "gae"  # PPO with a critic (learner/algorithms/gae.py)
    dpo = "dpo"  # online DPO on best vs worst of a group (learner/algorithms/dpo.py)

    @property
    def grouped(self) -> bool:
        """Compares the responses of one prompt: needs groups of 2 or more, kept whole in a batch."""
        return self in (Estimator.grpo, Estimator.dr_grpo, Estimator.rloo, Estimator.dpo)


class PolicyLoss(StrEnum):
    """``algo.policy_loss`` of the estimators trained by a policy gradient (all but dpo)."""

    decoupled = "decoupled"  # AReaL's decoupled PPO with IS correction (learner/algorithms/decoupled_policy_loss.py)
    ppo = "ppo"  # plain PPO, behaviour policy as old (learner/algorithms/ppo_policy_loss.py)
    gspo = "gspo"  # sequence-level ratio and clip (learner/algorithms/gspo_policy_loss.py)
    cispo = "cispo"  # clipped IS weight, every token keeps its gradient (learner/algorithms/cispo_policy_loss.py)


class ISCorrection(StrEnum):
    """``algo.is_correction``: what a loss with importance sampling does with its weight ``w = pi_prox / mu``."""

    none = "none"  # keep it
    tis = "tis"  # truncate it at the cap
    mis = "mis"  # zero it outside the band
    icepop = "icepop"  # zero it outside IcePop's band, per token only


class ISLevel(StrEnum):
    """``algo.is_level``: ``w`` per token, or the geometric mean of a response's token weights."""

    token = "token"
    sequence = "sequence"


# The other choices, one line each: StrEnum's functional API makes each name its value (lower-cased).
AggMode = StrEnum("AggMode", "token-mean seq-mean-token-mean seq-mean-token-sum seq-mean-token-sum-norm")  # algo.agg_mode
KLEstimator = StrEnum("KLEstimator", "k1 k2 k3")  # algo.kl_estimator: Schulman's estimates of KL per token
KLMode = StrEnum("KLMode", "loss reward")  # algo.kl_mode: the KL penalty as a loss term, or taken off the rewards
Overlong = StrEnum("Overlong", "none mask shaping")  # algo.overlong: responses cut at the length limit (dapo.py)
Dtype = StrEnum("Dtype", "float32 bfloat16 float16")  # model.dtype (float16: learner.engine=deepspeed only)
PublishDtype = StrEnum("PublishDtype", "as_trained bfloat16 float16")  # learner.publish_dtype: on the wire
RolloutEngine = StrEnum("RolloutEngine", "hf vllm")  # rollout.engine
PromptOverflow = StrEnum("PromptOverflow", "reject truncate")  # rollout.prompt_overflow: refused or left-cut
RefLogprobsOn = StrEnum("RefLogprobsOn", "worker learner none")  # rollout.ref_logprobs_on: who computes them
LearnerEngine = StrEnum("LearnerEngine", "torch deepspeed")  # learner.engine
LRSchedule = StrEnum("LRSchedule", "cosine constant")  # learner.lr_schedule
Sampling = StrEnum("Sampling", "fifo uniform")  # buffer.sampling: FIFO, or uniform draws from a replay table
DataSource = StrEnum("DataSource", "builtin jsonl parquet hf_disk none")  # data.source (none: the gateway's only)
EmptyResponse = StrEnum("EmptyResponse", "zero dead_letter score")  # reward.empty_response: a response with no text
WeightServerAuth = StrEnum("WeightServerAuth", "none curve hmac")  # weight_server.auth
# weight_server.delta: versions as deltas against the one before: auto = for 16-bit float tensors only
DeltaMode = StrEnum("DeltaMode", "off auto on")
ShmMode = StrEnum("ShmMode", "auto off")  # weight_server.shm: same-host peers move the bytes through shared memory
Logger = StrEnum("Logger", "tensorboard wandb mlflow")  # run.loggers: trackers, each also the module it needs
WandbMode = StrEnum("WandbMode", "online offline disabled")  # run.wandb_mode
Launcher = StrEnum("Launcher", "local ray")  # launcher: child processes on this machine, or Ray actors on a cluster
SandboxBackend = StrEnum("SandboxBackend", "bwrap none")  # sandbox.backend: bubblewrap, or no isolation at all
AnswerExtract = StrEnum("AnswerExtract", "boxed answer_is last_number")  # reward=math: where a response's answer is read
CodeExtract = StrEnum("CodeExtract", "auto fenced whole")  # reward=code_tests: where a response's program is read


class LearnerPlacement(StrEnum):  # ray.learner.strategy: Ray's placement-group strategies
    PACK = "PACK"
    SPREAD = "SPREAD"
    STRICT_PACK = "STRICT_PACK"
    STRICT_SPREAD = "STRICT_SPREAD"


class WorkerPlacement(StrEnum):  # ray.worker.strategy: over the nodes that can hold one, or Ray's own packing
    SPREAD = "SPREAD"
    DEFAULT = "DEFAULT"
