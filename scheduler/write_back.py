"""Write-back on a miss: store the chunks a request had to prefill, in the background.

The request hands over its KV buffer right after its prompt is prefilled.
Decoding writes only after the prompt, never into the chunks stored here, so
the copy and the encoding happen on a background thread, off the model
thread and the request's path. At most ``max_pending`` jobs queue; more are dropped, since a
write-back that falls behind is worth less than a prompt answer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from codec import Level
from scheduler.contexts import ContextStore
from storage import StorageError

log = logging.getLogger(__name__)


class WriteBack:
    def __init__(
        self,
        contexts: ContextStore,
        levels: Sequence[Level],
        on_done: Callable[[str], None] = lambda outcome: None,
        max_pending: int = 2,
        initializer: Callable[[], None] | None = None,
    ) -> None:
        self.contexts = contexts
        self.levels = list(levels)
        self.on_done = on_done  # "stored", "failed" or "dropped", for metrics
        self.max_pending = max_pending
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="write-back", initializer=initializer
        )
        self._pending = 0
        self._lock = threading.Lock()

    def submit(
        self, keys: Sequence[str], kv: torch.Tensor | Sequence[torch.Tensor], first: int, exact: bool
    ) -> None:
        """Store chunks ``first..len(keys)`` of ``kv`` ((layers, 2, heads, tokens, head_dim), or
        such parts in order, joined on the write-back thread). ``exact``: every token before them came
        from exact KV; otherwise their KV carries the loss of a lossy prefix, and lossless levels,
        which readers serve as exact, are not written."""
        levels = self.levels if exact else [lv for lv in self.levels if not lv.lossless]
        with self._lock:
            if self._pending >= self.max_pending or not levels:
                self.on_done("dropped")
                return
            self._pending += 1
        tokens = len(keys) * self.contexts.chunk_size
        parts = [kv] if isinstance(kv, torch.Tensor) else list(kv)
        self._executor.submit(self._store, list(keys), parts, tokens, first, levels)

    def _store(
        self, keys: list[str], parts: list[torch.Tensor], tokens: int, first: int, levels: list[Level]
    ) -> None:
        try:
            pieces, left = [], tokens
            for part in parts:
                pieces.append(part[:, :, :, :left].to("cpu"))
                left -= pieces[-1].shape[3]
            kv = torch.cat(pieces, dim=3)  # a copy: the request's buffers live on
            self.contexts.save_chunks(keys, kv, levels, first=first)
            self.on_done("stored")
        except StorageError as exc:
            log.warning("write-back of %d chunks failed: %s", len(keys) - first, exc)
            self.on_done("failed")
        except Exception:  # a background thread has nobody to raise to
            log.exception("write-back crashed")
            self.on_done("failed")
        finally:
            with self._lock:
                self._pending -= 1

    def drain(self) -> None:
        """Wait for queued jobs (shutdown, tests)."""
        self._executor.submit(lambda: None).result()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
