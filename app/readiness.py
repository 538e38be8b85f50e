"""GET /ready: whether this gateway can serve now (the model and the KV store), cached a few seconds.

``/health`` says the process serves; ``/ready`` says whether a load balancer should send it
requests. The model is loaded before the app is built, so the store is what can fail: one probe
(``head`` of a key never written) answers None from a store that is up and raises from one that
is not.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any

from storage import ObjectInfo, ObjectStore

log = logging.getLogger(__name__)

PROBE_KEY = "readiness/probe"  # never written
CACHE_S = 5.0
PROBE_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class ReadinessReport:
    model: str  # "ok", else why not
    store: str  # "ok" or "unreachable: <reason>"

    @property
    def ready(self) -> bool:
        return self.model == "ok" and self.store == "ok"

    def body(self) -> dict[str, Any]:
        return {"status": "ready" if self.ready else "not_ready", "model": self.model, "store": self.store}


class Readiness:
    """Probes the store at most once per ``cache_s``; concurrent callers share one probe.

    The probe runs on ``pool``, off the event loop. A probe that has not answered in ``timeout_s``
    reports the store unreachable; it is not started again while it still hangs, so a store that
    stopped answering cannot fill the pool with probes.
    """

    def __init__(
        self,
        store: ObjectStore,
        pool: Executor,
        *,
        cache_s: float = CACHE_S,
        timeout_s: float = PROBE_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.pool = pool
        self.cache_s = cache_s
        self.timeout_s = timeout_s
        self.clock = clock
        self._report: ReadinessReport | None = None
        self._checked_at = 0.0
        self._probe: Future[ObjectInfo | None] | None = None
        self._lock = asyncio.Lock()

    async def report(self) -> ReadinessReport:
        async with self._lock:
            if self._report is None or self.clock() - self._checked_at >= self.cache_s:
                report = ReadinessReport(model="ok", store=await self._probe_store())
                was_ready = self._report.ready if self._report is not None else True
                if report.ready != was_ready:
                    log.warning("readiness: %s (store: %s)", report.body()["status"], report.store)
                self._report, self._checked_at = report, self.clock()
            return self._report

    async def _probe_store(self) -> str:
        if self._probe is None or self._probe.done():
            self._probe = self.pool.submit(self.store.head, PROBE_KEY)
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._probe)), self.timeout_s)
        except TimeoutError:
            return f"unreachable: no answer in {self.timeout_s:g} s"
        except Exception as exc:  # noqa: BLE001 - whatever the store raises, it cannot serve
            return f"unreachable: {exc}"
        return "ok"
