"""Computed KV kept in memory after a request, for the next request that starts with the same tokens.

The store holds encoded chunks of 256 tokens; this holds what the model
already computed or decoded, exactly, in 16-token blocks: a second question
on a context, the same request again, the next turn of a chat (its prompt
starts with the last turn's prompt and reply) and the other choices of an
``n`` > 1 request find their prefix here, with no fetch, no decode and no
prefill of those tokens.

- **Keys.** Block *i*'s key is ``sha256(key[i-1] || its 16 token ids)``,
  rooted in the same salted root as the store's chunk keys
  (``scheduler.prefix.chain_root``): requests of different tenants or salts
  never hit each other's blocks, and a hit proves the whole prefix equal.
- **Runs.** A request publishes its buffer when its prompt is done (then
  other requests can hit it while it still generates) and extends it with
  the tokens it generated when it finishes. From then on the buffer's KV
  memory is the cache's: unused runs are evicted least recently used first
  when a reservation does not fit (``KVMemory``'s reclaim), so cached KV
  never makes a request wait that it could otherwise run.
- **Hits attach, or copy.** A request reads and writes one contiguous buffer
  (what the attention path reads). A hit on a finished request's buffer that
  holds the whole new request takes the buffer over (``take``): no copy; the
  run keeps only the hit's blocks, since the new request writes after them.
  Otherwise (the buffer is too small, or still in use) the hit's tokens are
  copied into the request's own buffer, pinned meanwhile: 80-130 ms for 3.6K
  tokens of the default model in fp32 on one core, most of it first-touch
  page faults of the fresh buffer.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from scheduler.tenancy import KeySpace

BLOCK_TOKENS = 16


@dataclass(eq=False)
class CachedRun:
    """One buffer's computed KV: its first ``tokens`` tokens, blocks ``keys``."""

    kv: torch.Tensor  # (layers, 2, kv_heads, capacity, head_dim)
    keys: list[bytes]
    nbytes: int  # the KV memory the buffer holds
    distortion: float = 0.0  # the worst quality loss of its KV (0: equal to a full prefill's)
    # loaded from stored chunks: the store's first chunk key, and when the earliest of those expires
    # (a context deleted or expired on this gateway is not served from memory either)
    store_key: str | None = None
    expires: float | None = None
    owned: bool = True  # still its request's: not evictable, and its memory is not the cache's
    pins: int = 0

    @property
    def tokens(self) -> int:
        return len(self.keys) * BLOCK_TOKENS


@dataclass
class CacheStats:
    hit_tokens: int = 0
    evicted_runs: int = 0


@dataclass(frozen=True)
class Hit:
    run: CachedRun
    tokens: int


@dataclass
class PrefixCache:
    root: Callable[[KeySpace], bytes]  # the key chain's root for a key space
    _runs: OrderedDict[CachedRun, None] = field(default_factory=OrderedDict)  # least recent first
    # block key -> the runs that hold it, newest last (one block may be in many runs' prefixes)
    _index: dict[bytes, list[CachedRun]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    stats: CacheStats = field(default_factory=CacheStats)

    def block_keys(self, token_ids: Sequence[int], space: KeySpace) -> list[bytes]:
        """Keys of every full block of ``token_ids``."""
        keys: list[bytes] = []
        previous = self.root(space)
        ids = np.asarray(token_ids, dtype="<u4")
        for start in range(0, len(ids) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
            previous = hashlib.sha256(previous + ids[start : start + BLOCK_TOKENS].tobytes()).digest()
            keys.append(previous)
        return keys

    @property
    def cached_bytes(self) -> int:
        """KV memory the cache holds (runs whose requests have finished)."""
        with self._lock:
            return sum(run.nbytes for run in self._runs if not run.owned)

    # -- requests --------------------------------------------------------------------------------

    def lookup(self, token_ids: Sequence[int], space: KeySpace, max_distortion: float = 0.0) -> Hit | None:
        """The longest run of leading blocks of ``token_ids`` in memory whose KV loses no more
        quality than ``max_distortion`` (0: exact only); pinned (``copy_into`` or ``unpin`` it)."""
        keys = self.block_keys(token_ids, space)
        with self._lock:
            now = time.time()
            matched, run = 0, None
            for key in keys:
                holders = [
                    r
                    for r in self._index.get(key, ())
                    if r.distortion <= max_distortion and (r.expires is None or now < r.expires)
                ]
                if not holders:
                    break
                matched, run = matched + 1, holders[-1]
            if run is None:
                return None
            run.pins += 1
            self._runs.move_to_end(run)
            tokens = matched * BLOCK_TOKENS
            self.stats.hit_tokens += tokens
            return Hit(run, tokens)

    def take(self, hit: Hit, capacity: int) -> CachedRun | None:
        """Hand the hit's buffer to the request that hit it, when nobody else uses it and it holds
        ``capacity`` tokens: the request then writes after the hit's tokens, in place, so the run
        keeps only the blocks of the hit. Not taken (None), the hit stays pinned; taken, the run is
        the request's (``extend`` it when its prompt is done, ``release`` it at the end)."""
        run = hit.run
        with self._lock:
            if run.owned or run.pins != 1 or run.kv.shape[3] < capacity:
                return None
            blocks = hit.tokens // BLOCK_TOKENS
            for key in run.keys[blocks:]:
                self._unlist(key, run)
            run.keys = run.keys[:blocks]
            run.owned, run.pins = True, 0
            return run

    def extend(self, run: CachedRun, token_ids: Sequence[int], space: KeySpace) -> None:
        """``run``'s buffer now holds ``token_ids``' KV (which start with its blocks): list the rest."""
        keys = self.block_keys(token_ids, space)
        with self._lock:
            if keys[: len(run.keys)] != run.keys:
                return
            known, run.keys = len(run.keys), keys
            self._register(run, known)

    def unpin(self, hit: Hit) -> None:
        with self._lock:
            hit.run.pins -= 1

    def publish(
        self,
        kv: torch.Tensor,
        token_ids: Sequence[int],
        nbytes: int,
        space: KeySpace,
        distortion: float = 0.0,
        store_key: str | None = None,
        expires: float | None = None,
    ) -> CachedRun:
        """Make the blocks of ``kv`` (which holds ``token_ids``' KV) findable; the request still owns it."""
        run = CachedRun(kv, self.block_keys(token_ids, space), nbytes, distortion, store_key, expires)
        with self._lock:
            self._runs[run] = None
            self._register(run, 0)
        return run

    def release(self, run: CachedRun, token_ids: Sequence[int] | None, space: KeySpace) -> int:
        """The request is done with ``run``'s buffer, which now holds ``token_ids``' KV (None: the
        buffer cannot be trusted). Returns the bytes to release now: 0 when the cache keeps it."""
        keys = None if token_ids is None else self.block_keys(token_ids, space)
        with self._lock:
            run.owned = False
            expired = run.expires is not None and time.time() >= run.expires
            if keys is None or not keys or expired or keys[: len(run.keys)] != run.keys:
                self._drop(run)
                return run.nbytes
            known = len(run.keys)
            run.keys = keys
            self._register(run, known)
            if not self._indexed(run):  # other runs cover all of it: nothing to keep it for
                self._drop(run)
                return run.nbytes
            return 0

    def forget(self, store_key: str) -> int:
        """A stored context that starts at chunk ``store_key`` was deleted: KV loaded from it is not
        served again. Returns the bytes of the unused runs dropped now (to release); runs still in
        use are dropped when their requests finish."""
        freed = 0
        with self._lock:
            for run in [r for r in self._runs if r.store_key == store_key]:
                run.expires = 0.0
                if not run.owned and not run.pins:
                    self._drop(run)
                    freed += run.nbytes
        return freed

    def reclaim(self, needed: int) -> int:
        """Evict unused runs, least recently used first, until ``needed`` bytes are freed (or
        none is left); returns the bytes freed."""
        freed = 0
        with self._lock:
            for run in list(self._runs):
                if freed >= needed:
                    break
                if run.owned or run.pins:
                    continue
                self._drop(run)
                self.stats.evicted_runs += 1
                freed += run.nbytes
        return freed

    # -- under the lock --------------------------------------------------------------------------

    def _register(self, run: CachedRun, first: int) -> None:
        """List the run among the holders of its blocks from ``first`` on. Any holder of block *i*
        holds the whole prefix up to it (the keys chain), so a lookup copies from the run that
        holds its last matched block."""
        for key in run.keys[first:]:
            self._index.setdefault(key, []).append(run)

    def _indexed(self, run: CachedRun) -> bool:
        """Whether the run holds a block that no run of at least its quality holds too."""
        return any(
            not any(r is not run and r.distortion <= run.distortion for r in self._index.get(key, ()))
            for key in reversed(run.keys)
        )

    def _drop(self, run: CachedRun) -> None:
        self._runs.pop(run, None)
        for key in run.keys:
            self._unlist(key, run)

    def _unlist(self, key: bytes, run: CachedRun) -> None:
        holders = self._index.get(key)
        if holders is None:
            return
        holders[:] = [r for r in holders if r is not run]
        if not holders:
            del self._index[key]
