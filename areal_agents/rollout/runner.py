"""The episode runner: environments and agents behind proxy sessions, many at once.

Each episode gets its own proxy session, so every model call it makes is recorded as a
token-level completion of that episode. Two ways to drive an episode:

* **env-driven** (no agent given): the runner loops ``env.step`` with the assistant message
  of each chat completion; the reward of each step lands on the completion that produced
  that step's action, so per-turn rewards and discounted returns come out right.
* **agent-driven**: the user's agent runs its own loop against the session's OpenAI-compatible
  endpoint, with the env's tools bound to the episode; the env scores the conversation and the
  score becomes the episode's final reward. An agent is either an object with
  ``async run(task)`` or an (async) callable taking an :class:`AgentTask`.

Groups: ``run_group`` samples N episodes of the same task concurrently under one group id.
Episodes never run serially: every episode is a task on the event loop, bounded by a
semaphore. A failing model call, env step, tool or agent ends *that* episode with a typed
reason (``backend_error``, ``env_error``, ``agent_error``, ``timeout``, ...) recorded on the
episode and counted by the caller; it never fails the batch.

Before an episode ends, its metadata gets ``env`` (the gymnasium id of the env, its
``env.spec.id``, or None for an env made without a spec), ``success`` (as the env reported
it, None when it did not) and ``turns``, so that the session's stored header (written at
the end) can be filtered on them. Env-driven, where the env's reset or step info gives a
``state_key`` (the identity of the state it leaves the episode in), the metadata's
``state_keys`` maps each completion to the key of the state its prompt shows: step-level
advantage groups (``advantage.estimator: step_group``) compare the turns that share one.
Env-driven, the metadata also counts the episode's ``tool_calls`` and ``tool_errors``
(calls whose result the env marked with an error: an unknown tool, bad arguments, a tool
that raised or timed out), and :class:`EpisodeResult` carries both.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from openai import AsyncOpenAI

from areal_agents.errors import AgentError, ArealError, EpisodeTimeout, RolloutError, UserError
from areal_agents.serve.api_error import ApiError
from areal_agents.serve.proxy import Proxy
from areal_agents.serve.session import Session
from areal_agents.trajectory import Episode

EnvFactory = Callable[[], Any]
_API_REASONS = {"context_length_exceeded": "context_overflow"}
# Env calls may block (sandboxed tools, user simulators): they run on this pool, sized for
# I/O-bound steps, so that slow steps of some episodes never hold up the others.
_ENV_POOL = ThreadPoolExecutor(max_workers=64, thread_name_prefix="areal-env")


@dataclass
class AgentTask:
    """What an agent-driven episode gives the user's agent."""

    messages: list[dict[str, Any]]
    """The task as chat messages (from ``env.reset``)."""
    tools: list[Any]
    """The episode's tools (``areal_agents.tools.tool.Tool``), bound to this episode's state."""
    base_url: str
    api_key: str
    model: str
    info: dict[str, Any] = field(default_factory=dict)
    session_id: str | None = None
    """The proxy session that records this episode."""
    group_id: str | None = None
    """The group (the episodes sampled for the same task) this episode belongs to."""
    task_id: str | None = None
    """The env's task id (from its reset info), when it gives one."""

    def openai_client(self, **kwargs: Any) -> Any:
        return AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)


@dataclass
class EpisodeResult:
    """One finished episode: the recorded trajectory plus how it went."""

    episode: Episode
    reward: float
    """Sum of the per-turn rewards plus the final reward."""
    success: bool | None
    turns: int
    end_reason: str
    """"terminated", "truncated", or a rollout error kind."""
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    duration_s: float = 0.0
    tool_calls: int | None = None
    """Tool calls the env ran (env-driven episodes; None when the agent ran its own tools)."""
    tool_errors: int | None = None
    """Those of them whose result was an error (``info["tool_results"][i]["error"]``)."""

    @property
    def ok(self) -> bool:
        return self.end_reason in ("terminated", "truncated")

    @property
    def output_tokens(self) -> int:
        return sum(len(c.output_ids) for c in self.episode.completions)


class Runner:
    """Runs episodes through a :class:`Proxy`.

    ``base_url`` (the proxy's HTTP ``/v1`` URL) is needed only for agent-driven episodes, since
    agents talk HTTP; env-driven episodes call the proxy in-process (the same code path as
    ``POST /v1/chat/completions``, without a socket).

    ``sampling`` (temperature, top_p, top_k, max_tokens) goes into every env-driven model
    call; ``sampling_by_kind`` overrides it per task kind, matched against the ``kind`` of
    the env's reset info (``{"arithmetic": {"temperature": 1.0}}``). Each completion records
    the sampling it was made with, which the trainer scores it at. In agent-driven episodes
    the same values are the session's defaults: the agent's calls sample as they ask, and
    what they leave unset (no ``temperature``, say) comes from here.
    """

    def __init__(
        self,
        proxy: Proxy,
        *,
        base_url: str | None = None,
        concurrency: int = 256,
        max_turns: int = 16,
        episode_timeout_s: float = 600.0,
        sampling: dict[str, Any] | None = None,
        sampling_by_kind: dict[str, dict[str, Any]] | None = None,
        step_in_thread: bool = True,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.proxy = proxy
        self.base_url = base_url
        self.max_turns = max_turns
        self.episode_timeout_s = episode_timeout_s
        self.sampling = dict(sampling or {})
        self.sampling_by_kind = {k: dict(v) for k, v in (sampling_by_kind or {}).items()}
        self.step_in_thread = step_in_thread
        self._slots = asyncio.Semaphore(concurrency)

    # ------------------------------------------------------------------ public
    async def run_group(
        self,
        make_env: EnvFactory,
        n: int,
        *,
        seed: int | None = None,
        options: dict[str, Any] | None = None,
        agent: Any = None,
        group_id: str | None = None,
        sampling_seed: int | None = None,
    ) -> list[EpisodeResult]:
        """``n`` episodes of the same task (same seed and options), concurrently.

        With ``sampling_seed``, episode i samples with seed ``sampling_seed + i`` (see
        :meth:`run_episode`), so a group is reproducible; without it sampling is random.
        """
        gid = group_id or "grp-" + uuid.uuid4().hex[:12]
        return list(
            await asyncio.gather(
                *[
                    self.run_episode(
                        make_env,
                        seed=seed,
                        options=options,
                        agent=agent,
                        group_id=gid,
                        sampling_seed=None if sampling_seed is None else sampling_seed + i,
                    )
                    for i in range(n)
                ]
            )
        )

    async def run_episode(
        self,
        make_env: EnvFactory,
        *,
        seed: int | None = None,
        options: dict[str, Any] | None = None,
        agent: Any = None,
        group_id: str | None = None,
        sampling_seed: int | None = None,
    ) -> EpisodeResult:
        """Run one episode; never raises for failures inside it (see the module docstring).

        ``seed`` and ``options`` go to ``env.reset`` (they pick the task). With
        ``sampling_seed``, the model call of turn t (env-driven) samples with seed
        ``sampling_seed * 1000 + t``, which makes the episode reproducible.
        """
        async with self._slots:
            start = time.perf_counter()
            session = self.proxy.sessions.create(group_id=group_id)
            state: dict[str, Any] = {
                "turns": 0,
                "reward": 0.0,
                "info": {},
                "success": None,
                "sampling_seed": sampling_seed,
            }
            try:
                env = make_env()
            except Exception as exc:
                raise UserError(f"cannot create the environment: {exc!r}") from exc
            recorded = False  # whether the proxy already recorded the failure on the episode
            try:
                drive = self._drive_agent if agent is not None else self._drive_env
                reason = await asyncio.wait_for(
                    drive(env, session, seed, options, agent, state), self.episode_timeout_s
                )
                error = None
            except TimeoutError:
                reason, error = EpisodeTimeout.kind, f"ran past {self.episode_timeout_s} s"
            except RolloutError as exc:
                reason, error = exc.kind, str(exc)
            except ApiError as exc:
                reason = _API_REASONS.get(
                    exc.code or "", "backend_error" if exc.status >= 500 else "bad_request"
                )
                error = exc.message
                recorded = exc.code == "backend_error"  # the proxy recorded it on the episode
            finally:
                _close(env)
            won = state["success"]
            session.episode.metadata.update(
                env=_env_id(env),
                success=None if won is None else bool(won),
                turns=int(state["turns"]),
            )
            if "tool_calls" in state:
                session.episode.metadata.update(
                    tool_calls=state["tool_calls"], tool_errors=state["tool_errors"]
                )
            failure = None if error is None or recorded else {"kind": reason, "message": error}
            self.proxy.sessions.end(session, reason=reason, error=failure)
            self.proxy.sessions.release(session.id)
            ep = session.episode
            reward = sum(c.reward for c in ep.completions) + (ep.final_reward or 0.0)
            return EpisodeResult(
                episode=ep,
                reward=reward,
                success=state["success"],
                turns=state["turns"],
                end_reason=reason,
                error=error,
                info={**state["info"], "task": state.get("task", {})},
                duration_s=time.perf_counter() - start,
                tool_calls=state.get("tool_calls"),
                tool_errors=state.get("tool_errors"),
            )

    # ------------------------------------------------------------------ env-driven
    async def _drive_env(
        self,
        env: Any,
        session: Session,
        seed: int | None,
        options: dict[str, Any] | None,
        agent: Any,
        state: dict[str, Any],
    ) -> str:
        obs, info = await self._reset(env, session, seed, options, state)
        messages = list(obs)
        tools = info.get("tools") or None
        sampling = self._sampling_for(info)
        state_key = info.get("state_key")
        state["tool_calls"] = state["tool_errors"] = 0
        for turn in range(self.max_turns):
            body: dict[str, Any] = {
                "model": self.proxy.model_name,
                "messages": messages,
                **sampling,
            }
            if state["sampling_seed"] is not None:
                body["seed"] = state["sampling_seed"] * 1000 + turn
            if tools:
                body["tools"] = tools
            reply = await self.proxy.complete(session, body)
            message = reply["choices"][0]["message"]
            completion_id = reply["choices"][0]["completion_id"]
            if state_key is not None:  # the state this completion's prompt shows
                keys = session.episode.metadata.setdefault("state_keys", {})
                keys[completion_id] = str(state_key)
            obs, reward, terminated, truncated, info = await self._call_env(
                "step", env.step, message
            )
            state_key = info.get("state_key")
            records = info.get("tool_results") or []
            state["tool_calls"] += len(records)
            state["tool_errors"] += sum(1 for r in records if r.get("error"))
            state["turns"] += 1
            state["info"] = info
            if reward:
                self.proxy.sessions.add_reward(session, float(reward), completion_id=completion_id)
            messages = [*messages, message, *obs]
            if "success" in info:
                state["success"] = bool(info["success"])
            if terminated:
                return "terminated"
            if truncated:
                return "truncated"
        return "truncated"

    # ------------------------------------------------------------------ agent-driven
    async def _drive_agent(
        self,
        env: Any,
        session: Session,
        seed: int | None,
        options: dict[str, Any] | None,
        agent: Any,
        state: dict[str, Any],
    ) -> str:
        if self.base_url is None:
            raise UserError("agent-driven episodes need Runner(base_url=<proxy /v1 URL>)")
        obs, info = await self._reset(env, session, seed, options, state)
        # The agent's calls that set no sampling of their own sample as the run says.
        session.sampling = self._sampling_for(info)
        task = AgentTask(
            messages=list(obs),
            tools=list(env.tools()),
            base_url=self.base_url,
            api_key=session.api_key,
            model=self.proxy.model_name,
            info=info,
            session_id=session.id,
            group_id=session.episode.group_id,
            task_id=session.episode.task_id,
        )
        try:
            run = getattr(agent, "run", agent)
            if _is_async(run):
                result = await run(task)
            else:  # a sync agent blocks: on a thread, so other episodes go on meanwhile
                result = await asyncio.to_thread(run, task)
                if inspect.isawaitable(result):
                    result = await result
        except (RolloutError, ApiError):
            raise
        except Exception as exc:
            raise AgentError(f"the agent raised {exc!r}") from exc
        ep = session.episode
        state["turns"] = len(ep.completions)
        conversation = _conversation(ep, result)
        reward, score_info = await self._call_env("score", env.score, conversation)
        state["info"] = score_info
        state["success"] = score_info.get("success")
        final = float(reward)
        for call_id, value in (score_info.get("tool_rewards") or {}).items():
            try:  # on the completion that made the call, as env-driven
                self.proxy.sessions.add_reward(session, float(value), tool_call_id=call_id)
            except ArealError:  # a call the session did not record: the episode's, then
                final += float(value)
        ep.final_reward = (ep.final_reward or 0.0) + final
        return "terminated"

    def _sampling_for(self, info: dict[str, Any]) -> dict[str, Any]:
        """The run's sampling with the overrides of the task's kind (``info["kind"]``)."""
        return {**self.sampling, **self.sampling_by_kind.get(str(info.get("kind")), {})}

    async def _reset(
        self,
        env: Any,
        session: Session,
        seed: int | None,
        options: dict[str, Any] | None,
        state: dict[str, Any],
    ) -> Any:
        obs, info = await self._call_env("reset", env.reset, seed=seed, options=options)
        session.episode.task_id = str(info.get("task_id")) if info.get("task_id") else None
        state["task"] = {k: v for k, v in info.items() if k != "tools"}
        return obs, info

    async def _call_env(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            if self.step_in_thread:
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(_ENV_POOL, functools.partial(fn, *args, **kwargs))
            return fn(*args, **kwargs)
        except RolloutError:
            raise
        except Exception as exc:
            raise _EnvStepError(f"env.{what} raised {exc!r}") from exc


class _EnvStepError(RolloutError):
    kind = "env_error"


def _is_async(fn: Any) -> bool:
    """A coroutine function (also through ``functools.partial`` or ``__call__``)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004
    )


def _conversation(episode: Episode, result: Any) -> list[dict[str, Any]]:
    """The main branch's conversation: the last completion's request plus its reply."""
    if not episode.completions:
        return [{"role": "assistant", "content": str(result) if result is not None else ""}]
    last = episode.completions[-1]
    return [*last.messages, last.message]


def _env_id(env: Any) -> str | None:
    """The gymnasium id of ``env`` (``env.spec.id``; wrappers pass it on), or None."""
    try:
        spec = getattr(env, "spec", None)
    except Exception:  # a spec that cannot be read is no id
        return None
    env_id = getattr(spec, "id", None)
    return env_id if isinstance(env_id, str) else None


def _close(env: Any) -> None:
    # Closing is best effort: the episode is already recorded.
    with contextlib.suppress(Exception):
        env.close()
