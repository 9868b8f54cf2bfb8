"""Held-out evaluation inside a training run (the ``eval`` section of the config).

The same ``eval.episodes`` held-out tasks (``eval.split``, a seeded permutation of the
split's pool where the env has one) are run through the run's own proxy and engine, with
the weights the engine holds at that moment and ``eval.temperature`` (greedy by default):

* ``base``: before the warm start, the model as loaded (a fresh LoRA adapter is zero, so
  this is the base model);
* ``warm_start``: after the warm start, before the first RL step;
* ``step-N``: every ``eval.every`` RL steps, while the rollouts go on;
* ``final``: after the last step, with the rollouts stopped.

Evaluation episodes are proxy groups named ``eval-<label>-<seed>``: the run's episode store
records them, the trainer never trains on them. Each result is appended to
``RUN_DIR/eval.json`` (a resumed run keeps the earlier ones and does not evaluate the base
model again) and logged as ``eval/*`` metrics. :meth:`HeldOut.line` is what ``areal-agent
train`` prints last, so that the warm start's gain is not read as RL's::

    held-out success: base 2% -> warm start 31% -> RL 46% (64 tasks, greedy, test split)
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from areal_agents.envs.registry import make
from areal_agents.errors import ConfigError
from areal_agents.rollout.evaluate import EvalReport, evaluate
from areal_agents.rollout.runner import Runner
from areal_agents.trainer.config import TrainConfig


class HeldOut:
    """The held-out tasks of a run and their results so far (``RUN_DIR/eval.json``)."""

    def __init__(self, cfg: TrainConfig, out: Path) -> None:
        """Makes the held-out env once, so that a bad ``eval.env_kwargs`` fails before the
        first episode."""
        self.cfg = cfg
        self.path = out / "eval.json"
        self.results: list[dict[str, Any]] = []
        if self.path.exists():  # a resumed run: the evaluations it already made
            self.results = json.loads(self.path.read_text())
        if not cfg.eval.episodes:
            self.make_env = None
            return
        env_id = cfg.env.id
        assert env_id is not None  # the config refuses eval without an env
        kwargs = {**cfg.env.kwargs, **cfg.eval.env_kwargs}
        what = f"eval.env_kwargs (on top of env.kwargs) for {env_id}"
        try:
            env = make(env_id, **kwargs)
        except TypeError as exc:
            raise ConfigError(f"{what}: the env does not take them: {exc}") from None
        params = inspect.signature(type(env.unwrapped).__init__).parameters
        takes_split = "split" in params
        env.close()
        self.needs_user = "user_simulator" in params and not (
            {"user_simulator", "user_base_url"} & set(kwargs)
        )
        """The env simulates a user and the eval kwargs name none: the held-out envs take
        the training envs' (the run's own model, :class:`ProxyUserSimulator`) at the first
        evaluation, when the run's proxy exists."""
        if takes_split:
            kwargs["split"] = cfg.eval.split
            try:
                make(env_id, **kwargs).close()
            except (TypeError, ValueError, KeyError) as exc:
                raise ConfigError(f"eval.split={cfg.eval.split!r}: {env_id}: {exc}") from None
        self.split = cfg.eval.split if takes_split else None
        self.make_env = functools.partial(make, env_id, **kwargs)

    @property
    def enabled(self) -> bool:
        return self.make_env is not None

    def done(self, label: str) -> bool:
        """Whether an evaluation of that label is already recorded (a resumed run)."""
        return any(r["label"] == label for r in self.results)

    async def run(
        self, source: Any, label: str, step: int, *, progress: bool = False
    ) -> dict[str, float]:
        """Evaluate the engine's current weights on the held-out tasks; record the result
        as ``label`` at ``step``; return its ``eval/*`` metrics (empty when disabled).
        ``source`` is the run's group source: its proxy, server and agent are used.
        ``progress``: a progress bar on stderr."""
        if self.make_env is None:
            return {}
        cfg = self.cfg
        await source.prepare()  # an in-process agent needs the proxy served over HTTP
        if self.needs_user:
            self.make_env = functools.partial(self.make_env, user_simulator=_user_of(source))
            self.needs_user = False
        base = source.runner
        runner = Runner(
            base.proxy,
            base_url=base.base_url,
            concurrency=max(cfg.rollout.concurrency, 1),
            max_turns=cfg.rollout.max_turns,
            episode_timeout_s=cfg.rollout.episode_timeout_s or 1e9,
            sampling={
                "temperature": cfg.eval.temperature,
                "max_tokens": cfg.sampling.max_new_tokens,
            },
        )
        bar = tqdm(
            total=cfg.eval.episodes,
            desc=f"held-out {label}",
            unit="ep",
            disable=not progress,
            file=sys.stderr,
        )
        seen = {"episodes": 0, "successes": 0}

        def advance(res: Any) -> None:
            seen["episodes"] += 1
            seen["successes"] += bool(res.success)
            bar.update()
            bar.set_postfix(success=f"{seen['successes'] / seen['episodes']:.0%}")

        try:
            report, _ = await evaluate(
                runner,
                self.make_env,
                env_id=str(cfg.env.id),
                episodes=cfg.eval.episodes,
                seed=cfg.eval.seed,
                agent=source.local_agent,
                progress=advance,
                group_prefix=f"eval-{label}",
            )
        finally:
            bar.close()
        self.results.append(_row(label, step, report))
        self._write()
        return metrics_of(report)

    def record_again(self, label: str) -> None:
        """Record the latest result once more as ``label`` (the same weights were just
        evaluated under another label: the last step's ``step-N`` is also ``final``)."""
        self.results.append({**self.results[-1], "label": label})
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.results, indent=1) + "\n")
        os.replace(tmp, self.path)

    def line(self) -> str | None:
        """``held-out success: base X% -> warm start Y% -> RL Z% (N tasks, ...)``, from the
        latest result of each stage; None when nothing was evaluated."""

        def latest(*labels: str) -> dict[str, Any] | None:
            return next((r for r in reversed(self.results) if r["label"] in labels), None)

        steps = [r["label"] for r in self.results if r["label"].startswith("step-")]
        rl = latest("final") or latest(*steps)
        parts = [
            f"{name} {r['success_rate']:.0%}"
            for name, r in (("base", latest("base")), ("warm start", latest("warm_start")))
            if r is not None
        ]
        if rl is not None:
            at = "" if rl["label"] == "final" else f" (step {rl['step']})"
            parts.append(f"RL {rl['success_rate']:.0%}{at}")
        if not parts:
            return None
        how = "greedy" if self.cfg.eval.temperature == 0 else f"T={self.cfg.eval.temperature}"
        split = f", {self.split} split" if self.enabled and self.split else ""
        n = self.results[-1]["episodes"]
        return f"held-out success: {' -> '.join(parts)} ({n} tasks, {how}{split})"


def _user_of(source: Any) -> Any:
    """The simulated user of the training envs of ``source`` (the run's own model)."""
    make_env = getattr(source, "make_env", None)
    env = make_env() if make_env is not None else None
    user = getattr(env.unwrapped, "user_simulator", None) if env is not None else None
    if env is not None:
        env.close()
    if user is None:
        raise ConfigError(
            "eval: the held-out env simulates a user and the training envs have none to "
            "lend it; set eval.env_kwargs.user_base_url to an OpenAI-compatible endpoint "
            "that plays it"
        )
    return user


def metrics_of(report: EvalReport) -> dict[str, float]:
    """``eval/success_rate``, ``eval/mean_reward``, ``eval/mean_turns``,
    ``eval/success_<kind>`` per task kind, ``eval/tool_calls_mean`` and
    ``eval/tool_call_valid_rate`` where the env ran tools, and ``eval/grounded_success_rate``
    where the env reports grounding (a success that opened its gold documents)."""
    out = {
        "eval/success_rate": report.success_rate,
        "eval/mean_reward": report.mean_reward,
        "eval/mean_turns": report.mean_turns,
    }
    if report.mean_tool_calls is not None:
        out["eval/tool_calls_mean"] = report.mean_tool_calls
    if report.tool_call_validity is not None:
        out["eval/tool_call_valid_rate"] = report.tool_call_validity
    if report.grounded_success_rate is not None:
        out["eval/grounded_success_rate"] = report.grounded_success_rate
    out.update({f"eval/success_{k}": v for k, v in report.by_kind.items()})
    return out


def _row(label: str, step: int, report: EvalReport) -> dict[str, Any]:
    return {
        "label": label,
        "step": step,
        "episodes": report.episodes,
        "success_rate": report.success_rate,
        "mean_reward": report.mean_reward,
        "mean_turns": report.mean_turns,
        "mean_tool_calls": report.mean_tool_calls,
        "tool_call_validity": report.tool_call_validity,
        "grounded_success_rate": report.grounded_success_rate,
        "by_kind": report.by_kind,
        "end_reasons": report.end_reasons,
        "duration_s": report.duration_s,
    }
