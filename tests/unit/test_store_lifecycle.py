"""Tenants, TTLs, garbage collection and the store cap, on a memory store with synthetic KV."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from codec import LOSSLESS
from scheduler import contexts as contexts_module
from scheduler import stored as stored_module
from scheduler.contexts import ContextStore
from scheduler.errors import ContextNotFound
from scheduler.geometry import KVGeometry
from scheduler.index import PrefixIndex
from scheduler.layout import CHUNK_PREFIX, index_key, manifest_key, used_key
from scheduler.lifecycle import StoreCollector
from scheduler.prefix import make_fingerprint
from scheduler.stored import find_stored_prefix
from scheduler.tenancy import PUBLIC, KeySpace
from storage.memory import MemoryStore

CHUNK = 8
GEOMETRY = KVGeometry(layers=2, kv_heads=1, head_dim=4)


@pytest.fixture
def contexts():
    pool = ThreadPoolExecutor(2)
    fp = make_fingerprint(weights="w", config={}, vocabulary="v", chunk_size=CHUNK)
    yield ContextStore(MemoryStore(), fp, "m", CHUNK, pool)
    pool.shutdown()


def kv_for(tokens: int) -> torch.Tensor:
    return torch.randn(GEOMETRY.chunk_shape(tokens), generator=torch.Generator().manual_seed(tokens))


def save(contexts: ContextStore, tokens: list[int], space: KeySpace = PUBLIC, ttl: int | None = None):
    return contexts.save(tokens, kv_for(len(tokens)), [LOSSLESS], 0.0, space=space, ttl_seconds=ttl)


def stored_tokens(contexts: ContextStore, tokens: list[int], space: KeySpace = PUBLIC) -> int:
    keys = contexts.keys(tokens, space)
    found = find_stored_prefix(contexts.store, contexts.fingerprint, CHUNK, keys, tokens, [LOSSLESS])
    return found.tokens


def objects(contexts: ContextStore) -> set[str]:
    return {info.key for info in contexts.store.list()}


def later_clock(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every reader's clock ``seconds`` ahead."""
    now = time.time() + seconds
    for module in (contexts_module, stored_module):
        monkeypatch.setattr(module.time, "time", lambda: now)


# -- key spaces -----------------------------------------------------------------------------------


def test_salts_share_no_chunk_and_no_context_id(contexts):
    tokens = list(range(20))
    a = KeySpace.derive("a" * 32, b"secret-a", None)
    b = KeySpace.derive("b" * 32, b"secret-b", None)
    salted = KeySpace.derive(None, None, "client salt")
    keys = [contexts.keys(tokens, space) for space in (PUBLIC, a, b, salted)]
    assert len({k[0] for k in keys}) == 4
    ids = {contexts.context_id(tokens, space) for space in (PUBLIC, a, b, salted)}
    assert len(ids) == 4
    assert KeySpace.derive(None, None, None) == PUBLIC  # no salt at all keeps the shared chain
    # a tenant's own cache_salt is mixed in after its secret: it cannot reach another tenant's chain
    assert KeySpace.derive("a" * 32, b"secret-a", "x").salt not in (a.salt, b.salt, salted.salt)


def test_a_tenant_sees_none_of_another_tenants_context(contexts):
    tokens = list(range(20))
    a = KeySpace.derive("a" * 32, b"secret-a", None)
    b = KeySpace.derive("b" * 32, b"secret-b", None)
    manifest = save(contexts, tokens, a)
    assert manifest.tenant == "a" * 32
    assert stored_tokens(contexts, tokens, a) == 20
    assert stored_tokens(contexts, tokens, b) == 0 and stored_tokens(contexts, tokens, PUBLIC) == 0
    assert [m.id for m in contexts.list(a)] == [manifest.id]
    assert contexts.list(b) == [] and contexts.list(PUBLIC) == []
    for space in (b, PUBLIC):
        with pytest.raises(ContextNotFound):
            contexts.get(manifest.id, space)
        with pytest.raises(ContextNotFound):
            contexts.delete(manifest.id, space)
    assert contexts.get(manifest.id, a).id == manifest.id  # neither call removed it


# -- expiry ---------------------------------------------------------------------------------------


def test_an_expired_context_is_not_served_listed_or_read(contexts, monkeypatch):
    tokens = list(range(20))
    manifest = save(contexts, tokens, ttl=3)
    assert manifest.expires is not None and manifest.expires - manifest.created == 3
    assert stored_tokens(contexts, tokens) == 20 and contexts.list() != []
    later_clock(monkeypatch, 4)
    assert stored_tokens(contexts, tokens) == 0
    assert contexts.list() == []
    with pytest.raises(ContextNotFound):
        contexts.get(manifest.id)


def test_a_pinned_context_keeps_the_chunks_it_shares_with_an_expired_one(contexts, monkeypatch):
    shared = list(range(16))  # two full chunks
    pinned = save(contexts, shared)
    brief = save(contexts, [*shared, *range(100, 110)], ttl=3)  # the same two chunks and more
    later_clock(monkeypatch, 4)
    assert stored_tokens(contexts, [*shared, *range(100, 110)]) == 16  # the shared chunks only
    report = StoreCollector(contexts.store, grace_s=0).collect(now=time.time())
    assert report.expired_contexts == 1
    assert contexts.store.head(manifest_key(brief.id)) is None
    assert stored_tokens(contexts, shared) == 16 and contexts.get(pinned.id).id == pinned.id
    index = PrefixIndex.from_bytes(contexts.store.get(index_key(pinned.chunk_keys[0])))
    assert set(index.chunks) == set(pinned.chunk_keys) and not index.tails
    assert all(entry.expires is None for entry in index.chunks.values())


# -- garbage collection ---------------------------------------------------------------------------


def test_gc_removes_expired_contexts_and_orphans_and_spares_live_ones(contexts):
    live = save(contexts, list(range(20)))
    expired = save(contexts, list(range(200, 220)), ttl=1)
    orphan_keys = contexts.keys(list(range(500, 524)))  # write-back chunks: no manifest
    contexts.save_chunks(orphan_keys, kv_for(24), [LOSSLESS])
    sizes = {info.key: info.size for info in contexts.store.list()}
    assert any(k.startswith(f"{CHUNK_PREFIX}{orphan_keys[0]}/") for k in sizes)

    report = StoreCollector(contexts.store, grace_s=0).collect(now=time.time() + 5)
    after = objects(contexts)
    assert report.expired_contexts == 1 and report.collected_chunks == len(expired.stored_keys) + 3
    assert not any(
        k.startswith(f"{CHUNK_PREFIX}{c}/") for k in after for c in [*expired.stored_keys, *orphan_keys]
    )
    assert manifest_key(live.id) in after and manifest_key(expired.id) not in after
    assert stored_tokens(contexts, list(range(20))) == 20
    deleted_chunk_objects = [k for k in set(sizes) - after if k.startswith(CHUNK_PREFIX)]
    assert report.deleted_objects == len(deleted_chunk_objects)
    assert report.deleted_bytes == sum(sizes[k] for k in deleted_chunk_objects)


def test_gc_spares_unreferenced_chunks_within_the_grace_period(contexts):
    keys = contexts.keys(list(range(24)))
    contexts.save_chunks(keys, kv_for(24), [LOSSLESS])  # a context being written: no manifest yet
    report = StoreCollector(contexts.store, grace_s=60).collect()
    assert report.deleted_objects == 0
    assert stored_tokens(contexts, list(range(24))) == 24
    report = StoreCollector(contexts.store, grace_s=60).collect(now=time.time() + 61)
    assert report.collected_chunks == 3 and stored_tokens(contexts, list(range(24))) == 0


# -- the size cap ---------------------------------------------------------------------------------


def test_the_cap_evicts_ttl_contexts_first_then_least_recently_used(contexts):
    old = save(contexts, list(range(16)))
    used = save(contexts, list(range(100, 116)))
    brief = save(contexts, list(range(200, 216)), ttl=3600)  # the newest, but it has a TTL
    newest = save(contexts, list(range(300, 316)))
    # last loads: ``old``, then ``newest``, then ``used`` (contexts made within one second tie on creation)
    for ahead, manifest in ((1, old), (2, newest), (10, used)):
        contexts.store.put(used_key(manifest.chunk_keys[0]), b"")
        contexts.store._written[used_key(manifest.chunk_keys[0])] = time.time() + ahead
    total = StoreCollector(contexts.store, grace_s=3600).collect().store_bytes
    per_context = total / 4

    report = StoreCollector(contexts.store, grace_s=3600, max_bytes=int(total - 0.5 * per_context)).collect()
    assert report.evicted_contexts == [brief.id] and report.store_bytes <= total - 0.5 * per_context
    report = StoreCollector(contexts.store, grace_s=3600, max_bytes=int(total - 2.5 * per_context)).collect()
    assert report.evicted_contexts == [old.id, newest.id]
    assert [m.id for m in contexts.list()] == [used.id]
    assert stored_tokens(contexts, list(range(100, 116))) == 16
    assert stored_tokens(contexts, list(range(16))) == 0


def test_touch_is_throttled_per_prefix(contexts):
    contexts.touch("a" * 64)
    first = contexts.store.head(used_key("a" * 64))
    contexts.touch("a" * 64)  # within the interval: no second write
    assert contexts.store.head(used_key("a" * 64)).modified == first.modified
