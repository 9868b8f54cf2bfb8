"""Gymnasium spaces for chat messages.

An agent env observes a list of OpenAI chat-format messages and acts with one assistant
message. These spaces make ``observation_space.contains(obs)`` and
``action_space.contains(action)`` meaningful; they are not meant for vectorised batching.

    >>> ChatMessages().contains([{"role": "user", "content": "hi"}])
    True
    >>> AssistantMessage().contains({"role": "assistant", "content": "hello"})
    True
    >>> AssistantMessage().contains({"role": "user", "content": "hello"})
    False
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from gymnasium import spaces

__all__ = ["ROLES", "AssistantMessage", "ChatMessages", "is_message", "message_problem"]

ROLES = ("system", "user", "assistant", "tool")
"""The roles a chat message may have."""


def message_problem(message: Any) -> str | None:
    """Describe what makes ``message`` an invalid chat message, or return None."""
    if not isinstance(message, dict):
        return f"expected a message dict, got {type(message).__name__}"
    role = message.get("role")
    if role not in ROLES:
        return f"expected role in {ROLES}, got {role!r}"
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        return f"expected content to be a str or None, got {type(content).__name__}"
    if role == "tool" and not isinstance(message.get("tool_call_id"), str):
        return "a tool message needs a str 'tool_call_id'"
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            return "only assistant messages may have 'tool_calls'"
        if not isinstance(calls, list):
            return f"expected tool_calls to be a list, got {type(calls).__name__}"
    elif content is None and role != "assistant":
        return f"a {role} message needs str content"
    return None


def is_message(message: Any) -> bool:
    """True when ``message`` is a valid chat message dict."""
    return message_problem(message) is None


class _MessageSpace(spaces.Space[Any]):
    """Common parts: no shape, not flattenable, equal to any space of the same type."""

    def __init__(self, seed: int | np.random.Generator | None = None) -> None:
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))


class ChatMessages(_MessageSpace):
    """The space of chat transcripts: lists of chat-format message dicts.

    ``contains`` also accepts a single message dict, so the space can describe either a
    transcript or one message.
    """

    def contains(self, x: Any) -> bool:
        if isinstance(x, dict):
            return is_message(x)
        return isinstance(x, Sequence) and not isinstance(x, str) and all(map(is_message, x))

    def sample(self, mask: Any = None, probability: Any = None) -> list[dict[str, Any]]:
        """A one-message transcript with a random user question (for smoke tests)."""
        a, b = (int(v) for v in self.np_random.integers(0, 100, size=2))
        return [{"role": "user", "content": f"What is {a} + {b}?"}]


class AssistantMessage(_MessageSpace):
    """The action space: one assistant message (a bare str counts as its content)."""

    def contains(self, x: Any) -> bool:
        if isinstance(x, str):
            return True
        return isinstance(x, dict) and x.get("role") == "assistant" and is_message(x)

    def sample(self, mask: Any = None, probability: Any = None) -> dict[str, Any]:
        """A random plain-text assistant answer."""
        return {"role": "assistant", "content": str(int(self.np_random.integers(0, 100)))}
