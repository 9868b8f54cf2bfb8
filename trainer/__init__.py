"""RL training: advantages, the one policy loss, and the algorithms that configure it.

``areal_agents.trainer.advantage`` turns returns into advantages (group baselines over
episodes, GiGPO's step-level groups, GAE per token or per turn, loss weights, DAPO's
helpers), ``areal_agents.trainer.loss`` holds the decoupled PPO objective, the value loss
and logprob helpers, ``areal_agents.trainer.critic`` PPO's value model,
``areal_agents.trainer.algorithms`` names the family (GRPO, Dr.GRPO, LitePPO, RLOO, GSPO,
DAPO, PPO, REINFORCE++, SAPO, M2PO) as configurations of them::

    from areal_agents.trainer import (
        completion_returns, get_algorithm, group_advantages_of, policy_loss,
    )

    spec = get_algorithm("grpo")
    rows = completion_returns(episodes, gamma=1.0)
    adv = group_advantages_of(
        spec.advantage, rows.returns, rows.group_ids, rows.episode_ids, rows.roots
    )
    loss, stats = policy_loss(logp, behav_logp, prox_logp, token_adv, mask, spec.loss)

The names below load lazily, so ``import areal_agents.trainer.config`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from areal_agents.trainer.advantage import (
        CompletionReturns,
        StepGroups,
        completion_returns,
        completion_state_keys,
        completion_weights,
        expand_to_tokens,
        filter_uniform_groups,
        gae,
        group_advantages,
        group_advantages_of,
        overlong_penalty,
        step_group_advantages,
        step_group_advantages_of,
        step_groups,
        tree_gae,
        turn_gae,
        whiten,
    )
    from areal_agents.trainer.algorithms import (
        ALGORITHMS,
        AdvantageSpec,
        AlgorithmSpec,
        LossSpec,
        OverlongSpec,
        check_async_correction,
        get_algorithm,
        resolve,
    )
    from areal_agents.trainer.critic import Critic, gae_inputs
    from areal_agents.trainer.loss import (
        aggregate,
        approx_proximal_logp,
        entropy_from_logits,
        explained_variance,
        logprobs_from_logits,
        loss_weights,
        m2po_mask,
        policy_loss,
        value_loss,
    )

__all__ = [
    "ALGORITHMS",
    "AdvantageSpec",
    "AlgorithmSpec",
    "CompletionReturns",
    "Critic",
    "LossSpec",
    "OverlongSpec",
    "StepGroups",
    "aggregate",
    "approx_proximal_logp",
    "check_async_correction",
    "completion_returns",
    "completion_state_keys",
    "completion_weights",
    "entropy_from_logits",
    "expand_to_tokens",
    "explained_variance",
    "filter_uniform_groups",
    "gae",
    "gae_inputs",
    "get_algorithm",
    "group_advantages",
    "group_advantages_of",
    "logprobs_from_logits",
    "loss_weights",
    "m2po_mask",
    "overlong_penalty",
    "policy_loss",
    "resolve",
    "step_group_advantages",
    "step_group_advantages_of",
    "step_groups",
    "tree_gae",
    "turn_gae",
    "value_loss",
    "whiten",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        for module in ("advantage", "loss", "algorithms", "critic"):
            mod = importlib.import_module(f".{module}", __name__)
            if hasattr(mod, name):
                return getattr(mod, name)
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
