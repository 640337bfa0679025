"""The rules between sections, and :func:`validate`, which runs every check once at start-up
before any model is built. A rule within one section is that section's ``check()``."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from rlhf_core.choices import DataSource, Dtype, Estimator, LearnerEngine, Overlong, RolloutEngine
from rlhf_core.config.buffer import replay_mode
from rlhf_core.config.model import VLLM_LORA_RANKS
from rlhf_core.config.reward import ENV_COMPONENT, reward_names
from rlhf_core.config.rollout import budget_setting, env_target, response_budget
from rlhf_core.config.schema import Config, to_object
from rlhf_core.errors import ConfigError


def validate(cfg: Any) -> None:
    """Check every setting and every rule between settings. Raises ConfigError naming the numbers."""
    if isinstance(cfg, DictConfig):
        cfg = to_object(cfg)
    cfg.algo.check()
    batch_holds_whole_groups(cfg)  # before the learner's micro-batches: what a batch size must fit first
    for section in (cfg.learner, cfg.rollout, cfg.model, cfg.data, cfg.buffer, cfg.weight_server, cfg.run,
                    cfg.reward, cfg.eval, cfg.distill, cfg.ray, cfg.gateway, cfg.sandbox):
        section.check()
    for rule in (tiny_model_holds_context, lora_rank_runs_on_vllm, float16_has_loss_scaling, buffer_holds_a_batch,
                 no_reward_hides_the_environment, overlong_buffer_fits_the_budget, evaluation_runs_single_turn,
                 learner_ranks_have_an_engine, something_makes_samples, gateway_fills_a_fifo,
                 distillation_trains_a_policy_gradient, distillation_keeps_equal_reward_groups):
        rule(cfg)


def batch_holds_whole_groups(cfg: Config) -> None:
    a, lc = cfg.algo, cfg.learner
    if lc.batch_size % a.group_size:
        raise ConfigError(f"learner.batch_size {lc.batch_size} is not divisible by algo.group_size {a.group_size}; "
                          f"groups are kept whole, so use a multiple such as {a.group_size * max(1, lc.batch_size // a.group_size)}")


def tiny_model_holds_context(cfg: Config) -> None:
    """The built-in tiny model must hold a whole prompt plus response."""
    model, rollout = cfg.model, cfg.rollout
    if model.path is not None or model.name != "tiny":
        return
    budget = response_budget(rollout)
    need = rollout.max_prompt_tokens + budget
    if need > model.tiny.max_position_embeddings:
        raise ConfigError(f"rollout.max_prompt_tokens {rollout.max_prompt_tokens} + {budget_setting(rollout)} {budget} = "
                          f"{need} exceeds model.tiny.max_position_embeddings {model.tiny.max_position_embeddings}")


def lora_rank_runs_on_vllm(cfg: Config) -> None:
    r = cfg.model.lora.r
    if cfg.rollout.engine == RolloutEngine.vllm and r and r > VLLM_LORA_RANKS[-1]:
        raise ConfigError(f"model.lora.r={r} is above vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}; lower it, "
                          "or use rollout.engine=hf")


def float16_has_loss_scaling(cfg: Config) -> None:
    if cfg.model.dtype == Dtype.float16 and cfg.learner.engine == LearnerEngine.torch:
        raise ConfigError("model.dtype=float16 with learner.engine=torch: the torch engine does not scale the loss, so "
                          "float16 gradients underflow to 0 and updates are lost; use model.dtype=bfloat16 (or float32), "
                          "or learner.engine=deepspeed (its ZeRO optimizer scales the loss for float16)")


def buffer_holds_a_batch(cfg: Config) -> None:
    if cfg.buffer.capacity < cfg.learner.batch_size:
        raise ConfigError(f"buffer.capacity {cfg.buffer.capacity} is smaller than one batch (learner.batch_size "
                          f"{cfg.learner.batch_size})")


def no_reward_hides_the_environment(cfg: Config) -> None:
    if env_target(cfg.rollout) is not None and ENV_COMPONENT in reward_names(cfg.reward):
        raise ConfigError(f"a reward is named {ENV_COMPONENT!r}, the component an episode's environment rewards are kept "
                          f"under (rollout.env): one would hide the other in reward_components; rename the reward")


def overlong_buffer_fits_the_budget(cfg: Config) -> None:
    algo, budget = cfg.algo, response_budget(cfg.rollout)
    if algo.overlong == Overlong.shaping and not 0 < algo.overlong_buffer < budget:
        raise ConfigError(f"algo.overlong_buffer {algo.overlong_buffer} must be between 1 and the response budget "
                          f"{budget} ({budget_setting(cfg.rollout)}) - 1")


def evaluation_runs_single_turn(cfg: Config) -> None:
    if cfg.eval.every and env_target(cfg.rollout) is not None:
        raise ConfigError("eval.every > 0 with rollout.env: the evaluator samples one reply per prompt and cannot run "
                          "episodes yet; set eval.every=0 (the training reward of an episode run is its environment's)")


def learner_ranks_have_an_engine(cfg: Config) -> None:
    ranks = cfg.ray.learner.ranks
    if ranks > 1 and cfg.learner.engine != LearnerEngine.deepspeed:
        raise ConfigError(f"ray.learner.ranks={ranks} runs the learner as {ranks} ranks, which needs "
                          "learner.engine=deepspeed (the torch engine is single-process)")


def something_makes_samples(cfg: Config) -> None:
    if cfg.data.source == DataSource.none and not cfg.gateway.enabled:
        raise ConfigError("data.source=none (no prompts of the run's own) needs gateway.enabled=true: "
                          "otherwise nothing would ever produce a sample")


def gateway_fills_a_fifo(cfg: Config) -> None:
    if cfg.gateway.enabled and replay_mode(cfg.buffer):
        raise ConfigError("the gateway appends its episodes to a FIFO buffer; it does not fill a replay table "
                          "(buffer.max_reuse=1, buffer.samples_per_insert=null, buffer.sampling=fifo)")


def distillation_trains_a_policy_gradient(cfg: Config) -> None:
    if cfg.distill.enabled and cfg.algo.estimator == Estimator.dpo:
        raise ConfigError("distill.teacher.path with algo.estimator=dpo: the teacher's per-token advantage is trained by a "
                          "policy gradient, which DPO's pair loss has none of; use algo.estimator=grpo (or another "
                          "policy-gradient estimator) or drop distill.teacher.path")


def distillation_keeps_equal_reward_groups(cfg: Config) -> None:
    if cfg.distill.enabled and cfg.distill.reward_weight == 0 and cfg.algo.filter_groups:
        raise ConfigError("algo.filter_groups=true with pure distillation (distill.reward_weight=0): the filter would drop "
                          "every group whose rewards are equal, though the teacher's advantage does not come from the "
                          "rewards; set algo.filter_groups=false or distill.reward_weight > 0")
