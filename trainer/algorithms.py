"""The RL algorithms: the registry of every fact about them, and the settings they are made of.

This module is the one place where the family is declared. It imports no torch: the
training config (:mod:`areal_agents.trainer.config`) reads its names and facts, and the
math lives in :mod:`areal_agents.trainer.advantage` and :mod:`areal_agents.trainer.loss`.

Choices made:

* An algorithm is data, not a class: an :class:`AlgorithmSpec` holds an
  :class:`AdvantageSpec` (how returns become advantages), a :class:`LossSpec` (how the one
  decoupled PPO loss of :mod:`areal_agents.trainer.loss` is set), the critic's settings
  where it trains one, and a few flags (dynamic sampling, overlong penalty). ``ALGORITHMS``
  maps names to specs; ``get_algorithm`` looks one up and suggests the nearest name on a typo.
* A setting is declared once. The config's ``loss`` and ``advantage`` sections hold
  overrides of the algorithm's preset (null = the algorithm's own value): their classes are
  made from :class:`LossSpec` and :class:`AdvantageSpec` by :func:`overrides_of`, and
  :func:`resolve` turns an algorithm and its overrides into the one object the trainer
  receives. The critic's section (:class:`CriticConfig`) is itself what the critic receives.
* Every algorithm is async-ready: the behaviour weight pi_prox / pi_behav is clipped at 5
  unless a spec says otherwise, and ``check_async_correction`` refuses async runs without a
  correction.
* Loss aggregation is named by unit and reduction (``weighting`` x ``agg``), as in the
  training config; single-turn batches reproduce each paper's aggregation exactly, and by
  default a multi-turn episode weighs as much as a single-turn one.
* KL to a reference model is off everywhere (``kl_coef = 0``); it needs reference
  logprobs. Where a paper uses it, its docstring says so.

Left out: per-algorithm learning-rate or batch-size recipes (they belong to the run
config), value-model warm-up for PPO (the critic trains from the first
step).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from areal_agents.errors import ConfigError
from areal_agents.trainer.config_checks import Checked

AlgorithmName = Literal[
    "grpo", "dr_grpo", "lite_ppo", "rloo", "gspo", "dapo", "ppo", "reinforce_pp",
    "reinforce_pp_baseline", "sapo", "m2po",
]  # fmt: skip
"""The names of the registry (``ALGORITHMS``), the values of the config's ``algorithm``."""

Estimator = Literal["group", "step_group", "gae", "turn_gae"]
Baseline = Literal["mean", "rloo", "batch", "none"]
Scale = Literal["std", "batch_std", "batch_centered_std", "none"]
StepScale = Literal["std", "none"]
Weighting = Literal["episode", "completion", "token"]
Reduce = Literal["mean", "sum", "sum_norm"]
RatioLevel = Literal["token", "sequence"]
BehaviourCorrection = Literal["clip", "mask", "none"]
KLEstimator = Literal["k1", "k2", "k3"]
Proximal = Literal["recompute", "loglinear"]
Agg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]

CRITIC_ESTIMATORS = frozenset({"gae", "turn_gae"})
"""The estimators that take their advantages from a critic (the others need groups)."""

_TOKEN_AGG: dict[tuple[str, str], Agg] = {
    ("token", "mean"): "token_mean",
    ("token", "sum"): "token_mean",
    ("token", "sum_norm"): "token_mean",
    ("completion", "mean"): "seq_mean_token_mean",
    ("completion", "sum"): "seq_mean_token_sum",
    ("completion", "sum_norm"): "seq_mean_token_sum_norm",
}
"""(unit, reduce) -> the ``aggregate`` equal to it when a row is one unit."""


def _choice(section: str, name: str, value: object, kind: object) -> list[str]:
    """The problem with ``section.name = value`` if it is not one of ``kind``'s choices."""
    choices = get_args(kind)
    if value in choices:
        return []
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return [
        f"{section}.{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}{hint}"
    ]


def _raise(section: str, problems: list[str]) -> None:
    """Raise every problem of a settings section at once as one ``ConfigError``."""
    if problems:
        raise ConfigError(f"invalid {section} settings:", problems)


@dataclass(frozen=True)
class LossSpec:
    """A setting of the one policy loss (``areal_agents.trainer.loss.policy_loss``);
    validated on creation, every problem at once (``ConfigError``)."""

    clip_low: float | None = 0.2
    """eps_low: the ratio current / proximal policy is clipped below at 1 - eps_low (None in
    M2PO's preset: no lower bound)."""
    clip_high: float | None = 0.2
    """eps_high: the ratio is clipped above at 1 + eps_high (DAPO's clip-higher: 0.28; None
    in M2PO's preset: no upper bound)."""
    ratio_level: RatioLevel = "token"
    """token: per-token ratio; sequence: geometric mean over each completion (GSPO)."""
    behaviour_correction: BehaviourCorrection = "clip"
    """Weight proximal / behaviour: clip at behaviour_cap, mask tokens above it, or none."""
    behaviour_cap: float = 5.0
    """Cap of the behaviour importance weight, >= 1 (on-policy tokens weigh 1)."""
    proximal: Proximal = "recompute"
    """pi_prox's logprobs: recomputed by an extra forward pass before the update, or
    interpolated from the policy versions (loglinear, ``approx_proximal_logp``)."""
    weighting: Weighting = "episode"
    """What weighs equally: each episode (however many turns), each completion, each token."""
    agg: Reduce = "mean"
    """Token losses within a unit: mean, sum, or sum / max_new_tokens (Dr.GRPO)."""
    sapo_tau_pos: float | None = None
    """SAPO gate temperature for positive advantages (None, a hard clip, in every preset but
    SAPO's)."""
    sapo_tau_neg: float | None = None
    """SAPO gate temperature for negative advantages (set with ``sapo_tau_pos``)."""
    m2po_tau: float | None = None
    """M2PO: mask tokens until the second moment of log-ratios is <= this (None, off, in
    every preset but M2PO's)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference (initial) model; 0 = none."""
    kl_estimator: KLEstimator = "k3"
    """k1, k2 or k3 estimator of KL(pi_theta || pi_ref)."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus on the trained tokens (the policy's token entropy at the
    sampling temperature, aggregated like the policy loss; against early collapse of
    exploration); 0 = none."""

    def __post_init__(self) -> None:
        problems = _choice("loss", "ratio_level", self.ratio_level, RatioLevel)
        problems += _choice(
            "loss", "behaviour_correction", self.behaviour_correction, BehaviourCorrection
        )
        problems += _choice("loss", "weighting", self.weighting, Weighting)
        problems += _choice("loss", "agg", self.agg, Reduce)
        problems += _choice("loss", "kl_estimator", self.kl_estimator, KLEstimator)
        problems += _choice("loss", "proximal", self.proximal, Proximal)
        for name in ("clip_low", "clip_high", "m2po_tau", "sapo_tau_pos", "sapo_tau_neg"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                problems.append(f"loss.{name}: must be > 0 or null, got {v}")
        if (self.sapo_tau_pos is None) != (self.sapo_tau_neg is None):
            problems.append("loss.sapo_tau_pos, loss.sapo_tau_neg: set both (SAPO) or neither")
        if not self.behaviour_cap >= 1:
            problems.append(
                f"loss.behaviour_cap: must be >= 1 (on-policy tokens weigh 1), "
                f"got {self.behaviour_cap}"
            )
        if not self.kl_coef >= 0:
            problems.append(f"loss.kl_coef: must be >= 0, got {self.kl_coef}")
        if not self.entropy_coef >= 0:
            problems.append(f"loss.entropy_coef: must be >= 0, got {self.entropy_coef}")
        _raise("loss", problems)

    @property
    def token_agg(self) -> Agg:
        """The ``policy_loss`` aggregation equal to (weighting, agg) when a row is one unit."""
        unit = "token" if self.weighting == "token" else "completion"
        return _TOKEN_AGG[(unit, self.agg)]


@dataclass(frozen=True)
class AdvantageSpec:
    """How returns become advantages (``areal_agents.trainer.advantage``: ``group_advantages``,
    ``step_group_advantages``, ``tree_gae``, ``turn_gae``). The discount is ``rollout.gamma``;
    GAE's lambda and whitening are the critic's (:class:`CriticConfig`)."""

    estimator: Estimator = "group"
    """group: the algorithm's baseline and scale over a group's episodes. step_group:
    GiGPO, that plus step-level groups, the turns of a group's episodes that start from the
    same state (the env's ``info["state_key"]``, else the prompt's last tool or user
    messages), normalized together: A = A_E + omega * A_S
    (``areal_agents.trainer.advantage.step_group_advantages``). gae: PPO's token-level GAE.
    turn_gae: GAE with one value per turn boundary, ``critic.lam`` and ``rollout.gamma`` once
    per turn (``areal_agents.trainer.advantage.turn_gae``). group and step_group go with
    algorithms without a critic, gae and turn_gae with ppo."""
    baseline: Baseline = "mean"
    """Group estimator's baseline: group mean, leave-one-out, batch mean, or none."""
    scale: Scale = "std"
    """Group estimator's divisor: group std, batch std, batch std of centered returns, none."""
    eps: float = 1e-6
    """Added to the std before dividing."""
    omega: float = 1.0
    """step_group: the weight of the step-level advantage, A = A_E + omega * A_S, >= 0
    (GiGPO's 1.0). 0 gives the episode-level advantage alone (the algorithm's own)."""
    step_scale: StepScale = "std"
    """step_group: divide the step-level advantage by its step group's std (std, GiGPO's),
    or not (none)."""

    @property
    def needs_critic(self) -> bool:
        """Whether the advantages come from a critic (gae, turn_gae)."""
        return self.estimator in CRITIC_ESTIMATORS

    def __post_init__(self) -> None:
        problems = _choice("advantage", "estimator", self.estimator, Estimator)
        problems += _choice("advantage", "baseline", self.baseline, Baseline)
        problems += _choice("advantage", "scale", self.scale, Scale)
        problems += _choice("advantage", "step_scale", self.step_scale, StepScale)
        if not 0 <= self.omega < float("inf"):
            problems.append(f"advantage.omega: must be >= 0, got {self.omega}")
        if not self.eps >= 0:
            problems.append(f"advantage.eps: must be >= 0, got {self.eps}")
        _raise("advantage", problems)


@dataclass(frozen=True)
class CriticConfig(Checked):
    """The value model of PPO: a copy of the policy's base with a scalar head, and GAE."""

    path: str | None = None
    """Initial weights of the critic's backbone; None = the policy's (``model.path``)."""
    lr: float = 1e-5
    """Peak learning rate of the critic's own AdamW (betas, decay, clip and the schedule's
    warmup and decay from ``optim``)."""
    lam: float = 0.95
    """GAE's lambda in [0, 1]: 1 = Monte-Carlo returns, 0 = one-step TD targets."""
    value_clip: float | None = 0.2
    """New values are clipped to within this of the old ones in the value loss; None = off."""
    whiten: bool = True
    """Whiten advantages over the step's sampled tokens (mean 0, std 1)."""

    def _rules(self) -> Sequence[tuple[str, bool, str]]:
        clip = self.value_clip
        return (
            ("lr", self.lr > 0, "> 0"),
            ("lam", 0 <= self.lam <= 1, "in [0, 1]"),
            ("value_clip", clip is None or clip > 0, "> 0 or null (no clipping)"),
        )


@dataclass(frozen=True)
class OverlongSpec:
    """DAPO's soft overlong punishment, added to each completion's per-turn reward
    (``areal_agents.trainer.advantage.overlong_penalty``)."""

    cache_len: int | None = None
    """Length of the soft-penalty zone before max_len; None = 20% of max_len (DAPO's
    4096 of 20480)."""

    def cache(self, max_len: int) -> int:
        """The soft zone's length for a generation budget of ``max_len`` tokens."""
        cache = self.cache_len if self.cache_len is not None else max(1, round(0.2 * max_len))
        return min(cache, max_len)


@dataclass(frozen=True)
class AlgorithmSpec:
    """One algorithm: an advantage estimator, a loss setting, and what the loop must do."""

    name: str
    reference: str
    """The paper that defines it."""
    advantage: AdvantageSpec = field(default_factory=AdvantageSpec)
    loss: LossSpec = field(default_factory=LossSpec)
    critic: CriticConfig | None = None
    """The value model's settings where the algorithm trains one (its advantages come from
    GAE); None = no critic."""
    dynamic_sampling: bool = False
    """Drop groups whose episodes all got the same reward and sample more (DAPO)."""
    overlong: OverlongSpec | None = None
    """Penalize completions that run into the length budget (DAPO); None = off."""
    doc: str = ""
    """The formula, from the builder's docstring."""

    @property
    def needs_critic(self) -> bool:
        """The loop trains a value model and uses GAE."""
        return self.critic is not None

    @property
    def uses_groups(self) -> bool:
        """Its advantages are normalized within a group (it needs ``group_size >= 2``)."""
        return not self.needs_critic and self.advantage.baseline in ("mean", "rloo")

    def __post_init__(self) -> None:
        if self.needs_critic != self.advantage.needs_critic:
            raise ConfigError(
                f"algorithm {self.name!r}: critic={self.critic} but "
                f"advantage.estimator={self.advantage.estimator!r}; a critic goes with "
                f"{' or '.join(sorted(CRITIC_ESTIMATORS))}"
            )


# ------------------------------------------------------------------ the family
# Notation: R(e) the episode return, G(c) a completion's return, g its group, B the batch,
# r = pi_theta / pi_prox per token (times the behaviour weight w, omitted below),
# clip(r) = clip(r, 1 - eps_low, 1 + eps_high), |y| the tokens of one response.


def grpo() -> AlgorithmSpec:
    """GRPO: "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language
    Models" (Shao et al., 2024)::

        A(c) = (G(c) - mean_g R) / (std_g R + eps)
        L    = -1/|E| sum_e 1/|y_e| sum_t min(r A, clip(r) A),   eps_low = eps_high = 0.2

    The paper adds beta * KL_k3 to the reference (beta = 0.04); here kl_coef = 0.
    """
    return AlgorithmSpec(
        "grpo",
        "Shao et al., 2024. DeepSeekMath: Pushing the Limits of Mathematical Reasoning",
        AdvantageSpec(baseline="mean", scale="std"),
        LossSpec(),
    )


def dr_grpo() -> AlgorithmSpec:
    """Dr.GRPO: "Understanding R1-Zero-Like Training: A Critical Perspective" (Liu et al.,
    2025). GRPO without the std division and without the per-response length mean::

        A(c) = G(c) - mean_g R
        L    = -1/(|E| * max_tokens) sum_e sum_t min(r A, clip(r) A)

    ``max_tokens`` is the generation budget (sampling.max_new_tokens), a constant.
    """
    return AlgorithmSpec(
        "dr_grpo",
        "Liu et al., 2025. Understanding R1-Zero-Like Training: A Critical Perspective",
        AdvantageSpec(baseline="mean", scale="none"),
        LossSpec(agg="sum_norm"),
    )


def lite_ppo() -> AlgorithmSpec:
    """LitePPO: "Tricks or Traps? A Deep Dive into RL for LLM Reasoning" (Liu et al., 2025).
    Group-level mean, batch-level std, token-level loss::

        A(c) = (G(c) - mean_g R) / (std_B R + eps)
        L    = -1/N_tokens sum_tokens min(r A, clip(r) A)
    """
    return AlgorithmSpec(
        "lite_ppo",
        "Liu et al., 2025. Tricks or Traps? A Deep Dive into RL for LLM Reasoning",
        AdvantageSpec(baseline="mean", scale="batch_std"),
        LossSpec(weighting="token"),
    )


def rloo() -> AlgorithmSpec:
    """RLOO: "Back to Basics: Revisiting REINFORCE-Style Optimization for Learning from Human
    Feedback in LLMs" (Ahmadian et al., 2024). Leave-one-out baseline, sequence-level
    REINFORCE (the sum of a response's token log-probs)::

        A(c) = G(c) - 1/(K - 1) sum_{e' in g, e' != e} R(e')      K = episodes in g
        L    = -1/|E| sum_e sum_t min(r A, clip(r) A)           (r = 1 on-policy)
    """
    return AlgorithmSpec(
        "rloo",
        "Ahmadian et al., 2024. Back to Basics: Revisiting REINFORCE-Style Optimization",
        AdvantageSpec(baseline="rloo", scale="none"),
        LossSpec(agg="sum"),
    )


def gspo() -> AlgorithmSpec:
    """GSPO: "Group Sequence Policy Optimization" (Zheng et al., 2025). GRPO advantages, a
    sequence-level ratio (geometric mean over the response) clipped tightly::

        s(y) = exp(1/|y| sum_t log(pi_theta(y_t) / pi_prox(y_t)))
        L    = -1/|E| sum_e min(s A, clip(s, 1 - 3e-4, 1 + 4e-4) A)

    For merged multi-turn rows pass ``segment_ids=token_completion`` so each completion is
    its own sequence.
    """
    return AlgorithmSpec(
        "gspo",
        "Zheng et al., 2025. Group Sequence Policy Optimization",
        AdvantageSpec(baseline="mean", scale="std"),
        LossSpec(clip_low=3e-4, clip_high=4e-4, ratio_level="sequence"),
    )


def dapo() -> AlgorithmSpec:
    """DAPO: "DAPO: An Open-Source LLM Reinforcement Learning System at Scale" (Yu et al.,
    2025). GRPO advantages; clip-higher, token-level loss, dynamic sampling, overlong
    punishment, no KL::

        L = -1/N_tokens sum_tokens min(r A, clip(r, 1 - 0.2, 1 + 0.28) A)
        groups with std_g R = 0 are dropped and resampled
        R_len(y) = 0 | ((L_max - L_cache) - |y|) / L_cache | -1   (``overlong_penalty``)
    """
    return AlgorithmSpec(
        "dapo",
        "Yu et al., 2025. DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
        AdvantageSpec(baseline="mean", scale="std"),
        LossSpec(clip_low=0.2, clip_high=0.28, weighting="token"),
        dynamic_sampling=True,
        overlong=OverlongSpec(),
    )


def ppo() -> AlgorithmSpec:
    """PPO: "Proximal Policy Optimization Algorithms" (Schulman et al., 2017) with GAE from
    "High-Dimensional Continuous Control Using Generalized Advantage Estimation" (2016).
    V is a separate critic (``areal_agents.trainer.critic``), t runs over the sampled tokens of
    a sample::

        delta_t = r_t + gamma_t V(t+1) - V(t),     A_t = delta_t + gamma_t lam A_{t+1}
        r_t     = the reward of completion c at its last token (+ the final reward at a leaf)
        gamma_t = gamma after the last token of a completion, 1 inside one;  lam = 0.95
        A      <- (A - mean_B A) / std_B A                   whitened over the batch's tokens
        L_pi    = -1/|E| sum_e 1/|y_e| sum_t min(r A, clip(r) A)
        L_V     = 1/|E| sum_e 1/|y_e| sum_t 0.5 max((V - R)^2, (V_old + clip(V - V_old, 0.2) - R)^2)
        R_t     = A_t + V_old(t)                              (before whitening)

    With lam = 1, R_t is the discounted return G(c) of the data contract at every token of c.
    """
    return AlgorithmSpec(
        "ppo",
        "Schulman et al., 2017. Proximal Policy Optimization Algorithms",
        AdvantageSpec(estimator="gae"),
        LossSpec(),
        critic=CriticConfig(),
    )


def reinforce_pp() -> AlgorithmSpec:
    """REINFORCE++: "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
    Models" (Hu, 2025). No critic, no group: returns normalized over the whole batch::

        A(c) = (G(c) - mean_B R) / (std_B R + eps)
        L    = -1/N_tokens sum_tokens min(r A, clip(r) A)

    The paper folds a token-level k1 KL into the reward; here KL lives in the loss (k2,
    whose gradient is the reverse-KL gradient), off unless kl_coef > 0.
    """
    return AlgorithmSpec(
        "reinforce_pp",
        "Hu, 2025. REINFORCE++: A Simple and Efficient Approach for Aligning LLMs",
        AdvantageSpec(baseline="batch", scale="batch_std"),
        LossSpec(weighting="token", kl_estimator="k2"),
    )


def reinforce_pp_baseline() -> AlgorithmSpec:
    """REINFORCE++-baseline (Hu, 2025, same paper): subtract the group mean, then normalize
    by the batch std of the centered returns::

        A(c) = (G(c) - mean_g R) / (std_B (R - mean_g R) + eps)
        L    = -1/N_tokens sum_tokens min(r A, clip(r) A)
    """
    return AlgorithmSpec(
        "reinforce_pp_baseline",
        "Hu, 2025. REINFORCE++: A Simple and Efficient Approach for Aligning LLMs",
        AdvantageSpec(baseline="mean", scale="batch_centered_std"),
        LossSpec(weighting="token", kl_estimator="k2"),
    )


def sapo() -> AlgorithmSpec:
    """SAPO: "Soft Adaptive Policy Optimization" (Qwen team, 2025, arXiv:2511.20347). GRPO
    advantages; the hard clip is replaced by a smooth, sign-dependent gate::

        f(r) = sigmoid(tau (r - 1)) * 4 / tau,   tau = 1.0 if A > 0 else 1.05
        L    = -1/|E| sum_e 1/|y_e| sum_t f(r) A

    d f / d log pi = 4 sigma (1 - sigma) r: 1 at r = 1, decaying smoothly as r leaves 1.
    """
    return AlgorithmSpec(
        "sapo",
        "Qwen team, 2025. Soft Adaptive Policy Optimization (arXiv:2511.20347)",
        AdvantageSpec(baseline="mean", scale="std"),
        LossSpec(sapo_tau_pos=1.0, sapo_tau_neg=1.05),
    )


def m2po() -> AlgorithmSpec:
    """M2PO: "Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale Data on
    LLMs?" (Zheng et al., 2025, arXiv:2510.01161). GRPO advantages, no ratio clip; instead the
    tokens with the largest squared log-ratio to the behaviour policy are masked until the
    batch's second moment is small, and the loss is a token mean::

        M2 = mean over kept tokens of (log pi_theta - log pi_behav)^2  <=  tau_M2 = 0.04
        L  = -1/N_tokens sum_tokens M_t r A                            M_t in {0, 1}
    """
    return AlgorithmSpec(
        "m2po",
        "Zheng et al., 2025. Prosperity before Collapse: How Far Can Off-Policy RL Reach",
        AdvantageSpec(baseline="mean", scale="std"),
        LossSpec(clip_low=None, clip_high=None, m2po_tau=0.04, weighting="token"),
    )


_BUILDERS: tuple[Callable[[], AlgorithmSpec], ...] = (
    grpo,
    dr_grpo,
    lite_ppo,
    rloo,
    gspo,
    dapo,
    ppo,
    reinforce_pp,
    reinforce_pp_baseline,
    sapo,
    m2po,
)
ALGORITHMS: dict[str, AlgorithmSpec] = {
    b.__name__: dataclasses.replace(b(), doc=(b.__doc__ or "").strip()) for b in _BUILDERS
}
"""Every algorithm by name."""


def _squash(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower().replace("++", "pp"))


def get_algorithm(name: str) -> AlgorithmSpec:
    """The spec named ``name``; case, dashes, dots and ``++`` are forgiven (``"Dr.GRPO"``,
    ``"REINFORCE++-baseline"``). An unknown name raises ``ConfigError`` with the nearest."""
    if name in ALGORITHMS:
        return ALGORITHMS[name]
    squashed = {_squash(k): k for k in ALGORITHMS}
    if _squash(name) in squashed:
        return ALGORITHMS[squashed[_squash(name)]]
    near = difflib.get_close_matches(name.lower(), list(ALGORITHMS), n=1, cutoff=0.5)
    near = near or [
        squashed[m] for m in difflib.get_close_matches(_squash(name), squashed, n=1, cutoff=0.5)
    ]
    hint = f" Did you mean {near[0]!r}?" if near else ""
    raise ConfigError(
        f"unknown algorithm {name!r}.{hint} Known algorithms: {', '.join(ALGORITHMS)}"
    )


def check_async_correction(eta: int, behaviour_correction: str) -> None:
    """Refuse asynchronous training without an off-policy correction.

    With ``eta = max_head_offpolicyness > 0`` tokens may come from policies up to eta versions
    old; the decoupled objective needs the behaviour weight pi_prox / pi_behav, clipped or
    masked. ``behaviour_correction="none"`` is only allowed synchronously (eta = 0).
    """
    if eta < 0:
        raise ConfigError(f"max_head_offpolicyness: expected >= 0 (0 = synchronous), got {eta}")
    if eta > 0 and behaviour_correction == "none":
        raise ConfigError(
            f"asynchronous training (rollout.max_head_offpolicyness={eta}) needs an off-policy "
            "correction, got loss.behaviour_correction=none; set "
            "loss.behaviour_correction=clip (or mask), or rollout.max_head_offpolicyness=0 "
            "for synchronous training"
        )


# ------------------------------------------------------------------ facts of the registry
ALGORITHM_NAMES: tuple[str, ...] = tuple(ALGORITHMS)
"""The names, in the registry's order (the same as ``AlgorithmName``'s)."""

GROUP_ALGORITHMS = frozenset(n for n, s in ALGORITHMS.items() if s.uses_groups)
"""Algorithms whose advantages are normalized within a group: they need group_size >= 2."""

CRITIC_ALGORITHMS = frozenset(n for n, s in ALGORITHMS.items() if s.needs_critic)
"""Algorithms that train a critic (the ``critic`` section applies to them only)."""

DYNAMIC_SAMPLING_ALGORITHMS = frozenset(n for n, s in ALGORITHMS.items() if s.dynamic_sampling)
"""Algorithms that drop groups whose rewards are all equal (``rollout.probe_size`` applies)."""


# ------------------------------------------------------------------ overrides of a preset
def overrides_of(spec: type, name: str, doc: str, module: str) -> type:
    """A frozen dataclass named ``name`` with every field of dataclass ``spec``, each typed
    ``T | None`` with default None (= the algorithm's own value): the config section that
    holds overrides of a preset, made from the preset's class so that no field is declared
    twice. ``__overrides_of__`` names ``spec`` (where its fields' docstrings are read);
    ``module`` is where the class is bound to ``name`` (so that it pickles)."""
    hints = typing.get_type_hints(spec)
    fields = [
        (f.name, hints[f.name] | None, dataclasses.field(default=None))
        for f in dataclasses.fields(spec)
    ]
    namespace = {"__doc__": doc, "__overrides_of__": spec, "__module__": module}
    return dataclasses.make_dataclass(name, fields, frozen=True, namespace=namespace)


def set_values(overrides: object | None) -> dict[str, Any]:
    """The fields of an overrides section (:func:`overrides_of`) that are set (not None)."""
    if overrides is None:
        return {}
    values = {f.name: getattr(overrides, f.name) for f in dataclasses.fields(overrides)}  # type: ignore[arg-type]
    return {k: v for k, v in values.items() if v is not None}


def resolve(
    name: str,
    loss: object | None = None,
    advantage: object | None = None,
    critic: CriticConfig | None = None,
) -> AlgorithmSpec:
    """The algorithm ``name`` as a run uses it: every ``loss.*`` and ``advantage.*`` key the
    config sets (not null) replaces the preset's value, and an algorithm with a critic takes
    the ``critic`` section (``CriticConfig()`` when None). The one place where a run's
    algorithm is put together; the trainer receives the result whole.

    Raises:
        ConfigError: an unknown name, or every problem of the resolved settings at once.
    """
    spec = get_algorithm(name)
    problems: list[str] = []
    changes: dict[str, Any] = {}
    for key, section in (("loss", loss), ("advantage", advantage)):
        try:
            changes[key] = dataclasses.replace(getattr(spec, key), **set_values(section))
        except ConfigError as exc:
            problems.extend(exc.problems or [str(exc)])
    if problems:
        raise ConfigError(f"invalid settings of algorithm {spec.name!r}:", problems)
    adv: AdvantageSpec = changes["advantage"]
    if adv.needs_critic:
        changes["critic"] = critic if critic is not None else (spec.critic or CriticConfig())
    else:
        changes["critic"] = None
    if adv.needs_critic != spec.needs_critic:
        raise ConfigError(
            f"advantage.estimator: {adv.estimator!r} does not go with algorithm {spec.name!r}",
        )
    return dataclasses.replace(spec, **changes)
