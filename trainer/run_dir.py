"""The directory a training run writes to: ``train.output_dir``, refused when it holds a run
and this is no resume, or with ``train.if_exists=new`` the next free ``DIR-2``, ``DIR-3``, ...
(:func:`areal_agents.run_state.claim_run_dir`). No torch: ``areal-agent train --dry-run``
shows the directory a run would take.
"""

from __future__ import annotations

import dataclasses

from areal_agents.run_state import claim_run_dir
from areal_agents.trainer.config import TrainConfig

__all__ = ["claim_output_dir"]


def claim_output_dir(cfg: TrainConfig, resume: bool) -> TrainConfig:
    """``cfg`` with the directory it may write to (``run_state.claim_run_dir``): its own, or
    with ``train.if_exists=new`` the next free one; a ConfigError when it holds a run and
    this is no resume."""
    t = cfg.train
    out = claim_run_dir(t.output_dir, resume=resume or t.resume, if_exists=t.if_exists)
    if str(out) == t.output_dir:
        return cfg
    return dataclasses.replace(cfg, train=dataclasses.replace(t, output_dir=str(out)))
