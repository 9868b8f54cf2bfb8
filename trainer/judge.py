"""Judge rewards (the ``rewards`` section of the config): an LLM scores what an episode
answered, for tasks that have no checkable answer.

The judge is any OpenAI-compatible chat endpoint (``rewards.judge.base_url``), or, with
``rewards.judge.self: true``, the policy's own model through the run's own proxy: its calls
are then recorded as sessions of their own, in groups named ``judge-<group>``, which the
episode store keeps and the trainer never trains on (one of the two is required). Only an
episode's **final answer** is judged (the content of its last completion), with the task
(the first user message), with ``include_trace`` a compact list of the tool calls it made
and the start of each result (a 10-30-turn transcript does not fit a small judge's
context), and with ``reference`` the reference answer the env's final ``info`` holds under
that key (``answers`` in ``areal/Search-v0``).

Two modes:

* ``rubric``: each episode alone. The judge scores each criterion i from 0 to 10 and the
  episode's judge score is the weighted mean, in [0, 1]::

      score_e = sum_i w_i * s_{e,i} / (10 * sum_i w_i)

  With ``scoring: text`` the judge writes ``name: score`` lines (or a JSON object); with
  ``scoring: logprobs`` it is asked one yes/no question per criterion and
  ``s_{e,i} = 10 * P(yes) / (P(yes) + P(no))``, read from the first token's
  ``top_logprobs``: no format to follow, which small judges cannot (a 135M-parameter model
  repeats the criterion instead of scoring it).

* ``ranking``: the final answers of a group's G episodes side by side, in a shuffled order
  (no position bias), each scored from 0 to 10 relative to the others, as RULER does; no
  reference answer is needed. ``score_e = s_e / 10``.

The judge **passes** an answer when its score is at least ``PASS_SCORE`` = 0.5 (half the
scale): the verdict that the calibration's balanced accuracy and ``reward/judge_agreement``
compare with the env's ``success``. Before the first step the judge is calibrated against
labelled answers and the run stops when it does not tell right from wrong
(:mod:`areal_agents.trainer.calibration`).

The judge score then joins the env's rewards, with ``rewards.env_weight`` (a) and
``rewards.judge_weight`` (b): every per-turn reward r_t becomes a * r_t, and the final
reward R becomes a * R + b * score_e, so with ``rollout.gamma`` < 1 the judge's reward is
discounted back through the turns like any final reward. The episode's ``reward`` is
a * (env reward) + b * score_e, and ``Episode.metadata["judge"]`` keeps the parts.

Calls are cached by content (the exact messages, model and sampling) in memory and in
``RUN_DIR/judge_cache.jsonl`` (a resumed run reuses them), run at most ``concurrency`` at a
time, and are cut at ``timeout_s``. A written reply that cannot be read (a criterion or an
answer without a score) is shown back to the judge, ``retries`` times at most; a yes/no
question whose first token is neither fails at once. An episode whose judging failed
ends as ``judge_error``: the error is recorded once on the episode (and in the store), the
episode is dropped from training and counted in ``dropped/judge_error``; its reward is never
silently 0. The cost is in the metrics: ``judge/calls``, ``judge/cache_hits``,
``judge/errors``, ``judge/prompt_tokens``, ``judge/completion_tokens``, ``judge/seconds``
(running totals), ``judge/score_mean`` (over the episodes judged since the last step) and
the calibration's ``judge/calib_auc`` and ``judge/calib_balanced_accuracy``. Where the env
also reports ``success`` (a verifier), the episodes judged since the last step give::

    reward/judge_agreement = |{e : (score_e >= PASS_SCORE) == success_e}| / |{e}|

over the judged episodes whose ``success`` is not None (absent when there is none).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_agents.errors import ConfigError
from areal_agents.trainer.config_rollout import JudgeConfig, RewardsConfig
from areal_agents.trainer.judge_backends import (
    Backend,
    HttpBackend,
    JudgeError,
    ProxyBackend,
    Reply,
)

SCORE_MAX = 10.0
PASS_SCORE = 0.5
"""A judge score (in [0, 1]) at least this is the judge's pass, below it its fail."""
TRACE_ARG_CHARS = 80
"""A tool call's arguments in an ``include_trace`` summary are cut to this many characters;"""
TRACE_RESULT_CHARS = 240
"""its result to this many."""


FAIL_FAST = 16
"""A judge that failed on each of the first this many episodes it was given (and scored
none) ends the run with its last error: it is misconfigured, and every group would be
dropped forever."""


@dataclass(frozen=True)
class Answer:
    """What the judge is shown of one answer (each part already cut to
    ``max_answer_chars``)."""

    task: str
    text: str
    trace: str | None = None
    """The tool calls made while answering (``include_trace``), else None."""
    reference: str | None = None
    """The reference answer (``reference``), else None."""


@dataclass(frozen=True)
class Criterion:
    name: str
    description: str
    weight: float = 1.0


def criteria(rubric: dict[str, Any]) -> list[Criterion]:
    """The rubric's criteria: ``{name: description}`` or ``{name: {description, weight}}``
    (checked by the config)."""
    out = []
    for name, spec in rubric.items():
        if isinstance(spec, str):
            out.append(Criterion(name, spec))
        else:
            out.append(Criterion(name, str(spec["description"]), float(spec.get("weight", 1.0))))
    return out


def rubric_score(scores: dict[str, float], crit: list[Criterion]) -> float:
    """``sum_i w_i s_i / (10 sum_i w_i)``: the weighted mean of 0-10 scores, in [0, 1]."""
    total = sum(c.weight for c in crit)
    return sum(c.weight * scores[c.name] for c in crit) / (SCORE_MAX * total)


# ---------------------------------------------------------------------------- reading
def final_answer(episode: Any, limit: int) -> str:
    """The content of the episode's last completion (its final answer), at most ``limit``
    characters (the end kept: that is where an answer is)."""
    if not episode.completions:
        return ""
    text = str(episode.completions[-1].message.get("content") or "").strip()
    return text if len(text) <= limit else "..." + text[-limit:]


def task_text(episode: Any, limit: int) -> str:
    """The task: the first user message of the episode's first completion."""
    if not episode.completions:
        return ""
    for m in episode.completions[0].messages:
        if m.get("role") == "user":
            text = _content(m.get("content"))
            return text if len(text) <= limit else text[:limit] + "..."
    return ""


def trace_summary(episode: Any, limit: int) -> str:
    """One line per tool call of the episode (name and arguments, shortened), each followed
    by the start of its result, at most ``limit`` characters in all (the latest calls
    kept): what the answer could be based on, without the whole transcript."""
    results: dict[str, str] = {}
    for c in episode.completions:
        for m in c.messages:
            if m.get("role") == "tool" and m.get("tool_call_id"):
                results[str(m["tool_call_id"])] = _content(m.get("content"))
    calls = [tc for c in episode.completions for tc in c.message.get("tool_calls") or []]
    return _trace(calls, results, limit)


def trace_of_messages(messages: list[dict[str, Any]], limit: int) -> str:
    """:func:`trace_summary` of a conversation given as one list of chat messages (the
    assistant's tool calls and the tool results that answer them)."""
    results = {
        str(m["tool_call_id"]): _content(m.get("content"))
        for m in messages
        if m.get("role") == "tool" and m.get("tool_call_id")
    }
    calls = [
        tc for m in messages if m.get("role") == "assistant" for tc in m.get("tool_calls") or []
    ]
    return _trace(calls, results, limit)


def _trace(calls: list[dict[str, Any]], results: dict[str, str], limit: int) -> str:
    lines = []
    for tc in calls:
        fn = tc.get("function") or {}
        args = _cut(str(fn.get("arguments") or ""), TRACE_ARG_CHARS)
        line = f"- {fn.get('name', '?')}({args})"
        if (res := results.get(str(tc.get("id", "")))) is not None:
            line += " -> " + _cut(" ".join(res.split()), TRACE_RESULT_CHARS)
        lines.append(line)
    if not lines:
        return "(no tool calls)"
    kept: list[str] = []
    for line in reversed(lines):
        if sum(len(k) + 1 for k in kept) + len(line) > limit:
            break
        kept.insert(0, line)
    if len(kept) < len(lines):
        kept.insert(0, f"({len(lines) - len(kept)} earlier calls not shown)")
    return "\n".join(kept)


def reference_text(info: dict[str, Any], key: str, limit: int) -> str:
    """The reference answer that an episode's final ``info`` holds under ``key``
    (``rewards.judge.reference``): a string as it is; a list of accepted answers as its
    first, then ``(also accepted: ...)``; at most ``limit`` characters. Raises
    :class:`JudgeError` naming the key when there is none."""
    value = info.get(key)
    if isinstance(value, list | tuple):
        values = [str(v).strip() for v in value if str(v).strip()]
        text = values[0] if values else ""
        if len(values) > 1:
            text += f" (also accepted: {', '.join(values[1:])})"
    else:
        text = "" if value is None else str(value).strip()
    if not text:
        keys = ", ".join(sorted(map(str, info))) or "none"
        raise JudgeError(
            f"rewards.judge.reference={key!r}: the episode's final info has no {key!r} "
            f"(its keys: {keys}); name a key that holds the reference answer, or remove "
            "rewards.judge.reference"
        )
    return _cut(text, limit)


def load_labelled(path: str, cfg: JudgeConfig) -> list[tuple[Answer, bool]]:
    """The rows of a labelled calibration file (``rewards.judge.calibration``, JSONL): see
    :func:`parse_labelled`. Raises :class:`ConfigError` naming the file or the rows to
    fix."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(
            f"rewards.judge.calibration={path}: no such file (a relative path is from "
            f"{Path.cwd()}); give the path of a labelled JSONL file, or remove "
            "rewards.judge.calibration to calibrate on episodes"
        )
    return parse_labelled(file.read_text(encoding="utf-8"), cfg, path)


def parse_labelled(text: str, cfg: JudgeConfig, where: str) -> list[tuple[Answer, bool]]:
    """Labelled answers (JSONL ``text``, from ``where``) as the judge sees them, with their
    labels. A row: ``{"prompt": task}`` or ``{"messages": the conversation before the
    answer}`` (its first user message is the task, its tool calls the trace), ``"answer"``:
    the final answer, ``"label"``: true or false (or 1 / 0), and ``"reference"`` (a string
    or a list) with ``rewards.judge.reference``. Raises :class:`ConfigError` naming the rows
    to fix."""
    limit = cfg.max_answer_chars
    out: list[tuple[Answer, bool]] = []
    problems: list[str] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            problems.append(f"line {n}: not JSON ({exc})")
            continue
        try:
            out.append(_labelled_row(row, cfg, limit))
        except ValueError as exc:
            problems.append(f"line {n}: {exc}")
    if problems:
        shown = problems[:5] + ([f"... {len(problems) - 5} more"] if len(problems) > 5 else [])
        raise ConfigError(
            f"rewards.judge.calibration={where}: rows must be "
            '{"prompt" or "messages", "answer", "label"'
            + (', "reference"}' if cfg.reference else "}")
            + "; fix these",
            problems=shown,
        )
    return out


def _labelled_row(row: Any, cfg: JudgeConfig, limit: int) -> tuple[Answer, bool]:
    if not isinstance(row, dict):
        raise ValueError("not a JSON object")
    label = row.get("label")
    if label not in (True, False, 0, 1):
        raise ValueError(f"label must be true or false (or 1 / 0), got {label!r}")
    answer = row.get("answer")
    if not isinstance(answer, str):
        raise ValueError(f"answer must be the final answer's text, got {answer!r:.60}")
    prompt, messages = row.get("prompt"), row.get("messages")
    if (prompt is None) == (messages is None):
        raise ValueError('give one of "prompt" (the task) or "messages" (the conversation)')
    trace = None
    if messages is not None:
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of chat messages")
        users = [_content(m.get("content")) for m in messages if m.get("role") == "user"]
        if not users:
            raise ValueError("messages has no user message (the task)")
        prompt = users[0]
        if cfg.include_trace:
            trace = trace_of_messages(messages, limit)
    elif not isinstance(prompt, str):
        raise ValueError(f"prompt must be the task's text, got {prompt!r:.60}")
    reference = None
    if cfg.reference is not None:
        try:
            reference = reference_text(row, "reference", limit)
        except JudgeError:
            raise ValueError(
                'no "reference" (rewards.judge.reference is set: each row needs one)'
            ) from None
    task = prompt if len(prompt) <= limit else prompt[:limit] + "..."
    text = answer.strip()
    text = text if len(text) <= limit else "..." + text[-limit:]
    return Answer(task, text, trace, reference), bool(label)


def _cut(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n] + "..."


def _content(content: Any) -> str:
    if isinstance(content, list):  # content parts
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content or "")


_NUMBER = r"(\d+(?:\.\d+)?)"


def parse_scores(text: str, names: list[str]) -> dict[str, float]:
    """A score in [0, 10] for each of ``names`` from the judge's reply: a JSON object
    ``{name: score}`` anywhere in it, else lines ``name: score`` (``7/10`` reads as 7).
    Raises :class:`JudgeError` naming what is missing."""
    found: dict[str, float] = {}
    for blob in re.findall(r"\{[^{}]*\}", text):
        try:
            data = json.loads(blob)
        except ValueError:
            continue
        if isinstance(data, dict):
            lowered = {str(k).strip().lower(): v for k, v in data.items()}
            for n in names:
                v = lowered.get(n.lower())
                if isinstance(v, int | float) and not isinstance(v, bool):
                    found[n] = float(v)
    for n in names:
        if n in found:
            continue
        m = re.search(rf"(?im)^[\W_]*{re.escape(n)}[\W_]*?\s*[:=\-]\s*\**\s*{_NUMBER}", text)
        if m:
            found[n] = float(m.group(1))
    missing = [n for n in names if n not in found]
    if missing:
        raise JudgeError(f"no score for {', '.join(missing)} in the judge's reply {text!r:.300}")
    return {n: min(max(v, 0.0), SCORE_MAX) for n, v in found.items()}


# ---------------------------------------------------------------------------- prompts
SYSTEM = (
    "You are a careful, strict grader. You grade answers to tasks, judging only what the "
    "answer says. Reply only in the format asked for."
)


def _context(task: str, trace: str | None, reference: str | None) -> list[str]:
    """The lines before the answer: the task, the trace and the reference, where given."""
    lines = [f"Task:\n{task}", ""]
    if trace is not None:
        lines += [f"Tool calls made while answering:\n{trace}", ""]
    if reference is not None:
        lines += [f"Reference answer (known to be correct):\n{reference}", ""]
    return lines


def rubric_prompt(
    task: str,
    answer: str,
    crit: list[Criterion],
    trace: str | None,
    reference: str | None = None,
) -> str:
    lines = _context(task, trace, reference)
    lines += [f"Answer to grade:\n{answer or '(empty)'}", ""]
    lines.append("Grade the answer on each criterion with a score from 0 (worst) to 10 (best):")
    lines += [f"- {c.name}: {c.description}" for c in crit]
    lines.append("")
    lines.append("Reply with one line per criterion, exactly like this:")
    lines += [f"{c.name}: <score>" for c in crit]
    return "\n".join(lines)


def yes_no_prompt(
    task: str, answer: str, c: Criterion, trace: str | None, reference: str | None = None
) -> str:
    lines = _context(task, trace, reference)
    lines += [f"Answer:\n{answer or '(empty)'}", ""]
    lines.append(f"Does the answer meet this criterion? {c.description}")
    lines.append("Reply with Yes or No.")
    return "\n".join(lines)


YES_NO_TOP = 20
"""Alternatives asked for the one token of a yes/no question (the OpenAI API's maximum)."""


def yes_probability(top: list[tuple[str, float]]) -> float:
    """P(yes) / (P(yes) + P(no)) over the first token's alternatives: each token that reads
    yes or no once stripped and lower-cased (``Yes``, `` yes``, ``NO``) adds its
    probability. Raises :class:`JudgeError` when neither is among them."""
    yes = sum(math.exp(lp) for t, lp in top if t.strip().lower() == "yes")
    no = sum(math.exp(lp) for t, lp in top if t.strip().lower() == "no")
    if yes + no <= 0:
        shown = ", ".join(repr(t) for t, _ in top[:5]) or "none"
        raise JudgeError(f"neither Yes nor No among the judge's likely first tokens ({shown})")
    return yes / (yes + no)


def ranking_prompt(
    task: str, answers: list[str], crit: list[Criterion], reference: str | None = None
) -> str:
    lines = _context(task, None, reference)
    lines.append(f"Here are {len(answers)} candidate answers to the task.")
    for i, a in enumerate(answers, 1):
        lines += ["", f"Answer {i}:", a or "(empty)"]
    lines.append("")
    if crit:
        lines.append("Judge them by:")
        lines += [f"- {c.name} (weight {c.weight:g}): {c.description}" for c in crit]
    lines.append(
        "Compare the answers with each other and score each from 0 (worst) to 10 (best); a "
        "better answer gets a higher score."
    )
    lines.append("Reply with one line per answer, exactly like this:")
    lines += [f"Answer {i}: <score>" for i in range(1, len(answers) + 1)]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- endpoints
@dataclass
class JudgeStats:
    calls: int = 0
    cache_hits: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    judged: int = 0
    """Episodes scored."""
    last_error: str = ""
    scores: list[float] = field(default_factory=list)
    """The judge scores since the last :meth:`Judge.metrics`."""
    agreed: list[bool] = field(default_factory=list)
    """Since the last :meth:`Judge.metrics`, per judged episode whose env reported
    ``success``: whether the judge's pass (score >= ``PASS_SCORE``) equals it."""


class Judge:
    """Scores the usable episodes of finished groups (:meth:`apply`); see the module
    docstring. ``backend``: :class:`ProxyBackend` or :class:`HttpBackend`."""

    def __init__(self, cfg: RewardsConfig, backend: Backend, out: Path | None = None) -> None:
        self.rewards = cfg
        j = cfg.judge
        self.mode = j.mode
        self.criteria = criteria(j.rubric)
        self.backend = backend
        self.stats = JudgeStats()
        self.labelled: list[tuple[Answer, bool]] | None = None
        """The rows of the labelled calibration file (read by :meth:`start`), or None."""
        self.calibration: dict[str, float] = {}
        """``judge/calib_*``: the calibration's results, in every step's metrics
        (:mod:`areal_agents.trainer.calibration` sets them)."""
        self._slots = asyncio.Semaphore(j.concurrency)
        self._cache: dict[str, str] = {}
        self.cache_path = None if out is None else out / "judge_cache.jsonl"
        if self.cache_path is not None and self.cache_path.exists():
            for line in self.cache_path.read_text().splitlines():
                try:
                    row = json.loads(line)
                    self._cache[row["key"]] = row["reply"]
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut short by a crash

    async def start(self) -> None:
        """Check the endpoint (an HTTP judge) and read the labelled calibration file, before
        the first episode."""
        check = getattr(self.backend, "check", None)
        if check is not None:
            await check()
        j = self.rewards.judge
        if j.calibration is not None:
            self.labelled = load_labelled(j.calibration, j)

    async def close(self) -> None:
        close = getattr(self.backend, "close", None)
        if close is not None:
            await close()

    def metrics(self) -> dict[str, float]:
        """``judge/*``: running totals, and the mean score since the previous call."""
        s = self.stats
        out = {
            "judge/calls": float(s.calls),
            "judge/cache_hits": float(s.cache_hits),
            "judge/errors": float(s.errors),
            "judge/prompt_tokens": float(s.prompt_tokens),
            "judge/completion_tokens": float(s.completion_tokens),
            "judge/seconds": s.seconds,
        }
        if s.scores:
            out["judge/score_mean"] = sum(s.scores) / len(s.scores)
            s.scores = []
        if s.agreed:
            out["reward/judge_agreement"] = sum(s.agreed) / len(s.agreed)
            s.agreed = []
        out.update(self.calibration)
        return out

    # -------------------------------------------------------------- scoring
    def answer_of(self, r: Any) -> Answer:
        """What the judge is shown of an episode result: its task, final answer, trace
        (``include_trace``) and reference answer (``reference``, from its final info)."""
        j = self.rewards.judge
        ep, limit = r.episode, j.max_answer_chars
        reference = None
        if j.reference is not None:
            try:
                reference = reference_text(r.info or {}, j.reference, limit)
            except JudgeError:
                if r.end_reason != "truncated":
                    raise
                # cut at rollout.max_turns before a final answer, when the env grades (and
                # tells the reference): judged as it is, without one
        return Answer(
            task_text(ep, limit),
            final_answer(ep, limit),
            trace_summary(ep, limit) if j.include_trace else None,
            reference,
        )

    async def score(
        self, group: str, answers: list[Answer]
    ) -> list[tuple[float, dict[str, float]] | JudgeError]:
        """Each answer's judge score in [0, 1] with its parts, or the :class:`JudgeError`
        that kept it from one; ``answers`` are one group's (``ranking`` compares them). The
        calibration scores its answers with this too."""
        outcomes: list[Any]
        if self.mode == "rubric":
            outcomes = await asyncio.gather(
                *[self._rubric(group, a) for a in answers], return_exceptions=True
            )
        else:
            try:
                outcomes = list(await self._ranking(group, answers))
            except JudgeError as exc:
                outcomes = [exc] * len(answers)
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, JudgeError):
                raise outcome  # a bug, not a judge failure: the run's error
        return outcomes

    async def apply(self, group: str, results: list[Any]) -> list[Any]:
        """Judge the usable results of one group in place: rewards combined, or the
        episode ended as ``judge_error``. Returns the results whose episode changed."""
        ok = [r for r in results if r.ok and r.episode.completions]
        if not ok:
            return []
        shown, answers = [], []
        for r in ok:
            try:
                answers.append(self.answer_of(r))
                shown.append(r)
            except JudgeError as exc:  # no reference answer in its info
                self._fail(r, str(exc))
        outcomes = await self.score(group, answers) if answers else []
        for r, outcome in zip(shown, outcomes, strict=True):
            if isinstance(outcome, JudgeError):
                self._fail(r, str(outcome))
            else:
                score, parts = outcome
                self._combine(r, score, parts)
        s = self.stats
        if not s.judged and s.errors >= FAIL_FAST:
            raise ConfigError(
                f"rewards.judge: the judge failed on each of the first {s.errors} episodes, "
                f"the last with: {s.last_error}; check rewards.judge (base_url, model, "
                "max_tokens, timeout_s) or use a stronger judge model"
            )
        return ok

    def _combine(self, r: Any, score: float, parts: dict[str, float]) -> None:
        a, b = self.rewards.env_weight, self.rewards.judge_weight
        ep = r.episode
        env_reward = r.reward
        for c in ep.completions:
            c.reward *= a
        ep.final_reward = a * (ep.final_reward or 0.0) + b * score
        r.reward = a * env_reward + b * score
        ep.metadata["judge"] = {"score": score, "scores": parts, "env_reward": env_reward}
        self.stats.scores.append(score)
        self.stats.judged += 1
        if r.success is not None:  # the env's verifier scored it too
            self.stats.agreed.append((score >= PASS_SCORE) == bool(r.success))

    def _fail(self, r: Any, message: str) -> None:
        self.stats.errors += 1
        self.stats.last_error = message
        r.end_reason, r.error = "judge_error", message
        ep = r.episode
        ep.end_reason = "judge_error"
        ep.errors.append({"kind": "judge_error", "message": message})

    async def _rubric(self, group: str, a: Answer) -> tuple[float, dict[str, float]]:
        j = self.rewards.judge
        if j.scoring == "logprobs":  # one yes/no question per criterion
            ps = await asyncio.gather(
                *[
                    self._ask_yes(group, yes_no_prompt(a.task, a.text, c, a.trace, a.reference))
                    for c in self.criteria
                ]
            )
            scores = {c.name: SCORE_MAX * p for c, p in zip(self.criteria, ps, strict=True)}
        else:
            prompt = rubric_prompt(a.task, a.text, self.criteria, a.trace, a.reference)
            scores = await self._ask(group, prompt, [c.name for c in self.criteria])
        return rubric_score(scores, self.criteria), scores

    async def _ranking(
        self, group: str, shown_answers: list[Answer]
    ) -> list[tuple[float, dict[str, float]]]:
        answers = [a.text for a in shown_answers]
        order = list(range(len(answers)))
        # a shuffle fixed by the group's content: the same group is asked the same way
        seed = hashlib.sha256("\x00".join(answers).encode()).digest()
        random.Random(seed).shuffle(order)
        first = shown_answers[0]
        prompt = ranking_prompt(
            first.task, [answers[i] for i in order], self.criteria, first.reference
        )
        names = [f"Answer {k}" for k in range(1, len(answers) + 1)]
        shown = await self._ask(group, prompt, names)
        out: list[tuple[float, dict[str, float]]] = [(0.0, {})] * len(answers)
        for k, i in enumerate(order):
            s = shown[names[k]]
            out[i] = (s / SCORE_MAX, {"rank_score": s, "shown_as": float(k + 1)})
        return out

    async def _ask(self, group: str, prompt: str, names: list[str]) -> dict[str, float]:
        """Ask (or read from the cache) until the reply holds every score: an unreadable
        reply is shown back to the judge with what is missing, ``retries`` more times at
        most (a new prompt, so a greedy judge can answer differently); each call is cut at
        ``timeout_s``. Every reply is cached by the messages that produced it."""
        j = self.rewards.judge
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
        last: JudgeError | None = None
        for _ in range(j.retries + 1):
            key = self._key(messages)
            reply = self._cache.get(key)
            if reply is not None:
                self.stats.cache_hits += 1
            else:
                reply = (await self._call(messages, group)).text
                self._remember(key, reply)
            try:
                return parse_scores(reply, names)
            except JudgeError as exc:
                last = exc
            messages = [
                *messages,
                {"role": "assistant", "content": reply},
                {
                    "role": "user",
                    "content": "That reply could not be read. Reply again with exactly these "
                    "lines and nothing else:\n" + "\n".join(f"{n}: <score>" for n in names),
                },
            ]
        assert last is not None
        raise last

    async def _call(
        self, messages: list[dict[str, Any]], group: str, *, yes_no: bool = False
    ) -> Reply:
        """One call, within ``timeout_s`` and ``concurrency``; ``yes_no``: one token, with
        its alternatives."""
        j = self.rewards.judge
        async with self._slots:
            self.stats.calls += 1
            t0 = time.perf_counter()
            try:
                reply = await asyncio.wait_for(
                    self.backend.chat(
                        messages,
                        max_tokens=1 if yes_no else j.max_tokens,
                        temperature=j.temperature,
                        group=group,
                        top_logprobs=YES_NO_TOP if yes_no else 0,
                    ),
                    j.timeout_s,
                )
            except TimeoutError:
                raise JudgeError(f"the judge did not answer within {j.timeout_s} s") from None
            finally:
                self.stats.seconds += time.perf_counter() - t0
        self.stats.prompt_tokens += reply.prompt_tokens
        self.stats.completion_tokens += reply.completion_tokens
        return reply

    async def _ask_yes(self, group: str, prompt: str) -> float:
        """P(yes) of a yes/no question, from the first token's alternatives (cached)."""
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
        key = self._key([*messages, {"scoring": "logprobs"}])
        cached = self._cache.get(key)
        if cached is not None:
            self.stats.cache_hits += 1
            return float(cached)
        reply = await self._call(messages, group, yes_no=True)
        p = yes_probability(reply.first_top)
        self._remember(key, repr(p))
        return p

    def _key(self, messages: list[dict[str, Any]]) -> str:
        """The cache key: the content of the call (model, messages, sampling)."""
        j = self.rewards.judge
        what = [self.backend.model, messages, j.max_tokens, j.temperature]
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()

    def _remember(self, key: str, reply: str) -> None:
        self._cache[key] = reply
        if self.cache_path is not None:
            with self.cache_path.open("a") as f:
                f.write(json.dumps({"key": key, "reply": reply}) + "\n")


def make_judge(cfg: RewardsConfig, proxy: Any, out: Path | None) -> Judge | None:
    """The run's judge (None with ``rewards.judge.mode: none``): through ``proxy`` in
    process with ``self: true``, else over ``base_url``."""
    j = cfg.judge
    if j.mode == "none":
        return None
    backend: Backend
    if not j.self:
        if j.base_url is None:  # the config refuses it; a hand-built RewardsConfig too
            raise ConfigError(
                "rewards.judge.base_url: a judge needs an OpenAI-compatible URL, or "
                "rewards.judge.self=true to judge with the policy's own model"
            )
        key = "none"
        if j.api_key_env is not None:
            key = os.environ.get(j.api_key_env, "")
            if not key:
                raise ConfigError(
                    f"rewards.judge.api_key_env: ${j.api_key_env} is not set; export the "
                    "judge's API key in it"
                )
        backend = HttpBackend(j.base_url, j.model, key, j.timeout_s)
    else:
        if proxy is None:
            raise ConfigError(
                "rewards.judge.self: this run has no proxy in this process to judge with; "
                "give the judge's OpenAI-compatible URL (rewards.judge.base_url) and set "
                "rewards.judge.self=false"
            )
        backend = ProxyBackend(proxy)
    return Judge(cfg, backend, out)
