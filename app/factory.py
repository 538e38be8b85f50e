"""create_app: settings -> gateway -> FastAPI application."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response

from app.errors import install_error_handlers
from app.gateway import Gateway, build_gateway
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

    @app.middleware("http")
    async def count_errors(request: Request, call_next):  # type: ignore[no-untyped-def]
        response: Response = await call_next(request)
        if response.status_code >= 400:
            gateway.metrics.http_errors.labels(str(response.status_code)).inc()
        return response

    return app
