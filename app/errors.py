"""Every error the API returns, as OpenAI error objects, mapped in one place.

Lower layers raise their own exceptions; ``install_error_handlers`` turns them
into ``{"error": {"message", "type", "param", "code"}}`` with the right status.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.protocol import ErrorResponse
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


class TooManyEncodes(Overloaded):
    """A tenant's pre-encodes in flight are at its limit (``max_encodes_per_tenant``)."""

    headers: ClassVar[dict[str, str]] = {"Retry-After": "5"}  # a pre-encode takes seconds


class StoreFailed(APIError):
    status = 503
    type = "server_error"
    code = "kv_store_unavailable"


# documented on every route, in place of FastAPI's 422 ``HTTPValidationError``, which this API never
# answers: a client generated from /openapi.json must know the shape of the errors it gets
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorResponse, "description": "Invalid request: an OpenAI error object"},
    "5XX": {"model": ErrorResponse, "description": "Server or store error: an OpenAI error object"},
}


def error_body(message: str, type_: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(err.message, err.type, err.param, err.code), status_code=err.status, headers=err.headers
    )


def error_label(err: APIError) -> str:
    """The ``code`` label of ``cachegen:request_errors_total``: the error's code, else its type."""
    return err.code or err.type


def _map(exc: Exception) -> APIError:
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
    err = APIError("internal error")
    err.status, err.type, err.code = 500, "server_error", None
    return err


# what lower layers raise on purpose; anything else is a bug (500, logged with its traceback)
_EXPECTED = (APIError, ContextNotFound, KVMemoryExceeded, LoopStopped, ManifestError, StorageError)


def to_api_error(exc: Exception, request: Request | None = None) -> APIError:
    """Map an exception from any layer to the error clients see, and log it once: one line
    (warning for 4xx, error for 5xx), or the traceback of an unexpected exception."""
    err = _map(exc)
    where = f"{request.method} {request.url.path} " if request is not None else ""
    fields = {"status": err.status, "code": error_label(err)}
    if request is not None:
        fields.update(method=request.method, path=request.url.path)
    if not isinstance(exc, _EXPECTED):
        log.error("%s%d unhandled error: %r", where, err.status, exc, exc_info=exc, extra=fields)
    else:
        level = logging.WARNING if err.status < 500 else logging.ERROR
        log.log(level, "%s%d %s: %s", where, err.status, error_label(err), err.message, extra=fields)
    return err


def error_code(exc: Exception) -> str:
    """The metrics label of an exception, without logging it (``to_api_error`` logs)."""
    return error_label(_map(exc))


def _param(loc: tuple[int | str, ...]) -> str | None:
    """``("messages", 0, "content")`` -> ``messages[0].content``, as OpenAI names nested fields."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    first = errors[0] if errors else {}
    kind = first.get("type")
    loc = tuple(first.get("loc", ()))
    if loc[:1] == ("body",):
        loc = loc[1:]
    if kind == "json_invalid":
        return "request body is not valid JSON", None
    if not loc and kind == "missing":
        return "request body is empty; expected a JSON object", None
    if not loc and kind in ("model_attributes_type", "dict_type"):
        return "request body must be a JSON object", None
    param = _param(loc)
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    return (f"{param}: {msg}" if param else msg), param


def install_error_handlers(app: FastAPI) -> None:
    """Errors the app raises on purpose are answered by Starlette's ``ExceptionMiddleware``, one
    handler per class. A handler for ``Exception`` would run in ``ServerErrorMiddleware``, which
    re-raises after answering, and uvicorn prints the traceback of every 404 and 429.

    Also documents the error object on the routes included after this call (``ERROR_RESPONSES``)."""
    app.router.responses.update(ERROR_RESPONSES)

    async def _expected(request: Request, exc: Exception) -> JSONResponse:
        return error_response(to_api_error(exc, request))

    for cls in _EXPECTED:
        app.add_exception_handler(cls, _expected)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(to_api_error(InvalidRequest(message, param=param), request))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(str(exc.detail))
        err.status = exc.status_code
        err.code = "not_found" if exc.status_code == 404 else None
        response = error_response(to_api_error(err, request))
        response.headers.update(exc.headers or {})  # a 405's Allow
        return response

    @app.exception_handler(Exception)
    async def _any(_: Request, exc: Exception) -> JSONResponse:
        # reached only if an exception escapes ``ErrorCounter`` (app/factory.py)
        return error_response(_map(exc))
