"""Request bodies checked before anything is parsed or stored.

Every JSON body the proxy reads goes through :func:`parse_body`: over
:attr:`RequestLimits.max_body_bytes` it is a 413 (refused as soon as that is known, before
the rest arrives); nested deeper than :attr:`RequestLimits.max_depth`, a lone UTF-16
surrogate in any string or key, ``NaN`` or ``Infinity``, or an integer outside 64 bits, a
400 naming the field (:func:`load_json`, :func:`check_json`); a body that does not match
its model, a 400 naming each field (:func:`validate`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from areal_agents.serve.api_error import ApiError, validation_error
from areal_agents.serve.schemas import (
    INT64_MAX,
    INT64_MIN,
    MAX_JSON_DEPTH,
    ChatCompletionRequest,
    json_text_depth,
)

M = TypeVar("M", bound=BaseModel)


@dataclass
class RequestLimits:
    """What a request body may be, checked before anything is parsed into a model or
    stored: beyond ``max_body_bytes`` a 413; nested deeper than ``max_depth``, a lone UTF-16
    surrogate in any string or key, a non-finite number (``NaN``, ``Infinity``, ``1e999``)
    or an integer outside the signed 64-bit range, a 400 naming the field. Change them on
    a proxy as ``proxy.limits.max_body_bytes = ...``."""

    max_body_bytes: int = 8 * 2**20
    max_depth: int = MAX_JSON_DEPTH


def request_limits(request: Request) -> RequestLimits:
    """The limits of the app serving ``request`` (the defaults if it has none)."""
    limits = getattr(request.app.state, "request_limits", None)
    return limits if isinstance(limits, RequestLimits) else RequestLimits()


async def parse_body(request: Request, model: type[M], *, allow_empty: bool = False) -> M:
    """The request's JSON body as ``model``; a 413 or a 400 naming the field for anything
    the proxy does not take (see :class:`RequestLimits` and :func:`check_json`)."""
    limits = request_limits(request)
    raw = await read_body(request, limits.max_body_bytes)
    if not raw.strip():
        if allow_empty:
            return model()
        raise ApiError(400, "the request body is empty; send a JSON object")
    data = load_json(raw, max_depth=limits.max_depth)
    if not isinstance(data, dict):
        raise ApiError(400, f"expected a JSON object, got {type(data).__name__}")
    return validate(data, model)


def validate(data: dict[str, Any], model: type[M] = ChatCompletionRequest) -> M:  # type: ignore[assignment]
    """``data`` as ``model`` (a chat completion request by default); a 400 naming each field
    that does not match."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False)) from None
    except RecursionError:  # an in-process caller's value nested too deeply
        raise ApiError(
            400, f"the request nests deeper than {MAX_JSON_DEPTH} levels; send flatter data"
        ) from None


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with a 413 as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
    except ClientDisconnect:  # gone before its body arrived: nobody to answer
        raise ApiError(499, "the client closed the connection", code="client_closed") from None
    raw = b"".join(chunks)
    request._body = raw  # what Request.body() returns from now on
    return raw


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request body has {size}+ bytes, over this proxy's limit of {limit} bytes; "
        "send a shorter conversation (or raise Proxy.limits.max_body_bytes)",
        code="request_too_large",
    )


def _refuse_constant(name: str) -> Any:
    raise ApiError(
        400,
        f"the request body holds {name}, which is not a JSON number; send a finite number "
        "(or null)",
    )


_PARSE_DEPTH = 400
"""The deepest body that is parsed before its depth is checked (with its field's name)."""


def load_json(raw: bytes | str, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse a request body, checked by :func:`check_json`; a 400 saying what is wrong."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not UTF-8: {exc}") from None
    # Far too deep for json.loads, which recurses once per level: refused unparsed. Less
    # deep bodies are parsed, and check_json names the field that nests too deeply.
    scan = max(max_depth, _PARSE_DEPTH)
    if text.count("[") + text.count("{") > scan and (depth := json_text_depth(text)) > scan:
        raise ApiError(
            400,
            f"the request body nests objects and arrays {depth} levels deep, over the limit "
            f"of {max_depth}; send flatter data",
            code="too_deep",
        )
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise ApiError(
            400, f"the request body nests deeper than {max_depth} levels; send flatter data"
        ) from None
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    check_json(data, max_depth=max_depth)
    return data


def check_json(value: Any, *, max_depth: int = MAX_JSON_DEPTH, where: str = "") -> None:
    """Refuse (a 400 naming the field) what cannot be stored and read back as JSON: nesting
    deeper than ``max_depth``, lone surrogates in strings and keys, non-finite floats and
    integers outside the signed 64-bit range. Iterative: any depth is safe to check."""
    stack: list[tuple[Any, int, tuple[Any, ...]]] = [(value, 0, ())]
    while stack:
        item, depth, path = stack.pop()
        kind = type(item)
        if kind is str:
            _check_text(item, path, where)
        elif kind is dict or kind is list:
            if depth >= max_depth:
                raise ApiError(
                    400,
                    f"{_field(path, where)}: nests objects and arrays deeper than {max_depth} "
                    "levels; send flatter data",
                    param=_field(path, where),
                    code="too_deep",
                )
            if kind is dict:
                for key, child in item.items():
                    _check_text(key, (*path, key), where, key=True)
                    if type(child) is not str or not child.isascii():
                        stack.append((child, depth + 1, (*path, key)))
            else:
                for index, child in enumerate(item):
                    if type(child) is not str or not child.isascii():
                        stack.append((child, depth + 1, (*path, index)))
        elif kind is int:
            if not INT64_MIN <= item <= INT64_MAX:
                raise ApiError(
                    400,
                    f"{_field(path, where)}: the integer {_short_int(item)} is out of range; "
                    "integers must fit in 64 bits (-2**63 to 2**63 - 1)",
                    param=_field(path, where),
                )
        elif kind is float and not math.isfinite(item):
            raise ApiError(
                400,
                f"{_field(path, where)}: {item} is not a finite number; send a finite number",
                param=_field(path, where),
            )


def _check_text(text: str, path: tuple[Any, ...], where: str, *, key: bool = False) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        what = "key" if key else "string"
        bad = text[exc.start]
        raise ApiError(
            400,
            f"{_field(path, where)}: the {what} holds a lone UTF-16 surrogate "
            f"({bad.encode('unicode_escape').decode()!s} at character {exc.start}), which "
            "is not Unicode text; send valid UTF-8 (binary data as base64)",
            param=_field(path, where),
            code="invalid_unicode",
        ) from None


def _field(path: tuple[Any, ...], where: str) -> str:
    parts: list[str | int] = [where] if where else []
    parts += [
        p if isinstance(p, int) else p.encode("ascii", "backslashreplace").decode() for p in path
    ]
    return ".".join(str(p) for p in parts) or "body"


def _short_int(n: int) -> str:
    digits = len(str(abs(n))) if abs(n) < 10**4000 else 4000
    return str(n) if digits <= 30 else f"of {digits}+ digits"
