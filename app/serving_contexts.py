"""POST/GET/DELETE /contexts: pre-encoding contexts into the KV store."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

from app.errors import InvalidRequest
from app.gateway import DISCONNECT_POLL_S, Disconnected, Gateway
from app.protocol import ContextRequest
from codec import Level
from scheduler.contexts import StoredPieces
from scheduler.flag import Flag
from scheduler.manifest import Manifest
from scheduler.tenancy import PUBLIC, KeySpace


def context_object(manifest: Manifest, encoded: bool | None = None) -> dict[str, Any]:
    """The API's context object; ``encoded`` (POST only): whether this call encoded anything."""
    obj: dict[str, Any] = {
        "id": manifest.id,
        "object": "context",
        "model": manifest.model,
        "created": manifest.created,
        "tokens": manifest.tokens,
        "cached_tokens": manifest.cached_tokens,
        "chunks": len(manifest.stored_keys),  # full chunks, and the tail when there is one
        "chunk_size": manifest.chunk_size,
        "bytes": dict(manifest.level_bytes),
        "encode_seconds": manifest.encode_seconds,
        "expires_at": manifest.expires,  # Unix time; null: pinned
    }
    if encoded is not None:
        obj["encoded"] = encoded
        if not encoded:
            obj["encode_seconds"] = 0.0  # no new work; GET /contexts/{id} reports the original encode
    warning = unstored_warning(manifest.tokens, manifest.cached_tokens, manifest.chunk_size)
    if warning is not None:
        obj["warning"] = warning
    return obj


def unstored_warning(tokens: int, stored: int, chunk_size: int) -> str | None:
    """What a client should know when some of a context's tokens have no stored KV."""
    if stored >= tokens:
        return None
    if stored == 0:
        return f"nothing is stored: the context's {tokens} tokens fill no chunk of {chunk_size}"
    return (
        f"only the first {stored} of {tokens} tokens are stored; requests that start with this "
        f"context recompute the last {tokens - stored}"
    )


def stored_tokens(gateway: Gateway, token_ids: list[int]) -> int:
    """How many of ``token_ids`` a save stores: its full chunks, and the tail after them (none
    without a full chunk to hang it on); as ``ContextStore.save`` decides."""
    keys = gateway.contexts.keys(token_ids)
    tail = gateway.contexts.tail(token_ids, keys)
    return len(keys) * gateway.contexts.chunk_size + (0 if tail is None else tail.tokens)


def context_token_ids(gateway: Gateway, request: ContextRequest) -> list[int]:
    if request.text is not None:
        return gateway.text_token_ids(request.text)
    if request.messages is not None:
        # templated as the chat endpoint templates them, minus the generation prompt,
        # so a chat request that starts with these messages shares their tokens
        return gateway.chat_token_ids(request.messages, add_generation_prompt=False)
    assert request.prompt_token_ids is not None
    gateway.check_token_ids(request.prompt_token_ids, "prompt_token_ids")
    return list(request.prompt_token_ids)


class EncodeCancelled(Exception):
    """The client left before its pre-encode was stored; nothing of it was written."""


def encode_tokens(
    gateway: Gateway,
    token_ids: list[int],
    levels: list[Level],
    space: KeySpace,
    ttl_seconds: int | None,
    stored: StoredPieces,
    cancel: threading.Event,
) -> Manifest:
    """Prefill on the step loop, as background work in chunks, then encode and store here what
    ``stored`` lists as missing.

    Runs on an encode thread: the model thread only sees the prefill chunks, so
    running streams keep their pace while a context is pre-encoded. ``cancel``
    stops it while it waits for KV memory, at the next prefill step, or before
    the encode.
    """
    started = time.perf_counter()
    nbytes = gateway.runner.kv_bytes(len(token_ids))
    if not gateway.memory.reserve(nbytes, cancel):
        gateway.metrics.contexts_cancelled.inc()
        raise EncodeCancelled
    try:
        kv = gateway.runner.new_kv(len(token_ids))
        if not gateway.loop.prefill(kv, 0, token_ids, background=True, cancel=cancel) or cancel.is_set():
            gateway.metrics.contexts_cancelled.inc()
            raise EncodeCancelled
        compute_seconds = time.perf_counter() - started
        manifest = gateway.contexts.save(
            token_ids,
            kv,
            levels,
            compute_seconds=compute_seconds,
            space=space,
            ttl_seconds=ttl_seconds,
            stored=stored,
        )
    finally:
        gateway.memory.release(nbytes)
    gateway.metrics.contexts_encoded.inc()
    if gateway.settings.store_max_bytes is not None:
        gateway.collect()  # the new context may take the store over its cap
    return manifest


async def create_context(
    gateway: Gateway,
    request: ContextRequest,
    space: KeySpace = PUBLIC,
    disconnected: Disconnected | None = None,
) -> dict[str, Any] | None:
    """The context object; None when the client left first (its pre-encode is then cancelled)."""
    gateway.check_model(request.model)
    gateway.warn_ignored(request.ignored_fields())
    levels = gateway.encode_levels(request.levels)
    token_ids = context_token_ids(gateway, request)
    gateway.token_budget(len(token_ids), 0, prompt_param=request.source)
    if stored_tokens(gateway, token_ids) == 0:
        chunk_size = gateway.contexts.chunk_size
        raise InvalidRequest(
            f"this context has {len(token_ids)} tokens and would store nothing: KV is stored in chunks "
            f"of {chunk_size} tokens (CACHEGEN_CHUNK_SIZE), and a context needs at least one full chunk",
            param=request.source,
            code="context_too_short",
        )
    # what is stored already (a store that cannot answer fails the request now, not after a prefill)
    stored = await _io(gateway, gateway.contexts.stored_pieces, token_ids, levels, space)
    if stored.complete:
        previous = stored.manifest
        if previous is not None and not _outlives(request.ttl_seconds, previous):
            return context_object(previous, encoded=False)
        # every chunk is there (another replica's encode, write-back, or a longer TTL asked for):
        # record the context without a prefill
        manifest = await _io(
            gateway, gateway.contexts.save, token_ids, None, levels, 0.0, space, request.ttl_seconds, stored
        )
        return context_object(manifest, encoded=False)
    cancel = Flag()
    task = asyncio.ensure_future(
        gateway.admission.background(
            space.tenant,
            encode_tokens,
            gateway,
            token_ids,
            levels,
            space,
            request.ttl_seconds,
            stored,
            cancel=cancel,
        )
    )
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            try:
                manifest = task.result()
            except EncodeCancelled:
                return None
            return context_object(manifest, encoded=True)
        if disconnected is not None and await disconnected():
            cancel.set()
            with contextlib.suppress(asyncio.CancelledError, EncodeCancelled):
                await task  # the admission is given back when the encode thread has stopped
            return None


def _outlives(ttl_seconds: int | None, manifest: Manifest) -> bool:
    """Whether a save with ``ttl_seconds`` now would extend ``manifest``'s life."""
    if manifest.expires is None:
        return False
    return ttl_seconds is None or time.time() + ttl_seconds > manifest.expires


async def get_context(gateway: Gateway, context_id: str, space: KeySpace = PUBLIC) -> dict[str, Any]:
    manifest = await _io(gateway, gateway.contexts.get, context_id, space)
    return context_object(manifest)


async def list_contexts(gateway: Gateway, space: KeySpace = PUBLIC) -> dict[str, Any]:
    manifests = await _io(gateway, gateway.contexts.list, space)
    return {"object": "list", "data": [context_object(m) for m in manifests]}


async def delete_context(gateway: Gateway, context_id: str, space: KeySpace = PUBLIC) -> dict[str, Any]:
    manifest = await _io(gateway, gateway.contexts.delete, context_id, space)
    if gateway.executor.cache is not None and manifest.chunk_keys:
        # nor served from this gateway's memory
        gateway.memory.release(gateway.executor.cache.forget(manifest.chunk_keys[0]))
    return {"id": manifest.id, "object": "context.deleted", "deleted": True}


async def _io(gateway: Gateway, fn: Any, *args: Any) -> Any:
    return await asyncio.wrap_future(gateway.io_pool.submit(fn, *args))
