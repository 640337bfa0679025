"""Names one component writes and another reads back by string.

The learner writes one metrics row per update (to ``METRICS_FILE``, to its stats record in the
buffer, to Prometheus and TensorBoard); workers put their throughput into every heartbeat; the
run app (``rlhf_run``: live line, summary, plots, monitor) and the benches read these records
without importing the components that wrote them. Both sides take the names from here, the one
module every package may import, so a rename cannot silently empty a plot or a summary field.
"""

from __future__ import annotations

METRICS_FILE = "metrics.jsonl"  # in the run's output folder: one JSON line per learner update
EVAL_FILE = "eval.jsonl"  # in the run's output folder: one JSON line per evaluation (rollout_workers.evaluator)

# The components whose stats `BufferClient.publish_stats` stores: `MonitorClient.metrics()["stats"][name]`.
LEARNER_STATS = "learner"
WEIGHT_SERVER_STATS = "weight_server"
GATEWAY_STATS = "gateway"  # rlhf-gateway's /v1/rl/stats (calls, sessions, groups, errors_<code>), every second and as it stops
GATEWAY_LEVELS = ("sessions_open", "groups_waiting", "calls_running")  # its other numbers are running totals
GATEWAY_ERRORS = "errors_"  # the prefix of its counts of errors answered, by code
EVAL_STATS = "eval"  # the newest evaluation; its keys start with EVAL_PREFIX and the learner copies them into its row
EVAL_PREFIX = "eval/"
EVAL_VERSION = "eval/version"  # the policy version evaluated
EVAL_REWARD_MEAN = "eval/reward_mean"

# Keys of a learner metrics row.
VERSION = "learner/version"
UPDATES = "learner/updates"  # an update re-trained after a crash repeats its number
SAMPLES_TRAINED = "learner/samples_trained"  # cumulative
NUM_SAMPLES = "learner/num_samples"  # in this update's batch
NUM_TOKENS = "learner/num_tokens"  # policy tokens in this update's batch (the loss mask's)
PROMPT_LEN_MEAN = "reward/prompt_len_mean"  # mean prompt tokens per sample of the batch (NUM_TOKENS has none)
SAMPLES_PER_S = "learner/samples_per_s"  # of this update's compute time
TOKENS_PER_S = "learner/tokens_per_s"
# per device: (4 x params + 2 x trainable params: 6 x params in full) x tokens trained (prompt + response,
# once an epoch) / data-parallel ranks / compute time
TRAIN_TFLOPS = "learner/tflops"
MFU = "learner/mfu"  # TRAIN_TFLOPS / one device's peak (absent when the peak is unknown, e.g. on CPU)
TIME_WAIT_S = "learner/time_wait_s"  # from the end of one update to the next, less TIME_READ_S
TIME_READ_S = "learner/time_read_s"  # decoding and validating the update's batch
TIME_COMPUTE_S = "learner/time_compute_s"
TIME_PUBLISH_S = "learner/time_publish_s"
TIME = "time"  # wall clock (time.time()) when the row was written
REWARD_MEAN = "reward/mean"
#: the learner's own ``reward/<stat>`` metrics of a batch; a reward component (kept as ``reward/<its
#: name>``) may not take one of these names, or the two would write one metric
REWARD_STATS = frozenset({
    "mean", "std", "min", "max", "prompt_len_mean", "response_len_mean", "truncated_frac", "policy_len_mean",
    "turns_mean", "overlong_penalty_mean", "overlong_penalized_frac", "shaped_mean", "normalized_mean",
    "running_mean", "running_std",
})
STALENESS_MEAN = "staleness/mean"
STALENESS_MAX = "staleness/max"
STALENESS_HIST = "staleness/hist"  # samples per lag 0, 1, ... in this update's batch
# on-policy distillation (distill.teacher.path): the student's reverse KL to the teacher per token of the
# loss mask, KL(mu || teacher) on the samples of mu (k1: the mean of log mu - log teacher, the negative
# mean teacher advantage; k3: Schulman's low-variance estimate), and the teacher's no-grad pass time
DISTILL_REVERSE_KL = "distill/reverse_kl"
DISTILL_REVERSE_KL_K3 = "distill/reverse_kl_k3"
DISTILL_TEACHER_S = "distill/time_teacher_s"
# kl.png's: the KL to the teacher when distilling, else against the reference when there is one, else vs pi_prox
KL_KEYS = (DISTILL_REVERSE_KL, "loss/kl", "loss/approx_kl")
# Train/rollout mismatch (learner/algorithms/mismatch.py): the workers' behaviour log-probs against the
# learner's of the same tokens, per split: lag 0 (sampled by the weights the learner holds, context
# included: numerics or an engine bug) and lagged (older weights or context: staleness too).
MISMATCH_LAG0, MISMATCH_LAGGED = "lag0", "lagged"
MISMATCH_SPLITS = {MISMATCH_LAG0: "tokens at lag 0 (sampled by the weights the learner holds)",
                   MISMATCH_LAGGED: "tokens at lag > 0 (sampled by older weights, or after older context)"}
MISMATCH_STATS = {  # stat -> what it is, for Prometheus's HELP text
    "abs_mean": "mean |log pi_learner - log mu_behaviour| in nats",
    "abs_max": "max |log pi_learner - log mu_behaviour| in nats",
    "kl_k3": "KL(behaviour || learner) per token, k3 estimate (r - 1 - log r, r = pi_learner / mu_behaviour)",
    "out_of_band_frac": "share of tokens whose ratio pi_learner / mu_behaviour is outside [0.5, 2]",
    "tokens": "loss-mask tokens counted",
}


def mismatch_key(split: str, stat: str) -> str:
    """``("lag0", "kl_k3")`` -> ``mismatch/lag0_kl_k3``: a learner row's key."""
    return f"mismatch/{split}_{stat}"


#: a learner row's key -> what it means (Prometheus's HELP text); a key not here is described by its name
METRIC_HELP = {mismatch_key(split, stat): f"train/rollout mismatch over the update's {where}: {what}"
               for split, where in MISMATCH_SPLITS.items() for stat, what in MISMATCH_STATS.items()}
# In the learner's last stats record only (`_finish`): why it stopped, one of STOP_REASONS
STOPPED_BY = "learner/stopped_by"
STOP_BUDGET, STOP_TIME, STOP_DATA, STOP_SIGNAL = "budget", "time", "data", "signal"
STOP_REASONS = (STOP_BUDGET, STOP_TIME, STOP_DATA, STOP_SIGNAL)  # the learner's ranks agree on the last one any saw

# Fields of a worker's stats record (its heartbeat: `MonitorClient.metrics()["consumers"][id]["stats"]`).
WORKER_TOKENS = "tokens"  # generated tokens of finished responses, cumulative
WORKER_SAMPLES = "samples"
WORKER_TOKENS_PER_S = "tokens_per_s"  # over the worker's uptime
WORKER_SAMPLES_PER_S = "samples_per_s"
WORKER_SCORE_SHARE = "score_share"  # share of the scoring threads' time spent scoring (1: the reward is the bottleneck)
WORKER_REWARD_CALLS_PER_S = "reward_calls_per_s"  # reward function/model calls, over the worker's uptime
WORKER_ENGINE_STEPS = "engine_steps"  # decoding passes of the worker's engine (hf), cumulative
WORKER_ENGINE_PREFILLS = "engine_prefills"  # its prefill passes (over engine_steps: how often a step carries one)
WORKER_ENGINE_REUSED = "engine_reused_tokens"  # prompt tokens not prefilled: K/V kept from a finished turn (hf) or cached (vllm)
WORKER_ENGINE_PROMPT = "engine_prompt_tokens"  # prompt tokens of its requests, reused or prefilled
WORKER_UPTIME = "uptime_s"  # seconds since the worker process started

# Running totals (Prometheus counters); every other number of these records is a level (a gauge).
LEARNER_TOTALS = (UPDATES, SAMPLES_TRAINED)
WORKER_TOTALS = (
    "prompts", "prompts_empty", WORKER_SAMPLES, WORKER_TOKENS, "dead_letters", "duplicates", "leases_lost",
    "released", "weight_updates", "t_generate", "t_score", "t_wait", "t_weights", "weight_pulls", "weight_timeouts",
    "reward_calls", "reward_timeouts", "empty_responses", "groups_filtered", "samples_filtered",
    # multi-turn episodes (rollout_workers.episodes.EpisodeStats)
    "episodes_started", "episodes_failed", "episodes_stop", "episodes_max_turns", "episodes_length", "episode_turns",
    "episode_policy_tokens", "episode_observation_tokens", "observations_cut", "tool_calls", "tool_call_errors",
    "retokenisation_drift", "env_calls", "env_timeouts",
    "prompts_rendered", "prompts_truncated", "prompts_rejected", "prompts_empty_text", "prompt_tokens_cut",
    WORKER_ENGINE_STEPS, WORKER_ENGINE_PREFILLS, WORKER_ENGINE_REUSED, WORKER_ENGINE_PROMPT,
)
# What adds up over a run's workers, dead ones included (the report's tokens generated, rlhf-plan
# --from-run's busy time): the buffer keeps these of the workers it retires, summed.
WORKER_SUMMED = (*WORKER_TOTALS, WORKER_UPTIME)


def gateway_errors(stats: dict) -> dict[str, int]:
    """A gateway's counts of errors answered (its ``GATEWAY_STATS``), by code, in code order."""
    return {k.removeprefix(GATEWAY_ERRORS): v for k, v in sorted(stats.items()) if k.startswith(GATEWAY_ERRORS)}
