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
- **Hits attach.** A hit on a finished request's buffer that holds the whole
  new request takes the buffer over (``take``): the run keeps only the hit's
  blocks, since the new request writes after them. Otherwise (the buffer is
  too small, or still in use, by its own request or by others that attached
  it) the request *shares* the hit: its attention reads the hit's tokens
  where they are (``Hit.parts``, ``engine.ragged.Segment.shared``), and its
  own buffer holds only what comes after them. The hit stays pinned while the
  request runs, so its memory is never freed under a reader.
- **Runs on runs.** A sharing request publishes its own buffer as a run whose
  ``parent`` is the hit's run: the run's KV is its parent's first ``offset``
  tokens, then its own buffer. It lists only its own blocks, and pins its
  parent for as long as it lives, so a parent is evicted only after its
  children. A hit on it attaches every part (``parts``); chains are kept
  short (``MAX_PARTS``): past that a hit is copied into a buffer of its own.
- **Dropping a run in use.** A run that should go (it expired, its context was
  deleted, other runs cover it) while requests still read it is unlisted at
  once and freed when the last of them lets go (``unpin`` returns its bytes).
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

from engine.kv_pool import BLOCK_TOKENS  # a cached block is a block of the KV pool
from scheduler.tenancy import KeySpace

MAX_PARTS = 4  # a hit whose KV lies in more buffers than this is copied instead of shared


@dataclass(eq=False)
class CachedRun:
    """One buffer's computed KV: its first ``tokens`` tokens, blocks ``keys``.

    With a ``parent``, the first ``offset`` tokens are the parent's and the buffer
    holds the tokens after them, from its index 0.
    """

    kv: torch.Tensor  # (layers, 2, kv_heads, capacity, head_dim)
    keys: list[bytes]  # every block's key, the parent's too
    nbytes: int  # the KV memory the buffer holds
    distortion: float = 0.0  # the worst quality loss of its KV (0: equal to a full prefill's)
    # loaded from stored chunks: the store's first chunk key, and when the earliest of those expires
    # (a context deleted or expired on this gateway is not served from memory either)
    store_key: str | None = None
    expires: float | None = None
    owned: bool = True  # still its request's: not evictable, and its memory is not the cache's
    pins: int = 0  # readers: requests that attached it, runs built on it, a lookup's caller
    parent: CachedRun | None = None
    offset: int = 0  # tokens that are the parent's: a multiple of BLOCK_TOKENS
    doomed: bool = False  # unlisted; freed when the last reader unpins it

    @property
    def tokens(self) -> int:
        return len(self.keys) * BLOCK_TOKENS

    @property
    def own_keys(self) -> list[bytes]:
        """The keys of the blocks in this run's own buffer."""
        return self.keys[self.offset // BLOCK_TOKENS :]

    @property
    def capacity(self) -> int:
        """The tokens this run can hold: the parent's, then its buffer's."""
        return self.offset + self.kv.shape[3]


def parts(run: CachedRun, tokens: int) -> list[torch.Tensor]:
    """The KV of ``run``'s first ``tokens`` tokens, in order, where it lies: a view per buffer,
    each (layers, 2, kv_heads, tokens, head_dim)."""
    if run.parent is not None and tokens <= run.offset:
        return parts(run.parent, tokens)
    if run.parent is None:
        return [run.kv[:, :, :, :tokens]]
    return parts(run.parent, run.offset) + [run.kv[:, :, :, : tokens - run.offset]]


@dataclass
class CacheStats:
    hit_tokens: int = 0
    evicted_runs: int = 0
    copied_tokens: int = 0  # hits copied into a request's buffer (counted by the reader)


@dataclass(frozen=True)
class Hit:
    run: CachedRun
    tokens: int

    def parts(self) -> list[torch.Tensor]:
        """The hit's KV where it lies (see ``parts``)."""
        return parts(self.run, self.tokens)


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
        quality than ``max_distortion`` (0: exact only); pinned: ``take`` or ``unpin`` it."""
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
            if run.owned or run.pins != 1 or run.capacity < capacity:
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

    def count_copy(self, tokens: int) -> None:
        """A reader copied ``tokens`` of a hit into its own buffer instead of attaching them."""
        with self._lock:
            self.stats.copied_tokens += tokens

    def unpin(self, hit: Hit) -> int:
        """The caller is done reading ``hit``; returns the bytes to release now (a run dropped
        while it was read is freed by its last reader)."""
        with self._lock:
            return self._unpin(hit.run)

    def publish(
        self,
        kv: torch.Tensor,
        token_ids: Sequence[int],
        nbytes: int,
        space: KeySpace,
        distortion: float = 0.0,
        store_key: str | None = None,
        expires: float | None = None,
        parent: Hit | None = None,
    ) -> CachedRun:
        """Make the blocks of ``token_ids``' KV findable; the request still owns it. Without
        ``parent``, ``kv`` holds all of it; with it, ``kv`` holds what comes after ``parent``'s
        tokens (the request attached that hit), and the new run pins the hit's run."""
        run = CachedRun(kv, self.block_keys(token_ids, space), nbytes, distortion, store_key, expires)
        with self._lock:
            if parent is not None:
                run.parent, run.offset = parent.run, parent.tokens
                parent.run.pins += 1
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
                return self._discard(run)
            known = len(run.keys)
            run.keys = keys
            self._register(run, known)
            if not self._indexed(run):  # other runs cover all of it: nothing to keep it for
                return self._discard(run)
            return 0

    def forget(self, store_key: str) -> int:
        """A stored context that starts at chunk ``store_key`` was deleted: KV loaded from it is not
        served again. Returns the bytes of the unused runs dropped now (to release); runs still in
        use are dropped when their requests finish."""
        freed = 0
        with self._lock:
            for run in [r for r in self._runs if r.store_key == store_key]:
                run.expires = 0.0
                if not run.owned:
                    freed += self._discard(run)
        return freed

    def reclaim(self, needed: int) -> int:
        """Evict unused runs, least recently used first, until ``needed`` bytes are freed (or
        none is left); returns the bytes freed."""
        freed = 0
        with self._lock:
            progress = True
            while freed < needed and progress:  # a run freed may unpin its parent: go round again
                progress = False
                for run in list(self._runs):
                    if freed >= needed:
                        break
                    if run.owned or run.pins or run not in self._runs:
                        continue
                    freed += self._drop(run)
                    self.stats.evicted_runs += 1
                    progress = True
        return freed

    # -- under the lock --------------------------------------------------------------------------

    def _register(self, run: CachedRun, first: int) -> None:
        """List the run among the holders of its own blocks from block ``first`` on. Any holder of
        block *i* holds the whole prefix up to it (the keys chain, through its parents), so a
        lookup attaches the run that holds its last matched block."""
        for key in run.keys[max(first, run.offset // BLOCK_TOKENS) :]:
            self._index.setdefault(key, []).append(run)

    def _indexed(self, run: CachedRun) -> bool:
        """Whether the run holds a block that no run of at least its quality holds too."""
        return any(
            not any(r is not run and r.distortion <= run.distortion for r in self._index.get(key, ()))
            for key in reversed(run.own_keys)
        )

    def _discard(self, run: CachedRun) -> int:
        """Drop ``run`` now, or when its last reader unpins it; returns the bytes freed now."""
        if run.pins:
            run.doomed = True
            for key in run.own_keys:
                self._unlist(key, run)
            return 0
        return self._drop(run)

    def _unpin(self, run: CachedRun) -> int:
        run.pins -= 1
        assert run.pins >= 0, "a cached run was unpinned more often than pinned"
        expired = run.expires is not None and time.time() >= run.expires
        if run.pins or run.owned or not (run.doomed or expired) or run not in self._runs:
            return 0
        return self._drop(run)

    def _drop(self, run: CachedRun) -> int:
        """Forget an unpinned run; returns its bytes, and those of parents this frees."""
        self._runs.pop(run, None)
        for key in run.own_keys:
            self._unlist(key, run)
        freed = run.nbytes
        if run.parent is not None:
            freed += self._unpin(run.parent)
        return freed

    def _unlist(self, key: bytes, run: CachedRun) -> None:
        holders = self._index.get(key)
        if holders is None:
            return
        holders[:] = [r for r in holders if r is not run]
        if not holders:
            del self._index[key]
