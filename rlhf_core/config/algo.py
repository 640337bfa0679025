"""``algo``: advantage estimator, policy loss and off-policy correction, and the rules on them
that the learner's loss functions also apply to their arguments (written here once: ``key`` is
the prefix a config check names its settings with, empty for a plain argument)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhf_core.choices import AggMode, Estimator, ISCorrection, ISLevel, KLEstimator, KLMode, Overlong, PolicyLoss, check_choice
from rlhf_core.errors import ConfigError


def check_clip(clip_eps_low: float, clip_eps_high: float | None, dual_clip_c: float | None, key: str = "", *,
               weight_clip: bool = False) -> float:
    """The PPO clip range: the upper bound (``clip_eps_low`` when None), after checking all three.
    ``weight_clip``: CISPO's clip of the IS weight, which may have no lower bound (``clip_eps_low``
    >= 1: ``1 - clip_eps_low <= 0``, MiniMax-M1's setting) and has no dual clip."""
    if weight_clip and dual_clip_c is not None:
        raise ConfigError(f"{key}dual_clip_c caps PPO's clipped loss; algo.policy_loss=cispo clips the IS weight and "
                          f"has no such cap: set {key}dual_clip_c=null, got {dual_clip_c}")
    if not (clip_eps_low > 0.0 if weight_clip else 0.0 < clip_eps_low < 1.0):
        span = "> 0 (>= 1: no lower bound)" if weight_clip else "in (0, 1) (>= 1, no lower bound, only with algo.policy_loss=cispo)"
        raise ConfigError(f"{key}clip_eps_low must be {span}, got {clip_eps_low}")
    high = clip_eps_low if clip_eps_high is None else clip_eps_high
    if not high > 0.0:
        raise ConfigError(f"{key}clip_eps_high must be > 0, got {clip_eps_high}")
    if dual_clip_c is not None and not dual_clip_c > 1.0:
        raise ConfigError(f"{key}dual_clip_c must be > 1 (Ye et al. use 3; null: no dual clip), got {dual_clip_c}")
    return high


def check_penalties(*, kl_coef: float = 0.0, label_smoothing: float = 0.0, value_clip: float | None = None,
                    key: str = "") -> None:
    """The KL coefficient, DPO's label smoothing and the critic's clip range (every one that is given)."""
    if not kl_coef >= 0:
        raise ConfigError(f"{key}kl_coef must be >= 0 (0: no KL term), got {kl_coef}")
    if not 0 <= label_smoothing < 0.5:
        raise ConfigError(f"{key}{'dpo_' if key else ''}label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if value_clip is not None and not value_clip > 0:
        raise ConfigError(f"{key}value_clip must be > 0 (or null: no clipping), got {value_clip}")


def check_gamma_lam(gamma: float, lam: float = 1.0, key: str = "") -> None:
    """The discount and GAE's lambda."""
    if not 0.0 <= gamma <= 1.0:
        raise ConfigError(f"{key}gamma must be in [0, 1], got {gamma}")
    if not 0.0 <= lam <= 1.0:
        raise ConfigError(f"{key}lam must be in [0, 1], got {lam}")


@dataclass(frozen=True)
class ISConfig:
    """How a policy loss weights token losses by ``w = pi_prox / pi_behav``: per token or the geometric
    mean of a sequence's (``level``), kept, truncated at ``tis_cap`` (``inf`` allowed), zeroed outside
    ``[mis_low, mis_high]`` or, per token only, outside IcePop's ``[icepop_low, icepop_high]``
    (``correction``; dropped tokens still count in the denominator)."""

    correction: ISCorrection = ISCorrection.none
    level: ISLevel = ISLevel.token
    tis_cap: float = 2.0
    mis_low: float = 0.5
    mis_high: float = 2.0
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    key: str = field(default="", compare=False, repr=False)  # prefix of the settings errors name: algo. or algo.seq_

    def __post_init__(self) -> None:
        check_choice("is_correction", self.correction, ISCorrection)
        check_choice("is_level", self.level, ISLevel)
        if not self.tis_cap > 0:
            raise ConfigError(f"{self.key}tis_cap must be > 0 (use a large number to disable truncation), got {self.tis_cap}")
        if not 0.0 <= self.mis_low < self.mis_high:
            raise ConfigError(f"masked IS needs 0 <= {self.key}mis_low < {self.key}mis_high, "
                              f"got [{self.mis_low}, {self.mis_high}]")
        if not 0.0 <= self.icepop_low < self.icepop_high:
            raise ConfigError(f"IcePop needs 0 <= algo.icepop_low < algo.icepop_high, got [{self.icepop_low}, {self.icepop_high}]")
        if self.correction == ISCorrection.icepop and self.level != ISLevel.token:
            raise ConfigError("algo.is_correction=icepop masks single tokens; with algo.is_level=sequence use "
                              "algo.is_correction=mis (whole responses) or set algo.is_level=token")


@dataclass
class AlgoConfig:
    """Advantage estimator, policy loss and off-policy correction.

    The losses with importance sampling (decoupled, gspo, cispo) weight each token by
    ``w = pi_prox / mu`` (proximal over behaviour policy), truncated (``is_correction=tis``),
    masked outside a band (``mis``) or, per token only, outside IcePop's band ``icepop_low``-
    ``icepop_high`` (0.5-5, Ring-1T's; ``icepop``: docs/usage.md#algorithms says how it differs).
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
    estimator: Estimator = Estimator.grpo
    policy_loss: PolicyLoss = PolicyLoss.decoupled
    group_size: int = 4  # responses per prompt
    max_staleness: int = 2  # learner_version - oldest token version allowed at consumption
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip_c: float | None = None
    is_correction: ISCorrection = ISCorrection.tis
    is_level: ISLevel = ISLevel.token
    tis_cap: float = 2.0  # is_level=token
    mis_low: float = 0.5
    mis_high: float = 2.0
    seq_tis_cap: float = 1.001  # is_level=sequence: caps on the geometric mean (see the docstring)
    seq_mis_low: float = 0.999
    seq_mis_high: float = 1.001
    icepop_low: float = 0.5  # is_correction=icepop: the band per token (Ring-1T's alpha, beta)
    icepop_high: float = 5.0
    agg_mode: AggMode = AggMode["token-mean"]
    gamma: float = 1.0
    lam: float = 0.95
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = KLEstimator.k3
    kl_mode: KLMode = KLMode.loss
    entropy_coef: float = 0.0
    value_clip: float | None = 0.2
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
    overlong: Overlong = Overlong.none
    overlong_buffer: int = 4  # tokens at the end of the response budget where shaping's penalty ramps to -1
    # the learner warns (rate-limited) when an update's lag-0 KL(behaviour || learner), k3 per token
    # (mismatch/lag0_kl_k3), exceeds this: the workers and the learner do not compute the same distribution.
    # float32 reads 1e-14 with either engine, weights sent as bfloat16 1.4e-7 (docs/operations.md)
    mismatch_warn: float = 1e-8

    def importance_sampling(self) -> ISConfig:
        """The decoupled loss's IS settings: correction and level, with the cap and band of that level
        (``tis_cap``/``mis_*`` per token, ``seq_tis_cap``/``seq_mis_*`` on the geometric mean)."""
        seq = "seq_" if self.is_level == ISLevel.sequence else ""
        return ISConfig(correction=self.is_correction, level=self.is_level, tis_cap=getattr(self, f"{seq}tis_cap"),
                        mis_low=getattr(self, f"{seq}mis_low"), mis_high=getattr(self, f"{seq}mis_high"),
                        icepop_low=self.icepop_low, icepop_high=self.icepop_high, key=f"algo.{seq}")

    def check(self) -> None:
        """Groups, staleness bound, clip range, importance-sampling caps, discounting and the options
        that only some estimators use."""
        estimator = Estimator(self.estimator)
        if self.group_size < 1:
            raise ConfigError(f"algo.group_size must be >= 1, got {self.group_size}")
        if estimator.grouped and self.group_size < 2:
            raise ConfigError(f"algo.estimator={estimator} compares responses of one prompt, so algo.group_size "
                              f"must be >= 2, got {self.group_size}")
        if self.max_staleness < 0:
            raise ConfigError(f"algo.max_staleness must be >= 0, got {self.max_staleness}")
        check_clip(self.clip_eps_low, self.clip_eps_high, self.dual_clip_c, key="algo.",
                   weight_clip=self.policy_loss == PolicyLoss.cispo)
        self.importance_sampling()
        if self.policy_loss == PolicyLoss.gspo and self.is_level != ISLevel.sequence:
            raise ConfigError("algo.policy_loss=gspo weighs whole responses, so its behaviour weight pi_prox/mu is one per "
                              "response too: set algo.is_level=sequence (experiment=gspo does)")
        check_gamma_lam(self.gamma, self.lam, key="algo.")
        check_penalties(kl_coef=self.kl_coef, label_smoothing=self.dpo_label_smoothing, value_clip=self.value_clip, key="algo.")
        if not self.mismatch_warn > 0:
            raise ConfigError(f"algo.mismatch_warn must be > 0 (the lag-0 KL(behaviour || learner) per token above which "
                              f"the learner warns; a large number such as 1e9 never warns), got {self.mismatch_warn}")
        if self.vtrace and estimator != Estimator.gae:
            raise ConfigError(f"algo.vtrace=true corrects the critic's targets of algo.estimator=gae; algo.estimator="
                              f"{estimator} has no critic, so it would change nothing: set algo.vtrace=false")
        if self.filter_groups and not estimator.grouped:
            grouped = ", ".join(e for e in Estimator if e.grouped)
            raise ConfigError(f"algo.filter_groups drops groups whose rewards are all equal, which teach nothing only to a "
                              f"group-relative estimator ({grouped}); algo.estimator={estimator} learns from them: "
                              "set algo.filter_groups=false")
