"""What a prefix load is asked for and what it gives back: the request's terms, the target it
writes into, and the per-chunk report (``scheduler.loader.PrefixLoader`` does the loading)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch

from codec import Level


class KVTarget(Protocol):
    """Where a prefix is loaded: the request's KV buffer, and prefill for its text chunks
    (``scheduler.executor.LoopTarget``: on the step loop)."""

    def new_kv(self, tokens: int) -> torch.Tensor: ...

    def start_prefill(
        self, kv: torch.Tensor, start: int, token_ids: list[int], after: Future[bool] | None = None
    ) -> Future[bool]:
        """Prefill ``token_ids`` into ``kv`` after its first ``start`` tokens, without waiting:
        the future is True when it is done, False when the request was cancelled first, or
        raises the prefill's error. With ``after`` (an earlier prefill into ``kv``, whose KV this
        one reads), it starts once that one is done, and is False without running when that one
        was not True."""
        ...


@dataclass(frozen=True)
class KVRequest:
    """How one request may use stored KV."""

    levels: list[Level]  # candidates, best quality first; with ``fixed``, the one named level
    distortion: dict[str, float]  # level name -> quality loss (0 = exact); see planner
    fixed: bool = False  # a level the client named: every chunk at it, never text
    budget_s: float | None = None  # time from the start of the request to its first token
    allow_text: bool = True


@dataclass
class ChunkReport:
    index: int
    tokens: int
    source: str  # "store" or "text"
    level: str | None
    bytes: int = 0
    fetch_ms: float = 0.0  # from issuing the GET to the last byte
    decode_ms: float = 0.0  # decode and placement in the buffer
    prefill_ms: float = 0.0  # text chunks: recompute
    idle_ms: float = 0.0  # the pipeline waited this long for the chunk's bytes
    gate_ms: float = 0.0  # and this long for the codec, busy with other loads' decodes


@dataclass
class PrefixLoad:
    kv: torch.Tensor | None  # (layers, 2, heads, capacity, head_dim) on the model's device
    tokens: int = 0  # the first ``tokens`` of ``kv`` hold the prefix
    chunks: list[ChunkReport] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    exact: bool = True  # every loaded token's KV equals what a full prefill computes
    bandwidth_bps: float | None = None  # bytes per second, the estimate after loading
    planned_s: float | None = None  # the first plan's predicted time to the first token
    memory_tokens: int = 0  # leading tokens from KV in memory, attached (scheduler/prefix_cache.py)
    distortion: float = 0.0  # the worst quality loss among the loaded tokens (0: exact)
    expires: float | None = None  # when the earliest stored chunk loaded expires (None: none does)
    store_key: str | None = None  # the first stored chunk's key, when stored KV was loaded
    bad_chunks: list[str] = field(default_factory=list)  # keys of chunks found missing or corrupt

    @property
    def stored_tokens(self) -> int:
        return sum(c.tokens for c in self.chunks if c.source == "store")
