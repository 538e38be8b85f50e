"""Which replica runs the periodic collection over a shared store: one per period, not N.

Every gateway with ``gc_interval_s`` (or a store cap) sweeps the store on a timer. With N replicas
over one store, N sweeps would each LIST the whole store and each enforce the cap. The lease
makes that one: before its sweep, a gateway reads ``gc/lease.json``; while another replica holds
an unexpired lease it skips. Otherwise it writes a lease of its own, waits ``settle_s`` for a
racing writer's PUT to land, and sweeps only if the lease still names it (S3 and the local store
give read-after-write consistency, so the last writer wins and both racers see the same winner).
The holder renews at each of its sweeps; a lease outlives its period by half, so a holder that
died hands over within 1.5 periods.

A lost race is harmless: two sweeps in one period delete the same objects (deletes of missing
objects are no-ops) and evict from the same least-recently-used order. The lease saves the
repeated work and keeps the cap one store-wide pass; it is not what keeps data safe (the grace
period is: ``scheduler/lifecycle.py``).

The lease is bytes from the store, so it is parsed and checked: anything but a small JSON object
with a holder name and an expiry reads as no lease.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from scheduler.layout import COLLECTION_LEASE_KEY
from storage import ObjectNotFound, ObjectStore, ObjectTooLarge

log = logging.getLogger(__name__)

LEASE_LIMIT = 4096  # bytes: a lease is a holder name and a time
SETTLE_S = 0.5


@dataclass(frozen=True)
class Lease:
    holder: str
    until: float  # Unix seconds


def parse_lease(data: bytes) -> Lease | None:
    """The lease in ``data``, or None when it is not one."""
    try:
        record = json.loads(data)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    holder, until = record.get("holder"), record.get("until")
    if not isinstance(holder, str) or not 0 < len(holder) <= 253:
        return None
    if isinstance(until, bool) or not isinstance(until, int | float) or not math.isfinite(until):
        return None
    return Lease(holder, float(until))


class CollectionLease:
    """``acquire()``: whether ``holder`` runs this period's sweep (and, if so, holds the lease)."""

    def __init__(
        self,
        store: ObjectStore,
        holder: str,
        period_s: float,
        *,
        settle_s: float = SETTLE_S,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.store = store
        self.holder = holder
        self.period_s = period_s
        self.settle_s = settle_s
        self._clock = clock
        self._sleep = sleep

    def read(self) -> Lease | None:
        try:
            return parse_lease(self.store.get(COLLECTION_LEASE_KEY, limit=LEASE_LIMIT))
        except ObjectNotFound:
            return None
        except ObjectTooLarge as exc:  # not a lease: one we may overwrite
            log.warning("ignoring the collection lease: %s", exc)
            return None

    def acquire(self) -> bool:
        current = self.read()
        if current is not None and current.holder != self.holder and current.until > self._clock():
            return False
        until = self._clock() + 1.5 * self.period_s
        self.store.put(COLLECTION_LEASE_KEY, json.dumps({"holder": self.holder, "until": until}).encode())
        self._sleep(self.settle_s)
        winner = self.read()
        return winner is not None and winner.holder == self.holder
