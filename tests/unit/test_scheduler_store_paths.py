"""ContextStore and PrefixLoader over a memory store, with synthetic KV and real faults."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from codec import LOSSLESS
from scheduler.contexts import ContextStore
from scheduler.errors import ContextNotFound, ManifestError
from scheduler.geometry import KVGeometry
from scheduler.layout import chunk_object_key, manifest_key
from scheduler.loader import PrefixLoader
from scheduler.manifest import Manifest
from scheduler.prefix import make_fingerprint
from storage.memory import MemoryStore

CHUNK = 8
GEOMETRY = KVGeometry(layers=2, kv_heads=1, head_dim=4)


@pytest.fixture
def parts():
    store = MemoryStore()
    pool = ThreadPoolExecutor(4)
    fp = make_fingerprint(weights="w", config={}, vocabulary="v", chunk_size=CHUNK)
    contexts = ContextStore(store, fp, "m", CHUNK, pool)
    loader = PrefixLoader(store, GEOMETRY, CHUNK, pool)
    yield store, contexts, loader
    pool.shutdown()


def kv_for(tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(GEOMETRY.chunk_shape(tokens), generator=g)


def test_save_then_load_is_exact(parts):
    store, contexts, loader = parts
    tokens = list(range(30))  # 3 full chunks + 6 tokens
    kv = kv_for(30)
    manifest = contexts.save(tokens, kv, [LOSSLESS], compute_seconds=0.0)
    assert manifest.cached_tokens == 24 and len(manifest.chunk_keys) == 3
    load = loader.load(contexts.keys(tokens), [LOSSLESS])
    assert load.tokens == 24 and load.faults == []
    assert torch.equal(load.kv, kv[:, :, :, :24])
    assert contexts.get(manifest.id) == manifest
    assert [m.id for m in contexts.list()] == [manifest.id]


def test_miss_costs_no_fetch(parts):
    store, contexts, loader = parts
    load = loader.load(contexts.keys(list(range(16))), [LOSSLESS])
    assert load.kv is None and load.tokens == 0 and load.faults == []


def test_corrupt_chunk_ends_the_prefix(parts):
    store, contexts, loader = parts
    tokens = list(range(24))
    contexts.save(tokens, kv_for(24), [LOSSLESS], 0.0)
    keys = contexts.keys(tokens)
    key = chunk_object_key(keys[1], "lossless")
    blob = bytearray(store.get(key))
    blob[100] ^= 0x01
    store.put(key, bytes(blob))
    load = loader.load(keys, [LOSSLESS])
    assert load.tokens == CHUNK and load.faults == ["corrupt_chunk"]


def test_missing_middle_chunk_ends_the_prefix(parts):
    store, contexts, loader = parts
    tokens = list(range(24))
    contexts.save(tokens, kv_for(24), [LOSSLESS], 0.0)
    keys = contexts.keys(tokens)
    store.delete(chunk_object_key(keys[2], "lossless"))
    assert loader.load(keys, [LOSSLESS]).tokens == 2 * CHUNK


def test_chunk_of_another_shape_is_refused(parts):
    store, contexts, loader = parts
    tokens = list(range(8))
    other = ContextStore(store, contexts.fingerprint, "m", CHUNK, contexts.pool)
    other.save(tokens, torch.randn(3, 2, 1, 8, 4), [LOSSLESS], 0.0)  # 3 layers, the model has 2
    load = loader.load(contexts.keys(tokens), [LOSSLESS])
    assert load.tokens == 0 and load.faults == ["shape_mismatch"]


def test_delete_keeps_chunks_shared_with_another_context(parts):
    store, contexts, loader = parts
    short, long = list(range(16)), list(range(24))
    kv = kv_for(24)
    a = contexts.save(short, kv[:, :, :, :16], [LOSSLESS], 0.0)
    contexts.save(long, kv, [LOSSLESS], 0.0)
    contexts.delete(a.id)
    with pytest.raises(ContextNotFound):
        contexts.get(a.id)
    assert loader.load(contexts.keys(long), [LOSSLESS]).tokens == 24


def test_unknown_and_malformed_ids(parts):
    _, contexts, _ = parts
    for bad in ("ctx-0123", "../x", "ctx-" + "0" * 32):
        with pytest.raises(ContextNotFound):
            contexts.get(bad)


@pytest.mark.parametrize(
    "blob",
    [b"", b"not json", b"{}", b'{"version": 99}', b"\xff\xfe"],
)
def test_bad_manifest_bytes_are_rejected(blob):
    with pytest.raises(ManifestError):
        Manifest.from_bytes(blob)


def test_broken_manifest_is_skipped_when_listing(parts):
    store, contexts, _ = parts
    contexts.save(list(range(8)), kv_for(8), [LOSSLESS], 0.0)
    store.put(manifest_key("ctx-" + "1" * 32), b"garbage")
    assert len(contexts.list()) == 1
