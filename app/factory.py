"""create_app: settings -> gateway -> FastAPI application; the request id, CORS and error counting
middlewares; the log format."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from contextvars import ContextVar
from datetime import UTC, datetime

from fastapi import FastAPI, Request
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.auth import ApiKeyAuth, ApiKeys
from app.body_limit import BodyLimit
from app.build import build_gateway
from app.errors import StoreFailed, error_response, install_error_handlers, to_api_error
from app.gateway import Gateway
from app.malloc_trim import trim_task
from app.metrics import Metrics
from app.readiness import Readiness
from app.routes import package_version, router
from app.settings import Settings
from app.startup import BackgroundStart, stop_server
from scheduler.collection_lease import CollectionLease
from scheduler.lifecycle import PeriodicTask
from scheduler.profile import save as save_profile

REQUEST_ID_HEADER = b"x-request-id"
_SANE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
# set for the task that serves one request; log records made in it carry the id
request_id: ContextVar[str | None] = ContextVar("request_id", default=None)


def create_app(settings: Settings | None = None, gateway: Gateway | None = None) -> FastAPI:
    """Build the app. Without ``gateway``, it is built in the background once the server runs
    (``app/startup.py``): ``/health`` answers at once, the API when the model is loaded."""
    settings = settings or Settings()
    configure_logging(settings.log_level, settings.log_format)
    keys = ApiKeys(  # before the model loads
        settings.api_keys(), settings.shared_cache, settings.metrics_auth, settings.tenant_secret_bytes()
    )
    metrics = gateway.metrics if gateway is not None else Metrics()
    # its own thread: a probe queued behind a burst of chunk fetches on the I/O pool would time out
    # and take a busy gateway out of its load balancer
    probe_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="readiness")
    periodic: list[PeriodicTask] = []  # the allocator's trim, the store's collection

    def attach(built: Gateway) -> None:
        app.state.readiness = Readiness(built.store, probe_pool)
        interval = built.collect_interval_s
        if interval is not None:
            lease = CollectionLease(built.store, built.settings.replica, interval)
            collection = PeriodicTask(lambda: built.collect_if_leased(lease), interval, "store-collector")
            periodic.append(collection)
            collection.start()
        app.state.gateway = built  # last: requests are served from here on

    starter = None
    if gateway is None:
        starter = BackgroundStart(lambda: build_gateway(settings, metrics), attach, lambda: stop_server(app))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        adopt_server_loggers()
        periodic.clear()  # a thread starts once: each run of the lifespan makes its own
        trim = trim_task(settings, metrics.record_malloc_trim)
        if trim is not None:
            periodic.append(trim)
            trim.start()
        if starter is not None:
            starter.start()
        else:
            attach(gateway)
        yield
        for task in periodic:
            task.stop()
        probe_pool.shutdown(wait=False, cancel_futures=True)
        built = app.state.gateway
        if built is not None:
            shut_down(built)

    docs = not settings.disable_docs
    app = FastAPI(
        title="CacheGen gateway",
        version=package_version(),
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.gateway = None
    app.state.readiness = None
    app.state.metrics = metrics
    app.state.startup = starter
    install_error_handlers(app)
    app.include_router(router)

    # innermost first: a refused key or body is counted as an error, and carries the request id
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    if keys.enabled:
        app.add_middleware(ApiKeyAuth, keys=keys)
    app.add_middleware(ErrorCounter, metrics=metrics)
    if settings.cors_origins:
        # outside ErrorCounter, so its 500s carry the CORS headers too and a browser can read them
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["x-request-id", "retry-after"],
        )
    app.add_middleware(RequestId)  # outermost: the error lines and the 500s below carry the id
    return app


def shut_down(gateway: Gateway) -> None:
    """Stop the gateway's threads and pools, close the store, keep the cost profile."""
    gateway.admission.shutdown()
    gateway.executor.pool.shutdown(wait=False, cancel_futures=True)
    gateway.loop.stop()
    if gateway.executor.write_back is not None:
        gateway.executor.write_back.shutdown()
    gateway.io_pool.shutdown(wait=False, cancel_futures=True)
    gateway.store.close()
    save_profile(gateway.executor.loader.profile, gateway.profile_file)


# Plain ASGI middlewares: Starlette's ``BaseHTTPMiddleware`` would hide a client's disconnect from
# the routes, and non-streaming requests are cancelled on it.


class RequestId:
    """Gives each request an id (the client's ``x-request-id`` when it is sane, else a new one),
    echoes it in the response's ``x-request-id`` header, and sets it for the request's log lines."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = dict(scope["headers"]).get(REQUEST_ID_HEADER, b"").decode("latin-1")
        rid = sent if _SANE_REQUEST_ID.fullmatch(sent) else uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID_HEADER]
                message = {**message, "headers": [*headers, (REQUEST_ID_HEADER, rid.encode())]}
            await send(message)

        token = request_id.set(rid)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id.reset(token)


class ErrorCounter:
    """Counts error responses by status and by the error object's code (else its type), and answers
    an exception that escaped every handler with a 500 error object: logged once, with its
    traceback, and counted (``ServerErrorMiddleware`` would re-raise it to uvicorn, which prints
    it again, outside the request)."""

    MAX_ERROR_BODY = 65536

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0
        body = b""

        async def counting_send(message: Message) -> None:
            nonlocal status, body
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status >= 400:
                body = (body + message.get("body", b""))[: self.MAX_ERROR_BODY]
                if not message.get("more_body", False):
                    self.metrics.http_errors.labels(str(status), _error_code(body)).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except asyncio.CancelledError:
            # uvicorn cancels what is still running when the shutdown grace is over: answer with a 503
            # when nothing was sent yet, and end the request here rather than log it as a crash
            if status == 0:
                await error_response(ShuttingDown())(scope, receive, counting_send)
        except Exception as exc:  # noqa: BLE001 - the last place to answer it as an error object
            err = to_api_error(exc, Request(scope))
            if status == 0:  # nothing sent yet
                await error_response(err)(scope, receive, counting_send)


class ShuttingDown(StoreFailed):
    def __init__(self) -> None:
        super().__init__(
            "the gateway is shutting down and its grace period (CACHEGEN_SHUTDOWN_GRACE_S) is over; retry",
            code="shutting_down",
        )


def _error_code(body: bytes) -> str:
    try:
        error = json.loads(body)["error"]
        return str(error.get("code") or error.get("type") or "none")
    except (ValueError, KeyError, TypeError, AttributeError):
        return "none"


# -- logging ----------------------------------------------------------------------------------------


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s%(request_tag)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        rid = getattr(record, "request_id", None)
        record.request_tag = f" [{rid}]" if rid else ""
        return super().format(record)


# attributes every record has; whatever else a record carries came in ``extra`` and is logged too
_RECORD_FIELDS = {*vars(logging.makeLogRecord({})), "message", "asctime", "request_tag", "color_message"}


class JSONFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request_id, the record's extras,
    and the traceback (``exc_info``) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update({k: v for k, v in vars(record).items() if k not in _RECORD_FIELDS and v is not None})
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(level: str, fmt: str) -> None:
    """The root logger's one handler, in ``fmt`` ('text' or 'json'), with each record's request id."""
    handler = logging.StreamHandler()
    handler.addFilter(_RequestIdFilter())
    handler.setFormatter(JSONFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    if fmt == "json":
        # every line on stderr is then a record: warnings too, and no progress bars
        logging.captureWarnings(True)
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


def adopt_server_loggers() -> None:
    """uvicorn gives its loggers handlers of their own when it starts, after ``create_app``; at the
    app's startup their records are sent to the root handler instead, in the configured format."""
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        for old in logger.handlers[:]:
            logger.removeHandler(old)
        logger.propagate = True
