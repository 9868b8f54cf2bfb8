"""Building a run's trained models from its config: the policy and, for a critic algorithm,
the critic.

:func:`model_kwargs` turns the config into their settings (model, dtype, device, LoRA,
optimizer, learning-rate schedule: :func:`lr_schedule`); :func:`build_models` builds them in
this process (``areal_agents.trainer.policy.Policy``, ``areal_agents.trainer.critic.Critic``)
or, with trainer ranks, on every rank, behind rank 0's handles
(``areal_agents.trainer.distributed.DistributedPolicy`` / ``DistributedCritic``). Either
way the loop gets a :class:`~areal_agents.trainer.protocols.Policy` and a
:class:`~areal_agents.trainer.protocols.Critic` (None without one).
"""

from __future__ import annotations

from typing import Any

from areal_agents.engines.embedded import FairLock
from areal_agents.hardware import default_device, resolve_dtype
from areal_agents.model import resolve_model
from areal_agents.trainer import protocols
from areal_agents.trainer.algorithms import AlgorithmSpec
from areal_agents.trainer.config import TrainConfig
from areal_agents.trainer.critic import Critic
from areal_agents.trainer.distributed import DistributedCritic, DistributedPolicy, Ranks, RayRanks
from areal_agents.trainer.policy import Policy
from areal_agents.trainer.schedule import LrSchedule


def build_models(
    cfg: TrainConfig,
    spec: AlgorithmSpec,
    model_path: str,
    ranks: Ranks | RayRanks | None,
    lock: FairLock | None,
    *,
    quiet: bool = False,
) -> tuple[protocols.Policy, protocols.Critic | None]:
    """The policy and the critic (None without one) of ``cfg``: in this process, sharing the
    engine's compute ``lock``, or on every trainer rank of ``ranks``."""
    policy_kw, critic_kw = model_kwargs(cfg, spec, model_path, quiet=quiet)
    critic: protocols.Critic | None = None
    if ranks is None:
        if critic_kw is not None:
            critic = Critic(**critic_kw, compute_lock=lock)
        return Policy(**policy_kw, compute_lock=lock), critic
    offload = {"cpu_offload": cfg.train.cpu_offload}
    policy = ranks.build("policy", "policy", {**policy_kw, **offload}, lock)
    if critic_kw is not None:
        local = ranks.build("critic", "critic", {**critic_kw, **offload}, lock)
        critic = DistributedCritic(ranks, local)
    return DistributedPolicy(ranks, policy), critic


def model_kwargs(
    cfg: TrainConfig, spec: AlgorithmSpec, model_path: str, *, quiet: bool = False
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The keyword arguments of the run's ``Policy`` and ``Critic`` (None without a critic):
    the model, dtype, device, LoRA, optimizer and schedule settings of ``cfg``."""
    device = default_device(cfg.model.device)
    # auto: bfloat16 only where it is native and the weights it holds are frozen (LoRA)
    dtype = resolve_dtype(cfg.model.dtype, device, low_precision_ok=cfg.model.lora.enabled)
    lora = None
    if cfg.model.lora.enabled:
        lora = {
            "r": cfg.model.lora.r,
            "lora_alpha": cfg.model.lora.alpha,
            "lora_dropout": cfg.model.lora.dropout,
            "target_modules": list(cfg.model.lora.target_modules),
        }
    shared: dict[str, Any] = {  # the same for the policy and a critic
        "dtype": dtype,
        "device": cfg.model.device,
        "lora": lora,
        "activation_checkpointing": cfg.model.activation_checkpointing,
        "weight_decay": cfg.optim.weight_decay,
        "betas": tuple(cfg.optim.betas),
        "grad_clip": cfg.optim.grad_clip or float("inf"),
        "schedule": lr_schedule(cfg),
    }
    policy_kw = {
        "model_path": model_path,
        "lr": cfg.optim.lr,
        "reference": spec.loss.kl_coef > 0,
        "share_prefixes": cfg.train.share_prefixes,
        **shared,
    }
    if not spec.needs_critic:
        return policy_kw, None
    path = cfg.critic.path
    critic_path = model_path if path is None else resolve_model(path, quiet=quiet)
    return policy_kw, {"model_path": critic_path, "lr": cfg.critic.lr, **shared}


def lr_schedule(cfg: TrainConfig) -> LrSchedule:
    """``optim.schedule`` with its warmup over ``optim.total_steps`` (None = ``train.steps``)."""
    o = cfg.optim
    return LrSchedule(o.schedule, o.warmup_steps, o.total_steps or cfg.train.steps)
