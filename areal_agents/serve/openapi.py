"""The proxy's OpenAPI document (``GET /openapi.json``): each route's JSON body and its
error answers (:class:`~areal_agents.serve.schemas.ErrorBody`), and no 422s (validation
errors are 400s with the same error body)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from areal_agents.serve.schemas import ErrorBody

_ERROR_TEXT = {
    400: "A malformed request: the message names the field and the fix",
    401: "A missing or wrong API key",
    403: "The key may not do this (another session's key; rewards in a run without self-rewarding)",
    404: "No such session (or task, or stored response)",
    409: "The session has ended, or the call conflicts with its state",
    413: "The request body is over the proxy's size limit",
    429: "No room for a new session (or no task) now: retry after Retry-After seconds",
    502: "The inference engine failed",
    503: "The episode store failed, or the service is shutting down",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI ``responses=`` documenting these error statuses with :class:`ErrorBody`."""
    return {s: {"model": ErrorBody, "description": _ERROR_TEXT[s]} for s in statuses}


def json_body(app: FastAPI, model: type[BaseModel], *, required: bool = True) -> dict[str, Any]:
    """``openapi_extra`` documenting a route's JSON body as ``model``, for routes that read
    the body raw (:func:`~areal_agents.serve.bodies.parse_body`) to answer the proxy's own
    400s."""
    models: dict[str, type[BaseModel]] = getattr(app.state, "body_models", None) or {}
    name = model.__name__
    models[name] = model
    app.state.body_models = models
    app.openapi_schema = None
    schema = {"$ref": f"#/components/schemas/{name}"}
    content = {"application/json": {"schema": schema}}
    return {"openapi_extra": {"requestBody": {"required": required, "content": content}}}


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI document (its description: ``app.description``), with the request
    bodies of :func:`json_body` and no 422 answers (validation errors are 400s with
    :class:`ErrorBody`)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    models: dict[str, type[BaseModel]] = getattr(app.state, "body_models", {})
    refs, defs = models_json_schema(
        [(m, "validation") for m in models.values()],
        ref_template="#/components/schemas/{model}",
    )
    components.update(defs.get("$defs", {}))
    for name, m in models.items():
        ref = refs[(m, "validation")]
        if ref.get("$ref") != f"#/components/schemas/{name}":
            components[name] = ref
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    if not any("ValidationError" in str(op) for op in schema.get("paths", {}).values()):
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
    app.openapi_schema = schema
    return schema
