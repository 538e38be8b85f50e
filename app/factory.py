"""create_app: settings -> gateway -> FastAPI application."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import install_error_handlers
from app.gateway import Gateway, build_gateway
from app.metrics import Metrics
from app.routes import router
from app.settings import Settings
from scheduler.profile import save as save_profile


def create_app(settings: Settings | None = None, gateway: Gateway | None = None) -> FastAPI:
    """Build the app; the model loads here, before the server accepts requests."""
    settings = settings or Settings()
    gateway = gateway or build_gateway(settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        gateway.admission.shutdown()
        gateway.loop.stop()
        if gateway.executor.write_back is not None:
            gateway.executor.write_back.shutdown()
        gateway.io_pool.shutdown(wait=False, cancel_futures=True)
        gateway.store.close()
        save_profile(gateway.executor.loader.profile, gateway.profile_file)

    app = FastAPI(title="CacheGen gateway", version="0.1.0", lifespan=lifespan)
    app.state.gateway = gateway
    install_error_handlers(app)
    app.include_router(router)

    app.add_middleware(ErrorCounter, metrics=gateway.metrics)
    return app


class ErrorCounter:
    """Counts responses by status >= 400. Plain ASGI: Starlette's ``BaseHTTPMiddleware`` would hide
    a client's disconnect from the routes, and non-streaming requests are cancelled on it."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self.metrics.http_errors.labels(str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
