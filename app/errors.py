"""Every error the API returns, as OpenAI error objects, mapped in one place.

Lower layers raise their own exceptions; ``install_error_handlers`` turns them
into ``{"error": {"message", "type", "param", "code"}}`` with the right status.
"""

from __future__ import annotations

import logging
from typing import ClassVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from scheduler.errors import ContextNotFound, ManifestError
from scheduler.kv_memory import KVMemoryExceeded
from scheduler.step_loop import LoopStopped
from storage import StorageError

log = logging.getLogger(__name__)


class APIError(Exception):
    status = 400
    type = "invalid_request_error"
    code: str | None = None
    headers: ClassVar[dict[str, str] | None] = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class InvalidRequest(APIError):
    pass


class ContextLengthExceeded(APIError):
    code = "context_length_exceeded"


class ModelNotFound(APIError):
    status = 404
    code = "model_not_found"


class NotFound(APIError):
    status = 404
    code = "not_found"


class Overloaded(APIError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"
    headers: ClassVar[dict[str, str]] = {"Retry-After": "1"}


class StoreFailed(APIError):
    status = 503
    type = "server_error"
    code = "kv_store_unavailable"


def error_body(message: str, type_: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _response(exc: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status, headers=exc.headers
    )


def to_api_error(exc: Exception) -> APIError:
    """Map an exception from any layer to the error clients see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextNotFound):
        return NotFound(f"context {exc} not found", param="id", code="context_not_found")
    if isinstance(exc, KVMemoryExceeded):
        return InvalidRequest(str(exc), param="max_tokens", code="kv_memory_exceeded")
    if isinstance(exc, LoopStopped):
        return StoreFailed(str(exc), code="shutting_down")
    if isinstance(exc, ManifestError):
        return StoreFailed(f"stored context is unreadable: {exc}")
    if isinstance(exc, StorageError):
        return StoreFailed(f"KV store error: {exc}")
    log.exception("unhandled error", exc_info=exc)
    err = APIError("internal error")
    err.status, err.type, err.code = 500, "server_error", None
    return err


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    return (f"{param}: {msg}" if param else msg), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return _response(InvalidRequest(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(str(exc.detail))
        err.status = exc.status_code
        err.code = "not_found" if exc.status_code == 404 else None
        return _response(err)

    @app.exception_handler(Exception)
    async def _any(_: Request, exc: Exception) -> JSONResponse:
        return _response(to_api_error(exc))
