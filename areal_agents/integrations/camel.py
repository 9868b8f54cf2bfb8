"""CAMEL-AI agents, run unchanged against a proxy session.

A ``camel.agents.ChatAgent`` runs through the proxy when its model backend is CAMEL's
OpenAI-compatible model with the session's ``base_url`` and API key. CAMEL counts tokens
to trim its memory; its default counter downloads a tiktoken file, which fails offline, so
:func:`session_model` gives it an :class:`OfflineTokenCounter`.

Example (``pip install -r requirements/camel.txt``; CAMEL is imported lazily)::

    from camel.agents import ChatAgent
    from areal_agents.integrations.camel import as_function_tools, session_model
    from areal_agents.tools import calculator

    session = proxy.sessions.create()
    agent = ChatAgent(
        "Use the calculator.",
        model=session_model(server.base_url, session.api_key),
        tools=as_function_tools([calculator]),
    )
    response = agent.step("What is 6 * 7?")
    response.msgs[0].content, response.info["tool_calls"]   # what CAMEL saw
    session.episode.completions                              # what the proxy recorded
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from areal_agents.serve.chat import ChatTokenizer, load_tokenizer

if TYPE_CHECKING:
    from camel.models import BaseModelBackend
    from camel.toolkits import FunctionTool

    from areal_agents.tools.tool import Tool

__all__ = ["OfflineTokenCounter", "as_function_tools", "session_model"]


class OfflineTokenCounter:
    """A CAMEL token counter (``camel.utils.BaseTokenCounter``) that needs no download.

    With a tokenizer (a :class:`~areal_agents.serve.chat.ChatTokenizer` or a model directory),
    counts are exact: the token ids the proxy's chat template gives the conversation. Without
    one, a token is a UTF-8 byte of the messages' JSON, an upper bound for byte-level BPE
    tokenizers, so CAMEL's context trimming errs on the safe side.

    ``isinstance(counter, camel.utils.BaseTokenCounter)`` holds once CAMEL is importable (the
    class registers itself as a virtual subclass when first built).

    Args:
        tokenizer: A ``ChatTokenizer``, a tokenizer directory, or ``None`` for byte counts.
    """

    def __init__(self, tokenizer: ChatTokenizer | str | os.PathLike[str] | None = None) -> None:
        self.tokenizer = None if tokenizer is None else load_tokenizer(tokenizer)
        _register_with_camel()

    def count_tokens_from_messages(self, messages: list[Any]) -> int:
        """Tokens of ``messages`` (OpenAI chat messages) as the model would see them."""
        if self.tokenizer is not None:
            try:
                return len(self.tokenizer.encode_chat(messages))
            except (TypeError, ValueError):  # parts the template cannot render: count bytes
                pass
        return len(json.dumps(list(messages), ensure_ascii=False, default=str).encode("utf-8"))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (its UTF-8 bytes without a tokenizer)."""
        if self.tokenizer is not None:
            return self.tokenizer.encode(text)
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``; the inverse of :meth:`encode`."""
        if self.tokenizer is not None:
            return self.tokenizer.decode(token_ids)
        return bytes(token_ids).decode("utf-8", errors="replace")


def session_model(
    base_url: str,
    api_key: str,
    model: str = "default",
    *,
    token_counter: Any = None,
    model_config_dict: Mapping[str, Any] | None = None,
) -> BaseModelBackend:
    """CAMEL's OpenAI-compatible model backend, sending every call to one proxy session.

    Args:
        base_url: The proxy's OpenAI base URL, ending in ``/v1``.
        api_key: The session's API key; it decides which episode records the calls.
        model: The model name sent with each request (the proxy serves one model).
        token_counter: A CAMEL token counter; an :class:`OfflineTokenCounter` by default.
        model_config_dict: Request options CAMEL sends with each call (``temperature``...).
    """
    from camel.models import ModelFactory  # noqa: PLC0415  camel-ai is an optional extra
    from camel.types import ModelPlatformType  # noqa: PLC0415  camel-ai is an optional extra

    return ModelFactory.create(
        model_platform=ModelPlatformType.OPENAI_COMPATIBLE_MODEL,
        model_type=model,
        model_config_dict=dict(model_config_dict or {}),
        token_counter=token_counter if token_counter is not None else OfflineTokenCounter(),
        api_key=api_key,
        url=base_url,
    )


def as_function_tools(tools: Sequence[Tool]) -> list[FunctionTool]:
    """Our tools as CAMEL function tools: same name, description and parameter schema.

    Calling one runs ``Tool.call`` on the model's arguments and gives the model the result's
    content; bad arguments and failures come back as an ``Error: ...`` message the model
    reads, never as an exception.
    """
    from camel.toolkits import FunctionTool  # noqa: PLC0415  camel-ai is an optional extra

    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise TypeError(
            f"expected a list of areal_agents.tools.tool.Tool, got {type(tools).__name__}"
        )
    out = []
    for tool in tools:
        if not all(hasattr(tool, a) for a in ("name", "description", "schema", "call")):
            raise TypeError(f"expected a areal_agents.tools.tool.Tool, got {type(tool).__name__}")
        out.append(FunctionTool(_caller(tool), openai_tool_schema=copy.deepcopy(tool.schema)))
    return out


# ---------------------------------------------------------------------- helpers
def _caller(tool: Tool) -> Any:
    def call(**arguments: Any) -> str:
        return tool.call(arguments).content

    call.__name__ = tool.name
    call.__doc__ = tool.description
    return call


def _register_with_camel() -> None:
    """Make OfflineTokenCounter a virtual subclass of CAMEL's base class (idempotent)."""
    try:
        from camel.utils import BaseTokenCounter  # noqa: PLC0415  camel-ai is an optional extra
    except ImportError:
        return
    BaseTokenCounter.register(OfflineTokenCounter)
