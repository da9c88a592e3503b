"""OpenAI's error object, ``{"error": {"message", "type", "param", "code"}}``, for every failure.

Routes raise :class:`APIError`; :func:`install_error_handlers` turns it, pydantic validation
errors, unknown routes and unexpected exceptions into that shape, so the ``openai`` client maps
them to its exception classes (400 BadRequestError, 401 AuthenticationError, 404 NotFoundError,
429 RateLimitError, ...). Reference: https://platform.openai.com/docs/guides/error-codes
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("localgen.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "server_unavailable_error"}


class APIError(Exception):
    """A request the server answers with ``status`` and OpenAI's error object. ``param`` names
    the request field at fault (dotted path, e.g. ``messages.0.content``); ``code`` is a
    machine-readable reason (``context_length_exceeded``, ``model_not_found``, ...)."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "server_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _loc(loc: tuple) -> str | None:
    """A pydantic location as a dotted field path; union-member and wrapper names dropped."""
    parts = [str(p) for p in loc if isinstance(p, int) or not any(c in str(p) for c in "[]()'")]
    parts = [p for p in parts if p not in ("body", "str", "list", "int", "float", "bool", "dict",
                                          "function-after", "function-plain")]
    return ".".join(parts) or None


def from_validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error as a 400: malformed JSON, a wrong type, a value out of range."""
    errs = exc.errors(include_url=False)
    if not errs:
        return APIError(400, "invalid request body")
    e = errs[0]
    if e["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {e.get('ctx', {}).get('error', e['msg'])}",
                        code="invalid_json")
    param = _loc(tuple(e.get("loc", ())))
    if e["type"] == "missing":
        return APIError(400, f"'{param}' is required", param=param, code="missing_required_parameter")
    got = e.get("input")
    shown = repr(got) if not isinstance(got, (dict, list)) or len(repr(got)) < 80 else type(got).__name__
    more = f" (and {len(errs) - 1} more error{'s' if len(errs) > 2 else ''})" if len(errs) > 1 else ""
    code = "invalid_type" if e["type"].endswith("_type") or e["type"] in (
        "literal_error", "union_tag_invalid", "model_type") else "invalid_value"
    return APIError(400, f"{param or 'body'}: {e['msg']} (got {shown}){more}", param=param, code=code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(ValidationError)
    async def _validation(request: Request, exc: ValidationError):
        return from_validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        msg = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            msg = f"no route {request.method} {request.url.path}"
        return APIError(exc.status_code, msg, code="unknown_url" if exc.status_code == 404 else None,
                        headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        # a bug: logged with its traceback here, reported without internals to the client
        log.exception("unexpected error serving %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}", type="server_error").response()
