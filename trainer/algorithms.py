"""The RL algorithms, each a named configuration of one advantage estimator and one loss.

Choices made:

* An algorithm is data, not a class: an :class:`AlgorithmSpec` holds an
  :class:`AdvantageSpec` (how returns become advantages), a :class:`LossSpec` (how the one
  decoupled PPO loss of :mod:`areal_agents.trainer.loss` is set) and a few flags (critic, dynamic
  sampling, overlong penalty). ``ALGORITHMS`` maps names to specs; ``get_algorithm`` looks
  one up and suggests the nearest name on a typo.
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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from torch import Tensor

from areal_agents.errors import ConfigError
from areal_agents.trainer.advantage import (
    Baseline,
    Ids,
    Scale,
    StepGroups,
    StepScale,
    gae,
    group_advantages,
    overlong_penalty,
    step_group_advantages,
)
from areal_agents.trainer.config import CRITIC_ESTIMATORS
from areal_agents.trainer.loss import LossSpec, _choice, _raise

Estimator = Literal["group", "step_group", "gae", "turn_gae"]


@dataclass(frozen=True)
class AdvantageSpec:
    """How returns become advantages (see ``group_advantages`` and ``gae``)."""

    estimator: Estimator = "group"
    """group: baselines over a group's episodes; step_group: that plus GiGPO's step-level
    groups (``step_group_advantages``); gae: token-level GAE with a critic; turn_gae: GAE
    with one value per turn (``turn_gae``)."""
    baseline: Baseline = "mean"
    """Group estimator's baseline: group mean, leave-one-out, batch mean, or none."""
    scale: Scale = "std"
    """Group estimator's divisor: group std, batch std, batch std of centered returns, none."""
    eps: float = 1e-6
    """Added to the std before dividing."""
    gamma: float = 1.0
    """Discount: along the completion tree (group) or per token (gae)."""
    lam: float = 1.0
    """GAE's lambda."""
    whiten: bool = False
    """GAE estimators: whiten the advantages over the batch's sampled tokens (``whiten``)."""
    omega: float = 1.0
    """step_group: the weight of the step-level advantage, A = A_E + omega * A_S."""
    step_scale: StepScale = "std"
    """step_group: divide by the step group's std (GiGPO), or not (none)."""

    @property
    def needs_critic(self) -> bool:
        """Whether the advantages come from a critic (gae, turn_gae)."""
        return self.estimator in CRITIC_ESTIMATORS

    def __post_init__(self) -> None:
        problems = _choice("advantage", "estimator", self.estimator, Estimator)
        problems += _choice("advantage", "baseline", self.baseline, Baseline)
        problems += _choice("advantage", "scale", self.scale, Scale)
        problems += _choice("advantage", "step_scale", self.step_scale, StepScale)
        if not self.omega >= 0:
            problems.append(f"advantage.omega: expected >= 0, got {self.omega}")
        if not 0 <= self.gamma <= 1:
            problems.append(f"advantage.gamma: expected in [0, 1], got {self.gamma}")
        if not 0 <= self.lam <= 1:
            problems.append(f"advantage.lam: expected in [0, 1], got {self.lam}")
        if self.eps < 0:
            problems.append(f"advantage.eps: expected >= 0, got {self.eps}")
        _raise("advantage", problems)

    def group(
        self, returns: Tensor, group_ids: Ids, episode_ids: Ids, roots: Tensor | None = None
    ) -> Tensor:
        """Completion advantages with this spec's baseline and scale (the episode-level
        advantage A_E of ``step_group``)."""
        if self.needs_critic:
            raise ConfigError(
                f"advantage.estimator is {self.estimator!r}: use AdvantageSpec.gae (a critic)"
            )
        return group_advantages(
            returns,
            group_ids,
            episode_ids,
            roots=roots,
            baseline=self.baseline,
            scale=self.scale,
            eps=self.eps,
        )

    def step_group(
        self,
        returns: Tensor,
        group_ids: Ids,
        episode_ids: Ids,
        state_keys: Ids,
        roots: Tensor | None = None,
    ) -> tuple[Tensor, StepGroups]:
        """GiGPO's completion advantages ``A_E + omega * A_S`` (``step_group_advantages``)
        with this spec's baseline, scale, omega and step scale, and the step groups."""
        if self.estimator != "step_group":
            raise ConfigError(
                f"advantage.estimator is {self.estimator!r}; step groups need 'step_group'"
            )
        return step_group_advantages(
            returns,
            group_ids,
            episode_ids,
            state_keys,
            roots=roots,
            baseline=self.baseline,
            scale=self.scale,
            omega=self.omega,
            step_scale=self.step_scale,
            eps=self.eps,
        )

    def gae(
        self,
        rewards: Tensor,
        values: Tensor,
        mask: Tensor,
        bootstrap: Tensor | None = None,
        *,
        discounts: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Token advantages and returns by GAE with this spec's lambda. The discount is
        ``discounts`` per token (the training loop discounts once per turn) or, when None,
        this spec's gamma at every token. Whitening is left to the caller (it spans a batch)."""
        gamma = self.gamma if discounts is None else discounts
        return gae(rewards, values, mask, gamma, self.lam, bootstrap=bootstrap)


@dataclass(frozen=True)
class OverlongSpec:
    """DAPO's soft overlong punishment, added to each completion's per-turn reward."""

    cache_len: int | None = None
    """Length of the soft-penalty zone before max_len; None = 20% of max_len (DAPO's
    4096 of 20480)."""

    def penalty(self, lengths: Tensor, max_len: int) -> Tensor:
        """``overlong_penalty`` with ``max_len`` = the generation budget (max_new_tokens)."""
        cache = self.cache_len if self.cache_len is not None else max(1, round(0.2 * max_len))
        return overlong_penalty(lengths, max_len, min(cache, max_len))


@dataclass(frozen=True)
class AlgorithmSpec:
    """One algorithm: an advantage estimator, a loss setting, and what the loop must do."""

    name: str
    reference: str
    """The paper that defines it."""
    advantage: AdvantageSpec = field(default_factory=AdvantageSpec)
    loss: LossSpec = field(default_factory=LossSpec)
    needs_critic: bool = False
    """The loop trains a value model and uses GAE."""
    dynamic_sampling: bool = False
    """Drop groups whose episodes all got the same reward and sample more (DAPO)."""
    overlong: OverlongSpec | None = None
    """Penalize completions that run into the length budget (DAPO); None = off."""
    doc: str = ""
    """The formula, from the builder's docstring."""

    def __post_init__(self) -> None:
        if self.needs_critic != self.advantage.needs_critic:
            raise ConfigError(
                f"algorithm {self.name!r}: needs_critic={self.needs_critic} but "
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
        AdvantageSpec(estimator="gae", gamma=1.0, lam=0.95, whiten=True),
        LossSpec(value_clip=0.2),
        needs_critic=True,
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
