"""The proxy's error answers: :class:`ApiError`, an error in the OpenAI error format with
its HTTP status (raised to in-process callers too), and the 400 that names each field of a
validation error."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi.responses import JSONResponse

from areal_agents.errors import ArealError


class ApiError(ArealError):
    """An error answered to the client in the OpenAI error format (``status`` is its HTTP
    status; raised by :meth:`Proxy.complete <areal_agents.serve.proxy.Proxy.complete>` to
    in-process callers too)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = (
            status,
            message,
            kind,
            code,
            param,
        )
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


def validation_error(errors: Sequence[Any]) -> ApiError:
    """The 400 for pydantic's (or FastAPI's) validation errors, naming each field."""
    problems = []
    for e in errors:
        loc = [str(p) for p in e.get("loc", ())]
        if loc and loc[0] in ("body", "query", "path", "header"):
            loc = loc[1:] if loc[0] == "body" else loc
        problems.append((".".join(loc) or "body", str(e.get("msg", "invalid"))))
    message = "; ".join(f"{where}: {msg}" for where, msg in problems) or "invalid request"
    param = problems[0][0] if problems else None
    if param and param.split(".")[0] in ("query", "path", "header"):
        param = param.split(".", 1)[-1]
    return ApiError(400, f"invalid request: {message}", param=param)
