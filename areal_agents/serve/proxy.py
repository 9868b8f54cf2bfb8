"""The recording OpenAI-compatible proxy.

Agents call ``POST /v1/chat/completions`` with a per-session API key; the proxy applies the
model's chat template itself, sends the prompt token ids to the engine (token in, token out),
parses tool calls out of the generated text, answers in the OpenAI format (optionally as
server-sent events), and records the call as a :class:`~areal_agents.trajectory.Completion`
of that session's episode. Text is never re-tokenized for training.

HTTP API::

    GET  /health                        engine health, session count (no auth)
    GET  /metrics                       call and error counters (no auth)
    GET  /v1/models                     the served model
    POST /v1/chat/completions           session key (recorded) or admin key (not recorded)
    POST /v1/responses                  the Responses API, recorded the same way (responses.py)
    POST /sessions                      -> {id, api_key, base_url}; admin key if configured
    GET  /sessions/{id}                 summary;            session key or admin key
    POST /sessions/{id}/rewards         {value, completion_id | tool_call_id | final}
    POST /sessions/{id}/end             {final_reward?, reason?, error?}
    GET  /sessions/{id}/trajectory?gamma=G[&prompts=delta][&offset=O&limit=L]
                                        the episode with returns (and, whole and full,
                                        its training samples); ``prompts=delta`` is
                                        O(tokens) for long episodes (Episode.to_dict)
    DELETE /sessions/{id}               forget the session (a store keeps it, marked deleted)

A missing key, or a key that reaches nothing, is the same 401 whether or not the session it
names exists; a session's key asking for another session (existing or not) is a 403; the
admin and privileged keys get a 404 for an unknown session; a malformed body is a 400 whose
message names the field; nothing a client sends produces a 500. Before anything is parsed or
stored, every JSON body is checked against
:class:`~areal_agents.serve.bodies.RequestLimits`: over the size limit a 413; nested deeper
than 64 levels, a lone UTF-16 surrogate in any string or key, ``NaN`` or ``Infinity``, or an
integer outside 64 bits, a 400 naming the field. FastAPI's own validation errors (a query
parameter of the wrong type) are 400s with the same error body, and ``/openapi.json``
documents each route's body and error answers.

Durability (``store``, an :class:`~areal_agents.serve.store.EpisodeStore`): every session,
completion, reward and end is written through to the store, and each request waits until its
records are committed before it is answered (for a stream, before ``[DONE]``), so nothing a
client was told survives only in memory. With ``restore=True`` a session this process does
not hold (a restart, or one evicted after it ended) is loaded from the store on first use of
its key or id: its key works, its trajectory is complete, rewards can still be posted.
``session_idle_s`` ends sessions idle that long as ``expired`` (they stay in the store).

Context that outgrows the window (``context_policy``, a
:class:`~areal_agents.serve.context.ContextPolicy`): by default a prompt of ``max_context`` tokens
or more is a 400 ``context_length_exceeded``; ``truncate_tool_results`` replaces the oldest
tool results by a marker and ``summarize`` has the model summarize the older turns, once a
prompt would not leave ``reserve_tokens`` free. The completion keeps the client's messages
(for its parent link), the edits sent instead and the tokens actually sampled from; see
:mod:`areal_agents.serve.context`.

Calls that do not finish normally:

* A client that disconnects before its answer is ready cancels the call: the engine drops the
  generation and nothing is recorded (``abandoned_calls``). A stream's events go out only
  once it is generated; it is recorded just before ``[DONE]``, so a stream dropped while its
  events are written is not recorded, and one the server finished writing is (as far as
  the server can tell, it was delivered).
* A call still in flight when its session ends (``POST /end``) is answered 409
  (``code: "session_ended"``) and not recorded: what ended an episode is never changed after.
  A call still in flight when its session is deleted (``DELETE``) is answered 409 (``code:
  "session_deleted"``) and not recorded either (``deleted_in_flight``), as is a reward or
  end that reached the session before the ``DELETE``.

Rewards: every reward and final reward must be a finite number, and adding it must keep
finite the completion's summed reward, the episode's final reward, the episode's reward
(their sum) and every return of the trajectory (for any gamma); else the answer is a 400
naming the field (``value`` or ``final_reward``) and nothing changes. A summary or trajectory
that still holds a non-finite number (written to a store by an older version) reads back as
JSON: the number is null and the top-level ``non_finite`` maps its path to ``"Infinity"``,
``"-Infinity"`` or ``"NaN"``.

Key permissions: with ``self_rewarding=True`` (the default, ``areal-agent serve``) a session's
own key may also post rewards to, end and delete its session. With ``self_rewarding=False``
(training, where the environment scores the episode, or ``areal-agent serve
--no-self-rewarding``, where whoever holds the admin key does) a session key may only call
the model and read its session and trajectory; ``/rewards``, ``/end`` and ``DELETE`` then
need the admin key or a privileged key (``privileged_keys``; a self-rewarded run registers
its worker token there; an env-scored run's worker token is not one), and a session key gets
a 403 saying so, so an agent cannot post itself a reward. Privileged keys reach every
session's endpoints, like the admin key, but do not call the model.

Sessions from outside (``session_hooks``): a trainer that trains on whole sessions opened by
a service (self-rewarded training: the service opens a session per episode with a ``group``,
posts its rewards and ends it) plugs a :class:`~areal_agents.serve.core.SessionHooks` in.
``POST /sessions`` then needs the admin key or a privileged key, the hooks may refuse it (429
with ``Retry-After`` while the trainer has no room for a new group, 409 for a group that is
full), and they see each session when it opens and when it ends (``/end``, or ``DELETE``
before ``/end``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from areal_agents.engines.protocol import Engine, accepts_route_key
from areal_agents.serve.chat import ChatTokenizer
from areal_agents.serve.context import ContextPolicy
from areal_agents.serve.core import SessionHooks
from areal_agents.serve.routes import ProxyRoutes
from areal_agents.serve.session import SessionStore

if TYPE_CHECKING:
    from areal_agents.serve.store import EpisodeStore


class Proxy(ProxyRoutes):
    """The proxy: an engine, a tokenizer, the session store and the FastAPI app.

    Built in layers, one module each, every one over the one before:
    :class:`~areal_agents.serve.generation.Generation` (one model call: prompt tokens,
    sampling, the engine, the parsed reply), :class:`~areal_agents.serve.fitting.ContextFitting`
    (the context policy), :class:`~areal_agents.serve.core.ProxyCore` (a call recorded into
    its session, sessions restored, written through and expired) and
    :class:`~areal_agents.serve.routes.ProxyRoutes` (the HTTP app, keys and error answers).
    This class holds the configuration.

    Example::

        proxy = Proxy(engine, ChatTokenizer.from_dir(model_dir))
        session = proxy.sessions.create()
        # serve proxy.app with uvicorn, then point any OpenAI client at
        # base_url=f"{url}/v1", api_key=session.api_key
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: ChatTokenizer,
        *,
        admin_key: str | None = None,
        model_name: str | None = None,
        public_url: str | None = None,
        default_max_tokens: int = 1024,
        self_rewarding: bool = True,
        privileged_keys: Iterable[str] = (),
        session_hooks: SessionHooks | None = None,
        open_sessions: bool = True,
        store: EpisodeStore | None = None,
        restore: bool = True,
        session_idle_s: float | None = None,
        context_policy: ContextPolicy | dict[str, Any] | str | None = None,
    ) -> None:
        if session_idle_s is not None and not session_idle_s > 0:
            raise ValueError(f"session_idle_s must be > 0 or None, got {session_idle_s}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.admin_key = admin_key
        self.self_rewarding = self_rewarding
        self.privileged_keys = {k for k in privileged_keys if k}
        """Keys that may manage any session (rewards, end, delete), like the admin key."""
        self.session_hooks = session_hooks
        self.open_sessions = open_sessions
        """Whether ``POST /sessions`` is open to any caller (without an admin key); else it
        needs the admin key or a privileged key (training: the trainer opens the sessions).
        With session hooks it is never open."""
        self.model_name = model_name or engine.model_name
        self.public_url = public_url.rstrip("/") if public_url else None
        self.default_max_tokens = default_max_tokens
        context = getattr(engine, "max_context", None) or tokenizer.model_max_length or 32768
        self.max_context = int(context)
        self.context_policy = ContextPolicy.of(context_policy)
        """What a request that would outgrow ``max_context`` gets
        (:mod:`areal_agents.serve.context`): the default ``fail`` answers 400
        ``context_length_exceeded``."""
        if bad := self.context_policy.problems(self.max_context):
            raise ValueError("invalid context policy: " + "; ".join(bad))
        self.store = store
        """The durable episode store (None: sessions live in this process only)."""
        self.sessions = SessionStore(store, restore=restore)
        self.session_idle_s = session_idle_s
        """Open sessions idle (no call, reward or read) this long are ended as ``expired``
        (kept in the store); None: never."""
        self._swept = time.monotonic()
        self._routes = accepts_route_key(engine)
        self.counters = Counter()
        self.app = self._build_app(description=__doc__)  # the module docstring
