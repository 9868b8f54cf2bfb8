"""Wire schemas of the proxy's HTTP API (pydantic lives only at this boundary)."""

from __future__ import annotations

import re
from itertools import accumulate
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Role = Literal["system", "developer", "user", "assistant", "tool"]

MAX_JSON_DEPTH = 64
"""How deeply a request body (and a JSON string in it, e.g. tool call arguments) may nest
objects and arrays."""
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""The integers a request body may hold anywhere (signed 64-bit)."""
SEED_MAX = 2**63 - 1
"""The largest ``seed`` (each of ``n`` choices uses ``seed + i``, which must stay below 2**63)."""
TOKENS_MAX = 2**31 - 1
"""The bound of token counts and other engine-side integers (max_tokens, top_k...)."""

_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def json_text_depth(text: str) -> int:
    """How deeply the JSON (or JSON-like) ``text`` nests arrays and objects, without parsing
    it (brackets inside strings do not count): ``json_text_depth('{"a": [1]}') == 2``."""
    if text.count("[") + text.count("{") <= 1:
        return int("[" in text or "{" in text)
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    if not brackets:
        return 0
    return max(0, *accumulate(1 if ch in "[{" else -1 for ch in brackets))


def _check_arguments_depth(arguments: str) -> str:
    if arguments.count("[") + arguments.count("{") <= MAX_JSON_DEPTH:
        return arguments  # cannot nest deeper than the limit
    depth = json_text_depth(arguments)
    if depth > MAX_JSON_DEPTH:
        raise ValueError(
            f"the arguments string nests JSON {depth} levels deep, over the limit of "
            f"{MAX_JSON_DEPTH}; send flatter arguments"
        )
    return arguments


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str | dict[str, Any] = "{}"

    @field_validator("arguments")
    @classmethod
    def _flat_enough(cls, v: str | dict[str, Any]) -> str | dict[str, Any]:
        return _check_arguments_depth(v) if isinstance(v, str) else v


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Role
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _check(self) -> Message:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message with role 'tool' needs the tool_call_id it answers")
        if self.role in ("user", "system", "developer") and self.content is None:
            raise ValueError(f"a message with role {self.role!r} needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages may carry tool_calls")
        if isinstance(self.content, list):
            for part in self.content:
                if part.get("type") != "text":
                    raise ValueError(
                        f"content part of type {part.get('type')!r} is not supported; "
                        "this model takes text parts only"
                    )
        return self


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """The OpenAI chat completion request, with the sampling extras vLLM and SGLang accept."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Any = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=TOKENS_MAX)
    max_tokens: int | None = Field(default=None, ge=1, le=TOKENS_MAX)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=TOKENS_MAX)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=SEED_MAX)
    n: int = Field(default=1, ge=1, le=64)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    stream: bool = False
    stream_options: StreamOptions | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop sequences")
        return v

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.seed is not None and self.seed + self.n - 1 > SEED_MAX:
            raise ValueError(
                f"seed + n - 1 must be below 2**63 (choice i samples with seed + i); "
                f"send a seed of at most {SEED_MAX - self.n + 1}"
            )
        choice = self.tool_choice
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name")
            names = [t.function.name for t in self.tools or []]
            if name not in names:
                raise ValueError(f"tool_choice names {name!r}, which is not in tools {names}")
        elif choice not in (None, "auto", "none", "required"):
            raise ValueError("tool_choice must be 'auto', 'none', 'required' or a function")
        if choice == "required" and not self.tools:
            raise ValueError("tool_choice='required' needs tools")
        return self


class SessionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    group_id: str | None = None
    group: str | None = None
    """The same as ``group_id`` (the name self-rewarded workers use); give one or both equal."""
    task_id: str | None = None
    metadata: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_group(self) -> SessionCreate:
        if self.group is not None and self.group_id is not None and self.group != self.group_id:
            raise ValueError("group and group_id differ; send one of them")
        if self.group_id is None:
            self.group_id = self.group
        return self


class RewardIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    value: float = Field(allow_inf_nan=False)
    completion_id: str | None = None
    tool_call_id: str | None = None
    final: bool = False


class EndIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    final_reward: float | None = Field(default=None, allow_inf_nan=False)
    reason: str | None = None
    error: dict[str, Any] | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    """``invalid_request_error``, ``authentication_error``, ``permission_error``,
    ``not_found_error``, ``conflict_error``, ``rate_limit_error`` or ``server_error``."""
    param: str | None = None
    """The field (dotted path) the error is about, when it is about one."""
    code: str | None = None


class ErrorBody(BaseModel):
    """The body of every error answer (the OpenAI error format)."""

    error: ErrorDetail
