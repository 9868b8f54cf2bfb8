"""Advantages for multi-turn agents: group baselines over episodes, GAE, loss weights, DAPO.

Choices made:

* A group is found by an explicit group id and an episode id on every row, never by row
  position: rows may come in any order and episodes may have any number of completions.
* Group statistics are taken over the group's *episodes*, one number each: the episode
  return R(e), the mean return of its root completions (for a line of turns, the first one).
  Every completion c of episode e then gets ``A(c) = (G(c) - b(e)) / (s(e) + eps)``. With
  gamma = 1 and only a final reward every G(c) = R(e), so this is plain GRPO exactly.
* Standard deviations are Bessel-corrected (n - 1); a group of one episode has std 0.
* A group (or batch) whose episode returns are all equal gives zero advantages under std
  scaling: it carries no relative signal, and dividing within-episode spread (later turns
  of a discounted or per-turn-rewarded episode) by eps alone would explode.
* Statistics are computed in float64; the result has the dtype of ``returns``.
* Loss weights (``completion_weights``) are the aggregation itself: per-token weights
  computed over the whole step's batch so that micro-batch losses ``sum(w * loss)`` add up
  to the step's loss. By default each episode weighs the same, however many turns it has.
* GAE runs over the policy's tokens only: masked tokens (tool results, user turns inside a
  merged sample) are skipped, so the value after a token is the value at the next sampled
  token. The end of a row is terminal unless a bootstrap is given (a continuation or a
  truncation). The discount may differ per token: PPO discounts by gamma once per turn
  (between completions) and not between the tokens of one completion (``tree_gae``).
* ``tree_gae`` carries GAE across training samples along the completion tree: a sample whose
  last completion has children in other samples continues into them (the mean of the
  children, as in the discounted return), so with lambda = 1 every token of completion c
  gets the return G(c) exactly.
* ``whiten`` (mean 0, std 1 over a batch's sampled tokens) is optional for GAE advantages.
* Step-level groups (``step_group_advantages``, GiGPO-style): the turns of a group's episodes
  that start from the same current state are compared with each other, on top of the
  episode-level advantage. The state of a turn is the env's ``info["state_key"]`` where the
  episode recorded one for it (``Episode.metadata["state_keys"]``), else a hash of the
  prompt's last observation: the tool or user messages after its last assistant message,
  by role and text (tool call ids left out: clients make them up). Hashing the whole history
  would make every later turn unique and leave only the first turns grouped.
* ``turn_gae``: GAE with one value per turn boundary (the critic's value of a completion's
  prompt) instead of one per token; gamma and lambda apply once per turn.

Left out: KL folded into the reward (REINFORCE++'s original form; KL lives in the loss),
similarity-based (not exact) anchor states.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, get_args

import torch
from torch import Tensor

from areal_agents.errors import ConfigError
from areal_agents.trainer.algorithms import (
    AdvantageSpec,
    Baseline,
    Reduce,
    Scale,
    StepScale,
    Weighting,
)
from areal_agents.trajectory import SUMMARY_CALL

if TYPE_CHECKING:
    from areal_agents.trajectory import Episode

Ids = Sequence[Hashable] | Tensor


def _check_choice(name: str, value: str, kind: object) -> None:
    choices = get_args(kind)
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}")


def _codes(ids: Ids, n: int, name: str, device: torch.device | None = None) -> tuple[Tensor, int]:
    """Dense integer codes (first-seen order) for ``n`` hashable ids, and how many there are."""
    keys = ids.reshape(-1).tolist() if isinstance(ids, Tensor) else list(ids)
    if len(keys) != n:
        raise ValueError(f"{name}: expected {n} ids (one per row), got {len(keys)}")
    index: dict[Hashable, int] = {}
    codes = [index.setdefault(k, len(index)) for k in keys]
    return torch.tensor(codes, dtype=torch.long, device=device), len(index)


def _segment_mean(x: Tensor, seg: Tensor, n: int) -> Tensor:
    """Mean of ``x`` per segment, exact when a segment's values are all equal.

    Shifting by the segment minimum first makes ``mean([v, v, v]) == v`` bit for bit, which
    the zero-spread rule relies on.
    """
    lo = x.new_full((n,), float("inf")).scatter_reduce(0, seg, x, "amin")
    cnt = x.new_zeros(n).index_add_(0, seg, torch.ones_like(x))
    tot = x.new_zeros(n).index_add_(0, seg, x - lo[seg])
    return lo + tot / cnt


def _segment_std(x: Tensor, seg: Tensor, n: int) -> Tensor:
    """Bessel-corrected std of ``x`` per segment (0 for a segment of one value)."""
    mean = _segment_mean(x, seg, n)
    cnt = x.new_zeros(n).index_add_(0, seg, torch.ones_like(x))
    sq = x.new_zeros(n).index_add_(0, seg, (x - mean[seg]) ** 2)
    return torch.sqrt(sq / (cnt - 1).clamp(min=1))


def _episode_table(
    returns: Tensor, group_ids: Ids, episode_ids: Ids, roots: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Episode code of each row, group code of each episode, and the checked root mask."""
    n, dev = returns.numel(), returns.device
    g_row, _ = _codes(group_ids, n, "group_ids", dev)
    e_row, n_eps = _codes(episode_ids, n, "episode_ids", dev)
    ep_group = torch.zeros(n_eps, dtype=torch.long, device=dev).scatter_(0, e_row, g_row)
    if not torch.equal(ep_group[e_row], g_row):
        bad = episode_ids[int(torch.nonzero(ep_group[e_row] != g_row)[0])]
        raise ValueError(f"episode_ids: episode {bad!r} appears in two groups; give it one group")
    if roots is None:
        if n_eps != n:
            raise ValueError("roots: an episode has several rows; pass roots= (root completions)")
        roots = torch.ones(n, dtype=torch.bool, device=dev)
    if roots.shape != returns.shape:
        raise ValueError(f"roots: expected shape {tuple(returns.shape)}, got {tuple(roots.shape)}")
    roots = roots.to(dev).bool()
    if torch.unique(e_row[roots]).numel() != n_eps:
        raise ValueError("roots: every episode needs at least one root row")
    return e_row, ep_group, roots


def _leave_one_out_mean(x: Tensor, seg: Tensor, n: int) -> Tensor:
    """Mean of the other members of each value's segment (the value itself when alone).

    Shifted by the segment minimum, so a segment of equal values gives exactly that value.
    """
    lo = x.new_full((n,), float("inf")).scatter_reduce(0, seg, x, "amin")[seg]
    cnt = x.new_zeros(n).index_add_(0, seg, torch.ones_like(x))[seg]
    tot = x.new_zeros(n).index_add_(0, seg, x - lo)[seg]
    return torch.where(cnt > 1, lo + (tot - (x - lo)) / (cnt - 1).clamp(min=1), x)


def group_advantages(
    returns: Tensor,
    group_ids: Ids,
    episode_ids: Ids,
    *,
    roots: Tensor | None = None,
    baseline: Baseline = "mean",
    scale: Scale = "std",
    eps: float = 1e-6,
) -> Tensor:
    """Advantage of every completion, normalized over its group's episodes.

    Rows are completions: ``returns[i]`` is the discounted return G(c) of row i (see
    ``Episode.returns``), ``group_ids[i]`` and ``episode_ids[i]`` name its group and episode,
    ``roots[i]`` says whether it is a root completion of its episode (may be omitted when
    every episode has exactly one row). With E(g) the episodes of group g and B the batch::

        R(e)  = mean(G(c) for root rows c of e)                     episode return
        A(c)  = (G(c) - b(e)) / (s(e) + eps)                        c in episode e of group g

        baseline  mean   b(e) = mean(R(e') for e' in E(g))          GRPO
                  rloo   b(e) = mean(R(e') for e' in E(g), e' != e) RLOO (own R(e) if alone)
                  batch  b(e) = mean(R(e') for e' in B)             REINFORCE++
                  none   b(e) = 0
        scale     std                 s(e) = std(R(e') for e' in E(g))
                  batch_std           s(e) = std(R(e') for e' in B)             LitePPO
                  batch_centered_std  s(e) = std(R(e') - b(e') for e' in B)     REINFORCE++-b
                  none                A(c) = G(c) - b(e)  (no division: Dr.GRPO, RLOO)

    Under a std scale, rows whose s(e) is exactly 0 (all episodes of the group, or batch,
    have the same return) get advantage 0.

    >>> group_advantages(torch.tensor([1.0, 0.0, 0.0]), ["g"] * 3, [0, 1, 2], eps=0.0)
    tensor([ 1.1547, -0.5774, -0.5774])
    """
    _check_choice("baseline", baseline, Baseline)
    _check_choice("scale", scale, Scale)
    if returns.dim() != 1:
        raise ValueError(f"returns: expected a 1-D tensor (one per row), got {returns.dim()}-D")
    e_row, ep_group, roots = _episode_table(returns, group_ids, episode_ids, roots)
    n_eps, n_groups = ep_group.numel(), int(ep_group.max()) + 1 if ep_group.numel() else 0
    g = returns.detach().to(torch.float64)
    big_r = _segment_mean(g[roots], e_row[roots], n_eps)  # R(e)
    all_eps = torch.zeros(n_eps, dtype=torch.long, device=g.device)

    if baseline == "mean":
        b = _segment_mean(big_r, ep_group, n_groups)[ep_group]
    elif baseline == "rloo":
        b = _leave_one_out_mean(big_r, ep_group, n_groups)
    elif baseline == "batch":
        b = _segment_mean(big_r, all_eps, 1)[all_eps]
    else:
        b = torch.zeros_like(big_r)

    adv = g - b[e_row]
    if scale == "none":
        return adv.to(returns.dtype)
    if scale == "std":
        s = _segment_std(big_r, ep_group, n_groups)[ep_group]
    elif scale == "batch_std":
        s = _segment_std(big_r, all_eps, 1)[all_eps]
    else:
        s = _segment_std(big_r - b, all_eps, 1)[all_eps]
    s_row = s[e_row]
    adv = torch.where(s_row > 0, adv / (s_row + eps), torch.zeros_like(adv))
    return adv.to(returns.dtype)


@dataclass(frozen=True)
class CompletionReturns:
    """One row per completion of a batch of episodes: the inputs of ``group_advantages``."""

    returns: Tensor
    """G(c), float64 (as exact as ``Episode.returns``), one per row."""
    group_ids: list[str]
    episode_ids: list[str]
    completion_ids: list[str]
    roots: Tensor
    """True where the completion has no parent."""


def completion_returns(episodes: Sequence[Episode], gamma: float = 1.0) -> CompletionReturns:
    """Flatten episodes into completion rows with their discounted returns (``Episode.returns``)."""
    rets: list[float] = []
    groups: list[str] = []
    eps: list[str] = []
    cids: list[str] = []
    roots: list[bool] = []
    for ep in episodes:
        if ep.group_id is None:
            raise ValueError(f"episode {ep.session_id!r} has no group_id; set it when sampling")
        by_id = ep.returns(gamma)
        for c in ep.completions:
            rets.append(by_id[c.id])
            groups.append(ep.group_id)
            eps.append(ep.session_id)
            cids.append(c.id)
            # a summary call of the proxy's context policy has no parent, but it does not
            # start the episode: its return is no part of the episode's return
            roots.append(c.parent_id is None and c.context_rewrite != SUMMARY_CALL)
    return CompletionReturns(
        torch.tensor(rets, dtype=torch.float64), groups, eps, cids, torch.tensor(roots)
    )


STATE_KEYS = "state_keys"
"""``Episode.metadata[STATE_KEYS]``: ``{completion id: the env's info["state_key"] of the state
the completion's prompt shows}``, recorded by the env-driven runner where the env gives one."""


def completion_state_keys(episodes: Sequence[Episode]) -> list[str]:
    """The anchor state of every completion row (in ``completion_returns``' order).

    ``"env:<key>"`` with the env's ``info["state_key"]`` recorded for the completion
    (``Episode.metadata["state_keys"]``), else ``"obs:<sha1>"`` of the prompt's last
    observation: the trailing tool and user messages of ``Completion.messages`` (after the
    last assistant or system message), each as its role and text, so a tool result with
    another call id is the same state. A prompt that ends with no tool or user message is
    a state of its own (``"none:<completion id>"``).
    """
    out: list[str] = []
    for ep in episodes:
        recorded = ep.metadata.get(STATE_KEYS) or {}
        for c in ep.completions:
            key = recorded.get(c.id) if isinstance(recorded, dict) else None
            out.append(f"env:{key}" if key is not None else _observation_key(c.id, c.messages))
    return out


def _observation_key(completion_id: str, messages: Sequence[dict[str, object]]) -> str:
    tail: list[tuple[object, str]] = []
    for m in reversed(messages):
        if m.get("role") not in ("tool", "user"):
            break
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        tail.append((m.get("role"), str(content or "").strip()))
    if not tail:
        return f"none:{completion_id}"
    text = json.dumps(tail[::-1], ensure_ascii=False, separators=(",", ":"))
    return "obs:" + hashlib.sha1(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class StepGroups:
    """The step-level part of ``step_group_advantages``, one value per row."""

    advantages: Tensor
    """A_S(c), float64."""
    sizes: Tensor
    """|S(c)|: how many rows share the step group of row c."""

    @property
    def share(self) -> float:
        """The share of rows in step groups of more than one turn (0 for no rows)."""
        n = self.sizes.numel()
        return float((self.sizes > 1).sum()) / n if n else 0.0


def step_groups(
    returns: Tensor,
    group_ids: Ids,
    state_keys: Ids,
    *,
    scale: StepScale = "std",
    eps: float = 1e-6,
) -> StepGroups:
    """Step-level advantages of GiGPO ("Group-in-Group Policy Optimization for LLM Agent
    Training", Feng et al., 2025). Rows are completions (turns) as in ``group_advantages``;
    ``state_keys[i]`` names the state row i's prompt starts from (``completion_state_keys``).
    With g(c) the group of c and s(c) its state::

        S(c)   = {c' : g(c') = g(c) and s(c') = s(c)}               step group
        A_S(c) = (G(c) - mean(G(c') for c' in S(c))) / (std(G(c') for c' in S(c)) + eps)
                                                                    scale std
               =  G(c) - mean(G(c') for c' in S(c))                 scale none

    with the Bessel-corrected std. A step group of one turn gives 0; under ``std`` so does a
    step group whose returns are all equal. Turns of one episode that come back to a state
    join its step group too.

    >>> steps = step_groups(torch.tensor([1.0, 0.0, 1.0]), ["g"] * 3, ["a", "a", "b"], eps=0.0)
    >>> steps.advantages, steps.sizes, round(steps.share, 4)
    (tensor([ 0.7071, -0.7071,  0.0000], dtype=torch.float64), tensor([2, 2, 1]), 0.6667)
    """
    _check_choice("step_scale", scale, StepScale)
    if returns.dim() != 1:
        raise ValueError(f"returns: expected a 1-D tensor (one per row), got {returns.dim()}-D")
    n, dev = returns.numel(), returns.device
    g_row, _ = _codes(group_ids, n, "group_ids", dev)
    s_row, _ = _codes(state_keys, n, "state_keys", dev)
    step, n_steps = _codes(list(zip(g_row.tolist(), s_row.tolist(), strict=True)), n, "rows", dev)
    g = returns.detach().to(torch.float64)
    sizes = torch.bincount(step, minlength=n_steps)[step]
    adv = g - _segment_mean(g, step, n_steps)[step]
    if scale == "std":
        s = _segment_std(g, step, n_steps)[step]
        adv = torch.where(s > 0, adv / (s + eps), torch.zeros_like(adv))
    return StepGroups(torch.where(sizes > 1, adv, torch.zeros_like(adv)), sizes)


def step_group_advantages(
    returns: Tensor,
    group_ids: Ids,
    episode_ids: Ids,
    state_keys: Ids,
    *,
    roots: Tensor | None = None,
    baseline: Baseline = "mean",
    scale: Scale = "std",
    omega: float = 1.0,
    step_scale: StepScale = "std",
    eps: float = 1e-6,
) -> tuple[Tensor, StepGroups]:
    """GiGPO's advantage: the episode-level advantage plus omega times the step-level one::

        A(c) = A_E(c) + omega * A_S(c)

    A_E is ``group_advantages`` with ``baseline`` and ``scale`` (GRPO's by default: with
    gamma = 1 and a final reward only, the paper's (R(e) - mean_g R) / std_g R), A_S is
    ``step_groups`` with ``step_scale``. GiGPO uses omega = 1. With omega = 0 this is
    ``group_advantages`` exactly (A_S is finite, and x + 0 = x in floating point). Returns
    A (dtype of ``returns``) and the step groups.
    """
    if omega < 0:
        raise ValueError(f"omega: expected >= 0, got {omega}")
    episode = group_advantages(
        returns, group_ids, episode_ids, roots=roots, baseline=baseline, scale=scale, eps=eps
    )
    steps = step_groups(returns, group_ids, state_keys, scale=step_scale, eps=eps)
    adv = episode.to(torch.float64) + omega * steps.advantages
    return adv.to(returns.dtype), steps


def group_advantages_of(
    spec: AdvantageSpec,
    returns: Tensor,
    group_ids: Ids,
    episode_ids: Ids,
    roots: Tensor | None = None,
) -> Tensor:
    """Completion advantages (``group_advantages``) with ``spec``'s baseline, scale and eps:
    the episode-level advantage A_E of ``step_group`` too.

    Raises:
        ConfigError: ``spec`` takes its advantages from a critic (gae, turn_gae).
    """
    if spec.needs_critic:
        raise ConfigError(
            f"advantage.estimator is {spec.estimator!r}: its advantages come from a critic "
            "(areal_agents.trainer.critic), not from groups"
        )
    return group_advantages(
        returns,
        group_ids,
        episode_ids,
        roots=roots,
        baseline=spec.baseline,
        scale=spec.scale,
        eps=spec.eps,
    )


def step_group_advantages_of(
    spec: AdvantageSpec,
    returns: Tensor,
    group_ids: Ids,
    episode_ids: Ids,
    state_keys: Ids,
    roots: Tensor | None = None,
) -> tuple[Tensor, StepGroups]:
    """GiGPO's completion advantages ``A_E + omega * A_S`` (``step_group_advantages``) with
    ``spec``'s baseline, scale, omega and step scale, and the step groups.

    Raises:
        ConfigError: ``spec.estimator`` is not ``step_group``.
    """
    if spec.estimator != "step_group":
        raise ConfigError(
            f"advantage.estimator is {spec.estimator!r}; step groups need 'step_group'"
        )
    return step_group_advantages(
        returns,
        group_ids,
        episode_ids,
        state_keys,
        roots=roots,
        baseline=spec.baseline,
        scale=spec.scale,
        omega=spec.omega,
        step_scale=spec.step_scale,
        eps=spec.eps,
    )


def expand_to_tokens(values: Tensor, token_completion: Tensor) -> Tensor:
    """Per-token values from per-completion ones: ``out[b, t] = values[b, token_completion[b, t]]``.

    ``values`` is ``[B, K]`` (the completions of each training sample, padded), and
    ``token_completion`` is ``[B, T]`` with -1 on unsampled tokens, which get 0.
    """
    valid = token_completion >= 0
    out = values.gather(1, token_completion.clamp(min=0).long())
    return torch.where(valid, out, torch.zeros_like(out))


def completion_weights(
    token_completion: Tensor,
    episode_ids: Ids,
    *,
    weighting: Weighting = "episode",
    reduce: Reduce = "mean",
    max_tokens: int | None = None,
) -> Tensor:
    """Per-token loss weights over a whole step's batch: the loss is ``sum(w * token_loss)``.

    ``token_completion`` is ``[B, T]`` (index of each sampled token's completion within its
    sample, -1 elsewhere), ``episode_ids`` names the episode of each of the B samples. Units
    u are episodes, completions (a sample row and index), or tokens; U is their number in
    the batch and n(u) the number of sampled tokens of unit u. Token t of unit u weighs::

        reduce  mean      w = 1 / (U * n(u))          every unit sums to 1 / U
                sum       w = 1 / U                   long units weigh more
                sum_norm  w = 1 / (U * max_tokens)    Dr.GRPO's constant normalizer

    So with the default, an episode of five turns weighs exactly as much as one of one turn.
    Because the weights are normalized over the whole batch, the losses of its micro-batches
    add up to the batch's loss. ``weighting="token"`` is the token mean (DAPO's token-level
    loss); ``"completion"`` with ``"mean"`` is GRPO's per-response mean.
    """
    _check_choice("weighting", weighting, Weighting)
    _check_choice("reduce", reduce, Reduce)
    if reduce == "sum_norm" and (max_tokens is None or max_tokens < 1):
        raise ValueError(f"max_tokens: reduce='sum_norm' needs max_tokens >= 1, got {max_tokens}")
    if token_completion.dim() != 2:
        raise ValueError(f"token_completion: expected [B, T], got {tuple(token_completion.shape)}")
    rows, width = token_completion.shape
    valid = token_completion >= 0
    dev = token_completion.device
    e_row, _ = _codes(episode_ids, rows, "episode_ids", dev)
    row_of = torch.arange(rows, device=dev).unsqueeze(1).expand(rows, width)
    if weighting == "token":
        unit = torch.arange(int(valid.sum()), device=dev)
    elif weighting == "completion":
        k = int(token_completion.max().clamp(min=0)) + 1
        unit = torch.unique((row_of * k + token_completion)[valid], return_inverse=True)[1]
    else:
        unit = torch.unique(e_row[row_of][valid], return_inverse=True)[1]
    n_units = int(unit.max()) + 1 if unit.numel() else 0
    size = torch.bincount(unit, minlength=n_units).to(torch.float64)
    if reduce == "mean":
        w_valid = 1.0 / (n_units * size[unit])
    elif reduce == "sum":
        w_valid = torch.full_like(size[unit], 1.0 / max(n_units, 1))
    else:
        w_valid = torch.full_like(size[unit], 1.0 / (max(n_units, 1) * float(max_tokens or 1)))
    out = torch.zeros(rows, width, dtype=torch.float32, device=dev)
    out[valid] = w_valid.float()
    return out


def filter_uniform_groups(rewards: Tensor, group_ids: Ids, *, atol: float = 0.0) -> Tensor:
    """DAPO dynamic sampling: keep-mask dropping the rows of groups whose rewards are all equal.

    ``rewards`` has one value per row (one row per episode, or the episode's reward repeated
    on each of its rows). A group is kept when ``max - min > atol`` over its rows: a group
    where every episode succeeded (or every one failed) has zero GRPO advantage and only
    dilutes the batch.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected a 1-D tensor (one per row), got {rewards.dim()}-D")
    g_row, n_groups = _codes(group_ids, rewards.numel(), "group_ids", rewards.device)
    r = rewards.detach().to(torch.float64)
    hi = r.new_full((n_groups,), float("-inf"))
    lo = r.new_full((n_groups,), float("inf"))
    hi = hi.scatter_reduce(0, g_row, r, "amax")
    lo = lo.scatter_reduce(0, g_row, r, "amin")
    return (hi - lo > atol)[g_row]


def overlong_penalty(lengths: Tensor, max_len: int, cache_len: int) -> Tensor:
    """DAPO's soft overlong punishment, added to the reward of a completion of ``lengths`` tokens::

        R_len(y) = 0                                   |y| <= max_len - cache_len
                 = ((max_len - cache_len) - |y|) / cache_len   max_len - cache_len < |y| <= max_len
                 = -1                                  |y| > max_len

    >>> overlong_penalty(torch.tensor([6, 8, 10, 11]), max_len=10, cache_len=4)
    tensor([ 0.0000, -0.5000, -1.0000, -1.0000])
    """
    if not 0 < cache_len <= max_len:
        raise ValueError(f"cache_len: expected 0 < cache_len <= max_len={max_len}, got {cache_len}")
    n = lengths.to(torch.float32)
    soft = (max_len - cache_len) - n
    out = torch.clamp(soft / cache_len, max=0.0)
    return torch.where(n > max_len, torch.full_like(out, -1.0), out)


def gae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float | Tensor = 1.0,
    lam: float = 1.0,
    *,
    bootstrap: Tensor | None = None,
    bootstrap_adv: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Token-level generalized advantage estimation (Schulman et al., 2016) for PPO critics.

    ``rewards``, ``values`` and ``mask`` are ``[B, T]``; only tokens where ``mask`` is set
    take part. ``gamma`` is a number, or ``[B, T]`` with gamma(t) the discount between token
    t and the next sampled token. For the sampled tokens t_1 < t_2 < ... of a row, with
    V(t_{k+1}) and A(t_{k+1}) the value and advantage at the next sampled token
    (``bootstrap[b]`` and ``bootstrap_adv[b]`` after the last one, 0 when not given, i.e.
    the episode terminated)::

        delta_k = r(t_k) + gamma(t_k) * V(t_{k+1}) - V(t_k)
        A(t_k)  = delta_k + gamma(t_k) * lam * A(t_{k+1})
        returns = A + V

    Returns ``(advantages, returns)``, both 0 where ``mask`` is 0. A truncated row passes the
    value after its last token as ``bootstrap``; a row that continues in another row passes
    that row's first value and advantage. No grad flows into ``values``.

    >>> adv, ret = gae(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.5]]), torch.ones(1, 2))
    >>> adv, ret
    (tensor([[0.5000, 0.5000]]), tensor([[1., 1.]]))
    """
    if not (rewards.shape == values.shape == mask.shape) or rewards.dim() != 2:
        raise ValueError(
            f"rewards, values, mask: expected equal [B, T] shapes, got {tuple(rewards.shape)}, "
            f"{tuple(values.shape)}, {tuple(mask.shape)}"
        )
    if isinstance(gamma, Tensor) and gamma.shape != rewards.shape:
        raise ValueError(
            f"gamma: expected a number or shape {tuple(rewards.shape)}, got {tuple(gamma.shape)}"
        )
    v = values.detach().float()
    r = rewards.float()
    m = mask.bool()
    g = gamma.float() if isinstance(gamma, Tensor) else torch.full_like(r, float(gamma))
    rows, width = r.shape
    next_v = r.new_zeros(rows) if bootstrap is None else bootstrap.detach().to(r).clone()
    next_a = r.new_zeros(rows) if bootstrap_adv is None else bootstrap_adv.detach().to(r).clone()
    adv = r.new_zeros(rows, width)
    for t in range(width - 1, -1, -1):
        delta = r[:, t] + g[:, t] * next_v - v[:, t]
        a = delta + g[:, t] * lam * next_a
        mt = m[:, t]
        adv[:, t] = torch.where(mt, a, torch.zeros_like(a))
        next_a = torch.where(mt, a, next_a)
        next_v = torch.where(mt, v[:, t], next_v)
    return adv, torch.where(m, adv + v, torch.zeros_like(adv))


def tree_gae(
    rewards: Sequence[Tensor],
    values: Sequence[Tensor],
    masks: Sequence[Tensor],
    discounts: Sequence[Tensor],
    children: Sequence[Sequence[int]],
    lam: float,
    *,
    truncated: Sequence[bool] | None = None,
) -> tuple[list[Tensor], list[Tensor]]:
    """GAE over training samples that continue into each other along a completion tree.

    Sample i is 1-D: per token its reward, value, mask and discount (see ``gae``).
    ``children[i]`` lists the samples that continue sample i after its last token (the
    children of its last completion that start samples of their own; every index > i).
    After the last sampled token of sample i comes, with F(j) the first sampled token of j::

        children        V_next = mean_j V(F(j)),  A_next = mean_j A(F(j))
        truncated[i]    V_next = V(last sampled token of i),  A_next = 0
        otherwise       V_next = A_next = 0                                 (terminated)

    so the lambda-return ``A + V`` follows the mean over children of ``Episode.returns``:
    with lam = 1 it equals the discounted return G(c) at every token of completion c. A
    truncated episode's next state was never observed; the value before its last token
    stands in for it. A sample without sampled tokens passes its own (V_next, A_next) on.
    Samples are computed leaves first, one padded ``gae`` call per tree height.
    """
    n = len(rewards)
    if not n == len(values) == len(masks) == len(discounts) == len(children):
        raise ValueError("rewards, values, masks, discounts, children: expected equal lengths")
    cut = list(truncated) if truncated is not None else [False] * n
    height = [0] * n
    for i in range(n - 1, -1, -1):
        if any(not i < j < n for j in children[i]):
            raise ValueError(f"children[{i}]: expected indices in ({i}, {n}), got {children[i]}")
        height[i] = 1 + max((height[j] for j in children[i]), default=-1)
    adv: list[Tensor] = [torch.zeros(0)] * n
    ret: list[Tensor] = [torch.zeros(0)] * n
    first: list[tuple[float, float]] = [(0.0, 0.0)] * n  # (V, A) at F(i)
    for level in range(max(height, default=-1) + 1):
        rows = [i for i in range(n) if height[i] == level]
        m = _pad_rows([masks[i].bool() for i in rows])
        v = _pad_rows([values[i].detach().float() for i in rows])
        boot_v, boot_a = [], []
        for i in rows:
            if children[i]:
                kids = [first[j] for j in children[i]]
                boot_v.append(sum(k[0] for k in kids) / len(kids))
                boot_a.append(sum(k[1] for k in kids) / len(kids))
            elif cut[i] and masks[i].bool().any():
                boot_v.append(float(values[i][masks[i].bool()][-1]))
                boot_a.append(0.0)
            else:
                boot_v.append(0.0)
                boot_a.append(0.0)
        a, r = gae(
            _pad_rows([rewards[i].float() for i in rows]),
            v,
            m,
            _pad_rows([discounts[i].float() for i in rows]),
            lam,
            bootstrap=torch.tensor(boot_v),
            bootstrap_adv=torch.tensor(boot_a),
        )
        for row, i in enumerate(rows):
            width = masks[i].numel()
            adv[i], ret[i] = a[row, :width], r[row, :width]
            hit = torch.nonzero(m[row]).flatten()
            if hit.numel():
                first[i] = (float(v[row, hit[0]]), float(a[row, hit[0]]))
            else:
                first[i] = (boot_v[row], boot_a[row])
    return adv, ret


def turn_gae(
    rewards: Sequence[Tensor],
    values: Sequence[Tensor],
    masks: Sequence[Tensor],
    discounts: Sequence[Tensor],
    segments: Sequence[Tensor],
    children: Sequence[Sequence[int]],
    lam: float,
    *,
    truncated: Sequence[bool] | None = None,
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Turn-level GAE: one value per turn boundary, gamma and lambda once per turn.

    The inputs are those of ``tree_gae`` plus ``segments[i]``, the index of each token's
    completion within sample i (-1: not sampled). For completion (turn) c, with F(c) and
    L(c) its first and last sampled tokens, the critic's value V(c) = values[F(c)] is the
    value of its prompt (the state its first token is sampled in), r(c) the rewards on its
    tokens and gamma(c) = discounts[L(c)]. Along the completion tree, with next(c) the
    turns that continue c (the next turn of its sample, else the first turns of the child
    samples, averaged)::

        delta(c) = r(c) + gamma(c) * mean(V(c') for c' in next(c)) - V(c)
        A(c)     = delta(c) + gamma(c) * lam * mean(A(c') for c' in next(c))
        R(c)     = A(c) + V(c)                     the critic's target at F(c)

    A leaf of a terminated episode has no next turns (0); one of a truncated episode
    bootstraps from its own V(c), the last value seen. Every token of c gets A(c), so a
    one-turn episode with reward r gets r - V(prompt) on every token, and with lam = 1,
    R(c) is the discounted return G(c) of ``Episode.returns``. This is ``tree_gae`` run
    over turns instead of tokens.

    Returns, per sample: the advantage of every token, the return R(c) of its turn on every
    token (0 where not sampled), and the boundaries: True at each turn's F(c) only, where
    the value loss applies.
    """
    n = len(rewards)
    if not n == len(values) == len(masks) == len(discounts) == len(segments):
        raise ValueError("rewards, values, masks, discounts, segments: expected equal lengths")
    t_rew, t_val, t_disc, turns = [], [], [], []
    for i in range(n):
        seg = segments[i].long()
        sampled = masks[i].bool() & (seg >= 0)
        ks = torch.unique(seg[sampled]).tolist()  # sorted: a sample's turns in order
        pos = [torch.nonzero(sampled & (seg == k)).flatten() for k in ks]
        t_rew.append(torch.stack([rewards[i].float()[p].sum() for p in pos]) if ks else _empty())
        t_val.append(
            torch.stack([values[i].detach().float()[p[0]] for p in pos]) if ks else _empty()
        )
        t_disc.append(torch.stack([discounts[i].float()[p[-1]] for p in pos]) if ks else _empty())
        turns.append(pos)
    t_mask = [torch.ones(len(t), dtype=torch.bool) for t in turns]
    t_adv, t_ret = tree_gae(t_rew, t_val, t_mask, t_disc, children, lam, truncated=truncated)
    adv, ret, bounds = [], [], []
    for i in range(n):
        width = masks[i].numel()
        a, r = torch.zeros(width), torch.zeros(width)
        b = torch.zeros(width, dtype=torch.bool)
        for j, p in enumerate(turns[i]):
            a[p], r[p], b[p[0]] = t_adv[i][j], t_ret[i][j], True
        adv.append(a)
        ret.append(r)
        bounds.append(b)
    return adv, ret, bounds


def _empty() -> Tensor:
    return torch.zeros(0)


def _pad_rows(rows: Sequence[Tensor]) -> Tensor:
    return torch.nn.utils.rnn.pad_sequence(list(rows), batch_first=True)


def whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / (std + eps)`` over the tokens where ``mask`` is set; 0 elsewhere.

    The std is Bessel-corrected; when every selected value is equal (std 0) the result is 0,
    as for the group estimators.

    >>> whiten(torch.tensor([[1.0, 3.0, 9.0]]), torch.tensor([[1, 1, 0]]), eps=0.0)
    tensor([[-0.7071,  0.7071,  0.0000]])
    """
    if x.shape != mask.shape:
        raise ValueError(f"x, mask: expected equal shapes, got {tuple(x.shape)}, {mask.shape}")
    m = mask.bool()
    sel = x.detach().double()[m]
    if sel.numel() < 2 or float(sel.std()) == 0.0:
        return torch.zeros_like(x)
    out = (x.double() - sel.mean()) / (sel.std() + eps)
    return torch.where(m, out, torch.zeros_like(out)).to(x.dtype)
