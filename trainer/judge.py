"""Judge rewards (the ``rewards`` section of the config): an LLM scores what an episode
answered, for tasks that have no checkable answer.

The judge is any OpenAI-compatible chat endpoint (``rewards.judge.base_url``), or, by
default, the run's own proxy: its calls are then recorded as sessions of their own, in
groups named ``judge-<group>``, which the episode store keeps and the trainer never trains
on. Only an episode's **final answer** is judged (the content of its last completion), with
the task (the first user message) and, with ``include_trace``, a compact list of the tool
calls it made and the start of each result: a 10-30-turn transcript does not fit a small
judge's context.

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
(running totals) and ``judge/score_mean`` (over the episodes judged since the last step).
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
from typing import Any, Protocol

import openai

from areal_agents.errors import ConfigError
from areal_agents.serve.api_error import ApiError
from areal_agents.trainer.config_rollout import RewardsConfig

SCORE_MAX = 10.0
TRACE_ARG_CHARS = 80
"""A tool call's arguments in an ``include_trace`` summary are cut to this many characters;"""
TRACE_RESULT_CHARS = 240
"""its result to this many."""


FAIL_FAST = 16
"""A judge that failed on each of the first this many episodes it was given (and scored
none) ends the run with its last error: it is misconfigured, and every group would be
dropped forever."""


class JudgeError(Exception):
    """A judge call failed, or its reply could not be read."""


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
    lines = []
    for c in episode.completions:
        for tc in c.message.get("tool_calls") or []:
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


def rubric_prompt(task: str, answer: str, crit: list[Criterion], trace: str | None) -> str:
    lines = [f"Task:\n{task}", ""]
    if trace is not None:
        lines += [f"Tool calls made while answering:\n{trace}", ""]
    lines += [f"Answer to grade:\n{answer or '(empty)'}", ""]
    lines.append("Grade the answer on each criterion with a score from 0 (worst) to 10 (best):")
    lines += [f"- {c.name}: {c.description}" for c in crit]
    lines.append("")
    lines.append("Reply with one line per criterion, exactly like this:")
    lines += [f"{c.name}: <score>" for c in crit]
    return "\n".join(lines)


def yes_no_prompt(task: str, answer: str, c: Criterion, trace: str | None) -> str:
    lines = [f"Task:\n{task}", ""]
    if trace is not None:
        lines += [f"Tool calls made while answering:\n{trace}", ""]
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


def ranking_prompt(task: str, answers: list[str], crit: list[Criterion]) -> str:
    lines = [f"Task:\n{task}", "", f"Here are {len(answers)} candidate answers to the task."]
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
class Reply:
    """A judge call's answer."""

    text: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_top: list[tuple[str, float]] = field(default_factory=list)
    """The first output token's most likely alternatives, ``(token, logprob)`` (asked with
    ``top_logprobs``)."""


class Backend(Protocol):
    model: str

    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        max_tokens: int,
        temperature: float,
        group: str,
        top_logprobs: int = 0,
    ) -> Reply: ...


def _first_top(choice_logprobs: Any) -> list[tuple[str, float]]:
    """``[(token, logprob)]`` of the first token's ``top_logprobs`` in an OpenAI choice's
    ``logprobs`` (a dict or the ``openai`` client's object)."""
    if not choice_logprobs:
        return []
    content = (
        choice_logprobs.get("content")
        if isinstance(choice_logprobs, dict)
        else choice_logprobs.content
    )
    if not content:
        return []
    first = content[0]
    top = first.get("top_logprobs") if isinstance(first, dict) else first.top_logprobs
    out = []
    for t in top or []:
        tok, lp = (t["token"], t["logprob"]) if isinstance(t, dict) else (t.token, t.logprob)
        out.append((str(tok), float(lp)))
    return out


class ProxyBackend:
    """The run's own proxy, in process: each call is a session of its own in group
    ``judge-<group>`` (recorded, never trained)."""

    def __init__(self, proxy: Any) -> None:
        self.proxy = proxy
        self.model = str(proxy.model_name)

    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        max_tokens: int,
        temperature: float,
        group: str,
        top_logprobs: int = 0,
    ) -> Reply:
        sessions = self.proxy.sessions
        session = sessions.create(group_id=f"judge-{group}", metadata={"judge": True})
        request: dict[str, Any] = {
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
        }
        if top_logprobs:
            request.update(logprobs=True, top_logprobs=top_logprobs)
        reason, error = "terminated", None
        try:
            body = await self.proxy.complete(session, request)
        except ApiError as exc:
            reason, error = "judge_error", {"kind": "judge_error", "message": exc.message}
            raise JudgeError(f"the judge's call failed: {exc.message}") from None
        finally:
            sessions.end(session, reason=reason, error=error)
            sessions.release(session.id)
        usage = body.get("usage") or {}
        choice = body["choices"][0]
        return Reply(
            choice["message"].get("content") or "",
            int(usage.get("prompt_tokens", 0)),
            int(usage.get("completion_tokens", 0)),
            _first_top(choice.get("logprobs")),
        )


class HttpBackend:
    """Any OpenAI-compatible endpoint, with the ``openai`` client (no retries of its own:
    :class:`Judge` retries and times out)."""

    def __init__(self, base_url: str, model: str | None, api_key: str, timeout_s: float) -> None:
        self.base_url = base_url
        self.model = model or ""
        self.client = openai.AsyncOpenAI(
            base_url=base_url, api_key=api_key, timeout=timeout_s, max_retries=0
        )

    async def check(self) -> None:
        """Reach the endpoint once; without ``model``, take the first model it serves."""
        try:
            models = [m.id async for m in self.client.models.list()]
        except openai.OpenAIError as exc:
            raise ConfigError(
                f"rewards.judge.base_url: cannot reach the judge at {self.base_url}: {exc}; "
                "start it first (e.g. areal-agent serve) or fix the URL"
            ) from None
        if not self.model:
            if not models:
                raise ConfigError(
                    f"rewards.judge.model: the judge at {self.base_url} lists no models; "
                    "set rewards.judge.model"
                )
            self.model = models[0]

    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        max_tokens: int,
        temperature: float,
        group: str,
        top_logprobs: int = 0,
    ) -> Reply:
        extra: dict[str, Any] = {}
        if top_logprobs:
            extra = {"logprobs": True, "top_logprobs": top_logprobs}
        try:
            resp = await self.client.chat.completions.create(
                model=self.model,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=max_tokens,
                temperature=temperature,
                **extra,
            )
        except openai.OpenAIError as exc:
            raise JudgeError(f"the judge's call failed: {exc}") from None
        if not resp.choices:
            raise JudgeError("the judge's reply has no choices")
        usage, choice = resp.usage, resp.choices[0]
        return Reply(
            choice.message.content or "",
            usage.prompt_tokens if usage else 0,
            usage.completion_tokens if usage else 0,
            _first_top(choice.logprobs),
        )

    async def close(self) -> None:
        await self.client.close()


# ---------------------------------------------------------------------------- the judge
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
        """Check the endpoint (an HTTP judge), before the first episode."""
        check = getattr(self.backend, "check", None)
        if check is not None:
            await check()

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
        return out

    # -------------------------------------------------------------- scoring
    async def apply(self, group: str, results: list[Any]) -> list[Any]:
        """Judge the usable results of one group in place: rewards combined, or the
        episode ended as ``judge_error``. Returns the results whose episode changed."""
        ok = [r for r in results if r.ok and r.episode.completions]
        if not ok:
            return []
        if self.mode == "rubric":
            outcomes = await asyncio.gather(
                *[self._rubric(group, r) for r in ok], return_exceptions=True
            )
        else:
            try:
                scores = await self._ranking(group, ok)
                outcomes = list(scores)
            except JudgeError as exc:
                outcomes = [exc] * len(ok)
        for r, outcome in zip(ok, outcomes, strict=True):
            if isinstance(outcome, JudgeError):
                self._fail(r, str(outcome))
            elif isinstance(outcome, BaseException):
                raise outcome  # a bug, not a judge failure: the run's error
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

    def _fail(self, r: Any, message: str) -> None:
        self.stats.errors += 1
        self.stats.last_error = message
        r.end_reason, r.error = "judge_error", message
        ep = r.episode
        ep.end_reason = "judge_error"
        ep.errors.append({"kind": "judge_error", "message": message})

    async def _rubric(self, group: str, r: Any) -> tuple[float, dict[str, float]]:
        j = self.rewards.judge
        trace = trace_summary(r.episode, j.max_answer_chars) if j.include_trace else None
        task = task_text(r.episode, j.max_answer_chars)
        answer = final_answer(r.episode, j.max_answer_chars)
        if j.scoring == "logprobs":  # one yes/no question per criterion
            ps = await asyncio.gather(
                *[
                    self._ask_yes(group, yes_no_prompt(task, answer, c, trace))
                    for c in self.criteria
                ]
            )
            scores = {c.name: SCORE_MAX * p for c, p in zip(self.criteria, ps, strict=True)}
        else:
            prompt = rubric_prompt(task, answer, self.criteria, trace)
            scores = await self._ask(group, prompt, [c.name for c in self.criteria])
        return rubric_score(scores, self.criteria), scores

    async def _ranking(self, group: str, ok: list[Any]) -> list[tuple[float, dict[str, float]]]:
        j = self.rewards.judge
        answers = [final_answer(r.episode, j.max_answer_chars) for r in ok]
        order = list(range(len(ok)))
        # a shuffle fixed by the group's content: the same group is asked the same way
        seed = hashlib.sha256("\x00".join(answers).encode()).digest()
        random.Random(seed).shuffle(order)
        prompt = ranking_prompt(
            task_text(ok[0].episode, j.max_answer_chars),
            [answers[i] for i in order],
            self.criteria,
        )
        names = [f"Answer {k}" for k in range(1, len(ok) + 1)]
        shown = await self._ask(group, prompt, names)
        out: list[tuple[float, dict[str, float]]] = [(0.0, {})] * len(ok)
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
    """The run's judge (None with ``rewards.judge.mode: none``): over ``base_url`` when
    given, else through ``proxy`` in process."""
    j = cfg.judge
    if j.mode == "none":
        return None
    backend: Backend
    if j.base_url is not None:
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
                "rewards.judge.base_url: this run has no proxy in this process to judge "
                "with; give the judge's OpenAI-compatible URL"
            )
        backend = ProxyBackend(proxy)
    return Judge(cfg, backend, out)
