"""Start-up in the background: the server answers at once, and serves requests once the gateway is built.

Building the gateway takes seconds (the model, its content digest, the codec's
compile, the cost profile: see the ``start-up:`` log lines). Meanwhile the
server already listens, as vLLM's does: ``GET /health`` answers 200 with
``"status": "loading"``, ``GET /ready`` 503, and every other route a 503
``model_loading`` error with ``Retry-After``. A build that fails is logged and
stops the server (``app.state.stop_server``, else SIGTERM), which then exits 1
(``python -m app``).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable

from app.errors import APIError
from app.gateway import Gateway

log = logging.getLogger(__name__)


class ModelLoading(APIError):
    status = 503
    type = "server_error"
    code = "model_loading"
    headers = {"Retry-After": "5"}  # noqa: RUF012 - as the other errors' headers

    def __init__(self) -> None:
        super().__init__(
            "the gateway is starting: the model is loading; retry shortly (GET /ready says when)"
        )


def stop_server(app) -> None:
    """Ask the server that runs ``app`` to shut down: through ``app.state.stop_server`` where the
    runner set one (``python -m app``), else as SIGTERM would."""
    stop = getattr(app.state, "stop_server", None)
    if stop is not None:
        stop()
    else:
        os.kill(os.getpid(), signal.SIGTERM)


class BackgroundStart:
    """Runs ``build`` on its own thread; ``on_ready`` gets the gateway, on that thread."""

    def __init__(
        self, build: Callable[[], Gateway], on_ready: Callable[[Gateway], None], stop: Callable[[], None]
    ) -> None:
        self._build = build
        self._on_ready = on_ready
        self._stop = stop
        self.error: str | None = None  # one line, when the build failed
        self._thread = threading.Thread(target=self._run, name="startup", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        from app.cli import failure_line

        try:
            gateway = self._build()
        except Exception as exc:  # every failure stops the server, with its reason
            line = failure_line(exc)
            if line is None:
                log.exception("start-up failed")
                line = f"start-up failed: {type(exc).__name__}: {exc}"
            else:
                log.error("start-up failed: %s", line)
            self.error = line
            self._stop()
            return
        self._on_ready(gateway)
