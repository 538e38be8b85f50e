"""ContextStore, the prefix index and PrefixLoader over a memory store, with synthetic KV and real faults."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from codec import DEFAULT_LEVELS, LOSSLESS, Level, Scheme, encode_chunk, level_digest, max_chunk_bytes
from codec.quantized import QuantParams
from scheduler.contexts import ContextStore, read_manifests
from scheduler.errors import ContextNotFound, ManifestError, PrefixIndexError
from scheduler.geometry import KVGeometry
from scheduler.index import MAX_INDEX_BYTES, PrefixIndex
from scheduler.layout import chunk_object_key, index_key, manifest_key, manifest_prefix
from scheduler.loader import PrefixLoader
from scheduler.manifest import MAX_MANIFEST_BYTES, Manifest
from scheduler.prefix import make_fingerprint
from scheduler.prefix_load import KVRequest
from scheduler.profile import CostProfile
from scheduler.stored import find_stored_prefix
from scheduler.tenancy import KeySpace
from scheduler.write_back import WriteBack
from storage.base import DEFAULT_LIMIT
from storage.memory import MemoryStore

CHUNK = 8
GEOMETRY = KVGeometry(layers=2, kv_heads=1, head_dim=4)
LOSSLESS_DIGEST = level_digest(LOSSLESS)
# a lossy level for 2-layer synthetic KV (the shipped table's steps are per layer of the real model)
MEDIUM = Level("medium", Scheme.QUANT, lossless=False, quant=QuantParams(key_step=(0.5,), value_step=(0.5,)))


class BufferOnlyRunner:
    """What the loader asks of the model runner when every chunk comes from the store."""

    def new_kv(self, tokens: int) -> torch.Tensor:
        return torch.full(GEOMETRY.chunk_shape(tokens), float("nan"))


@pytest.fixture
def parts():
    store = MemoryStore()
    pool = ThreadPoolExecutor(4)
    fp = make_fingerprint(weights="w", config={}, vocabulary="v", chunk_size=CHUNK)
    contexts = ContextStore(store, fp, "m", CHUNK, pool)
    profile = CostProfile({"lossless": 1e-6}, 0.0, 1e-3, 0.0)
    loader = PrefixLoader(store, GEOMETRY, pool, profile)
    yield store, contexts, loader
    pool.shutdown()


def load(contexts, loader, tokens, levels=(LOSSLESS,)):
    """Load the stored prefix of ``tokens + [one more]`` at the first of ``levels``, as a request would."""
    keys = contexts.keys(tokens)
    stored = find_stored_prefix(contexts.store, contexts.fingerprint, CHUNK, keys, tokens, list(levels))
    request = KVRequest(list(levels), {lv.name: float(i) for i, lv in enumerate(levels)}, fixed=True)
    return loader.load(BufferOnlyRunner(), stored, tokens, request, len(tokens) + 1, time.perf_counter())


def kv_for(tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(GEOMETRY.chunk_shape(tokens), generator=g)


def test_save_then_load_is_exact_tail_included(parts):
    store, contexts, loader = parts
    tokens = list(range(30))  # 3 full chunks + a 6-token tail
    kv = kv_for(30)
    manifest = contexts.save(tokens, kv, [LOSSLESS], compute_seconds=0.0)
    assert manifest.cached_tokens == 30 and len(manifest.chunk_keys) == 3 and manifest.tail_tokens == 6
    result = load(contexts, loader, tokens)
    assert result.tokens == 30 and result.faults == [] and result.exact
    assert [c.tokens for c in result.chunks] == [8, 8, 8, 6]
    assert torch.equal(result.kv, kv)
    assert contexts.get(manifest.id) == manifest
    assert [m.id for m in contexts.list()] == [manifest.id]


def test_tail_is_used_only_when_the_request_continues_with_its_tokens(parts):
    _, contexts, loader = parts
    tokens = list(range(30))
    contexts.save(tokens, kv_for(30), [LOSSLESS], 0.0)
    assert load(contexts, loader, tokens[:27] + [999, 999, 999]).tokens == 24  # other tail tokens
    assert load(contexts, loader, tokens[:29]).tokens == 24  # the tail is longer than the request
    assert load(contexts, loader, tokens + [5, 6]).tokens == 30


def test_index_lists_sizes_and_digests(parts):
    store, contexts, _ = parts
    tokens = list(range(20))
    levels = [LOSSLESS, MEDIUM]
    manifest = contexts.save(tokens, kv_for(20), levels, 0.0)
    index = PrefixIndex.from_bytes(store.get(index_key(manifest.chunk_keys[0])))
    assert set(index.chunks) == set(manifest.chunk_keys) and set(index.tails) == {manifest.tail_key}
    for key, entry in index.chunks.items():
        for level in levels:
            obj = entry.find(level.name, level_digest(level))
            assert obj is not None
            assert store.head(chunk_object_key(key, level.name, obj.digest)).size == obj.bytes
    assert sum(
        o.bytes for e in [*index.chunks.values(), *index.tails.values()] for o in e.objects
    ) == sum(manifest.level_bytes.values())


def test_level_of_another_table_is_not_read(parts):
    store, contexts, loader = parts
    tokens = list(range(16))
    contexts.save(tokens, kv_for(16), [MEDIUM], 0.0)
    other = Level(
        "medium", Scheme.QUANT, lossless=False, quant=QuantParams(key_step=(9.0,), value_step=(9.0,))
    )
    assert level_digest(other) != level_digest(MEDIUM)
    assert load(contexts, loader, tokens, [MEDIUM]).tokens == 16
    assert load(contexts, loader, tokens, [other]).tokens == 0


def test_two_tables_giving_one_name_different_steps_both_hit(parts):
    """A table rolled out to some replicas: each side keeps finding its own objects in one index."""
    store, contexts, loader = parts
    tokens = list(range(16))
    other = Level(
        "medium", Scheme.QUANT, lossless=False, quant=QuantParams(key_step=(0.25,), value_step=(0.25,))
    )
    contexts.save(tokens, kv_for(16), [MEDIUM], 0.0)
    contexts.save(tokens, kv_for(16), [other], 0.0)  # the newer table, writing after
    index = PrefixIndex.from_bytes(store.get(index_key(contexts.keys(tokens)[0])))
    assert {o.digest for o in index.chunks[contexts.keys(tokens)[0]].objects} == {
        level_digest(MEDIUM),
        level_digest(other),
    }
    errors = []
    for level in (MEDIUM, other):
        result = load(contexts, loader, tokens, [level])
        assert result.tokens == 16 and result.faults == []
        assert [c.level for c in result.chunks] == ["medium", "medium"]
        errors.append((result.kv - kv_for(16)).abs().max().item())
    assert errors[1] < errors[0]  # each read its own table's bytes: the finer steps, the closer
    assert contexts.stored_pieces(tokens, [MEDIUM]).missing == {}  # a third save encodes nothing


def test_a_version_1_index_is_read(parts):
    store, contexts, loader = parts
    tokens = list(range(16))
    contexts.save(tokens, kv_for(16), [LOSSLESS], 0.0)
    key = index_key(contexts.keys(tokens)[0])
    index = json.loads(store.get(key))
    assert index["version"] == 2
    v1 = {
        **index,
        "version": 1,
        "chunks": {
            k: {**e, "objects": {o.pop("level"): o for o in e["objects"]}}  # {level: {digest, bytes}}
            for k, e in json.loads(store.get(key))["chunks"].items()
        },
    }
    store.put(key, json.dumps(v1).encode())
    assert PrefixIndex.from_bytes(store.get(key)) == PrefixIndex.from_bytes(json.dumps(index).encode())
    assert load(contexts, loader, tokens).tokens == 16


@pytest.mark.parametrize(
    "objects",
    [
        [],
        [{"level": "low", "digest": "0" * 16, "bytes": 1}] * 2,  # one object listed twice
        [{"level": "low/x", "digest": "0" * 16, "bytes": 1}],
        [{"level": "low", "digest": "0" * 15, "bytes": 1}],
        [{"level": "low", "digest": "0" * 16, "bytes": 0}],
        [{"level": f"l{i}", "digest": "0" * 16, "bytes": 1} for i in range(65)],
    ],
)
def test_index_objects_are_checked(objects):
    chunks = {"b" * 64: {"objects": objects}}
    index = {"version": 2, "fingerprint": "a" * 64, "chunk_size": CHUNK, "chunks": chunks}
    with pytest.raises(PrefixIndexError):
        PrefixIndex.from_bytes(json.dumps(index).encode())


def test_miss_costs_one_index_read(parts):
    store, contexts, loader = parts
    result = load(contexts, loader, list(range(16)))
    assert result.kv is None and result.tokens == 0 and result.faults == []


def test_corrupt_chunk_ends_the_prefix(parts):
    store, contexts, loader = parts
    tokens = list(range(24))
    contexts.save(tokens, kv_for(24), [LOSSLESS], 0.0)
    key = chunk_object_key(contexts.keys(tokens)[1], "lossless", LOSSLESS_DIGEST)
    blob = bytearray(store.get(key))
    blob[100] ^= 0x01
    store.put(key, bytes(blob))
    result = load(contexts, loader, tokens)
    assert result.tokens == CHUNK and result.faults == ["corrupt_chunk"]


def test_missing_middle_chunk_ends_the_prefix(parts):
    store, contexts, loader = parts
    tokens = list(range(24))
    contexts.save(tokens, kv_for(24), [LOSSLESS], 0.0)
    store.delete(chunk_object_key(contexts.keys(tokens)[2], "lossless", LOSSLESS_DIGEST))
    result = load(contexts, loader, tokens)
    assert result.tokens == 2 * CHUNK and result.faults == ["object_missing"]


def test_a_tail_outlives_a_bad_parent_and_is_whole_once_the_parent_is_stored_again(parts):
    """What write-back does after a read fault: the bad chunk leaves the index, its tail stays, and
    when the chunk is stored anew the whole context, tail included, is reused again."""
    store, contexts, loader = parts
    tokens = list(range(30))  # 3 full chunks + a 6-token tail, whose parent is chunk 2
    kv = kv_for(30)
    contexts.save(tokens, kv, [LOSSLESS], 0.0)
    keys = contexts.keys(tokens)
    store.delete(chunk_object_key(keys[2], "lossless", LOSSLESS_DIGEST))
    result = load(contexts, loader, tokens)
    assert result.tokens == 2 * CHUNK and result.bad_chunks == [keys[2]]
    contexts.forget_chunks(keys[0], set(result.bad_chunks))
    assert load(contexts, loader, tokens).tokens == 2 * CHUNK  # the tail waits for its parent
    contexts.save_chunks(keys[:3], kv[:, :, :, : 3 * CHUNK], [LOSSLESS], first=2)  # as write-back does
    again = load(contexts, loader, tokens)
    assert again.tokens == 30 and torch.equal(again.kv, kv)


@pytest.mark.parametrize("blob", [b"garbage", b"{}", b'{"version": 1}', b"\x00" * 10])
def test_corrupt_index_is_a_miss_with_a_fault(parts, blob):
    store, contexts, loader = parts
    tokens = list(range(16))
    contexts.save(tokens, kv_for(16), [LOSSLESS], 0.0)
    store.put(index_key(contexts.keys(tokens)[0]), blob)
    result = load(contexts, loader, tokens)
    assert result.tokens == 0 and result.faults == ["corrupt_index"]


def test_index_of_another_fingerprint_is_refused(parts):
    store, contexts, loader = parts
    tokens = list(range(16))
    contexts.save(tokens, kv_for(16), [LOSSLESS], 0.0)
    key = index_key(contexts.keys(tokens)[0])
    index = PrefixIndex.from_bytes(store.get(key))
    store.put(key, index.model_copy(update={"fingerprint": "0" * 64}).to_bytes())
    assert load(contexts, loader, tokens).faults == ["corrupt_index"]


def test_oversized_index_is_refused():
    with pytest.raises(PrefixIndexError):
        PrefixIndex.from_bytes(b" " * (9 * 2**20))


class CountingReads(MemoryStore):
    """A MemoryStore that records how many bytes each GET handed out."""

    def __init__(self) -> None:
        super().__init__()
        self.served: list[int] = []

    def get(self, key: str, limit: int = DEFAULT_LIMIT) -> bytes:
        blob = super().get(key, limit)
        self.served.append(len(blob))
        return blob


def test_an_oversized_index_is_not_downloaded_and_is_a_miss(parts):
    _, contexts, _ = parts
    reads = CountingReads()
    tokens = list(range(16))
    key = index_key(contexts.keys(tokens)[0])
    reads.put(key, b" " * (MAX_INDEX_BYTES + 1))
    found = find_stored_prefix(reads, contexts.fingerprint, CHUNK, contexts.keys(tokens), tokens, [LOSSLESS])
    assert found.faults == ["corrupt_index"] and reads.served == []


def test_a_chunk_larger_than_its_shape_allows_is_not_downloaded(parts):
    store, contexts, loader = parts
    tokens = list(range(24))
    contexts.save(tokens, kv_for(24), [LOSSLESS], 0.0)
    key = chunk_object_key(contexts.keys(tokens)[1], "lossless", LOSSLESS_DIGEST)
    store.put(key, bytes(max_chunk_bytes(GEOMETRY.chunk_shape(CHUNK)) + 1))
    result = load(contexts, loader, tokens)
    assert result.tokens == CHUNK and result.faults == ["oversized_chunk"]
    assert result.bad_chunks == [contexts.keys(tokens)[1]]


@pytest.mark.parametrize("tokens", [1, 7, 256])
def test_every_default_level_fits_the_download_bound(tokens):
    """``max_chunk_bytes`` must never refuse a chunk an encoder wrote: check it on the shipped
    levels, on the default model's geometry, from one token to a whole chunk."""
    g = torch.Generator().manual_seed(tokens)
    shape = (30, 2, 3, tokens, 64)
    kv = torch.randn(shape, generator=g) * 3
    for level in DEFAULT_LEVELS:
        assert len(encode_chunk(kv, level)) <= max_chunk_bytes(shape), level.name


def test_manifest_chunk_keys_must_be_digests(parts):
    store, contexts, _ = parts
    contexts.save(list(range(8)), kv_for(8), [LOSSLESS], 0.0)
    (info,) = list(store.list("contexts/"))
    raw = store.get(info.key).decode()
    key = Manifest.from_bytes(raw.encode()).chunk_keys[0]
    for forged in ("..", "kv", key[:-1], key + "/x", ""):
        with pytest.raises(ManifestError):
            Manifest.from_bytes(raw.replace(key, forged).encode())


def test_an_oversized_manifest_is_not_downloaded(parts):
    store, contexts, _ = parts
    contexts.save(list(range(8)), kv_for(8), [LOSSLESS], 0.0)
    reads = CountingReads()
    for info in store.list():
        reads.put(info.key, store.get(info.key))
    (info,) = list(reads.list("contexts/"))
    reads.put(info.key, b" " * (MAX_MANIFEST_BYTES + 1))
    assert read_manifests(reads) == [] and reads.served == []


def test_chunk_of_another_shape_is_refused(parts):
    store, contexts, loader = parts
    tokens = list(range(8))
    other = ContextStore(store, contexts.fingerprint, "m", CHUNK, contexts.pool)
    other.save(tokens, torch.randn(3, 2, 1, 8, 4), [LOSSLESS], 0.0)  # 3 layers, the model has 2
    result = load(contexts, loader, tokens)
    assert result.tokens == 0 and result.faults == ["shape_mismatch"]


def test_delete_keeps_chunks_shared_with_another_context(parts):
    store, contexts, loader = parts
    short, long = list(range(16)), list(range(28))
    kv = kv_for(28)
    a = contexts.save(short, kv[:, :, :, :16], [LOSSLESS], 0.0)
    b = contexts.save(long, kv, [LOSSLESS], 0.0)
    contexts.delete(a.id)
    with pytest.raises(ContextNotFound):
        contexts.get(a.id)
    assert load(contexts, loader, long).tokens == 28
    contexts.delete(b.id)
    assert list(store.list("kv/")) == []  # every chunk, tail and the index are gone


def test_write_back_after_a_lossy_prefix_stores_no_lossless(parts):
    """Provenance: KV computed on top of lossy KV is not exact, so it must never be served as lossless."""
    store, contexts, _ = parts
    medium = MEDIUM
    tokens = list(range(32))
    kv = kv_for(32)
    write_back = WriteBack(contexts, [LOSSLESS, medium])
    keys = contexts.keys(tokens)
    write_back.submit(keys, kv, first=2, exact=False)
    write_back.submit(contexts.keys(tokens[:16]), kv, first=0, exact=True)
    write_back.drain()
    index = PrefixIndex.from_bytes(store.get(index_key(keys[0])))
    assert index.chunks[keys[0]].levels == {"lossless", "medium"}  # exact: both
    assert index.chunks[keys[2]].levels == {"medium"}  # after a lossy prefix: lossy only
    assert index.chunks[keys[3]].levels == {"medium"}
    write_back.shutdown()


class _Layer:
    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values


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


def test_default_levels_have_distinct_digests():
    assert len({level_digest(lv) for lv in DEFAULT_LEVELS}) == len(DEFAULT_LEVELS)


class RecordingReads(MemoryStore):
    """A MemoryStore that records the keys it GETs and the prefixes it lists."""

    def __init__(self) -> None:
        super().__init__()
        self.got: list[str] = []
        self.listed: list[str] = []

    def get(self, key: str, limit: int = DEFAULT_LIMIT) -> bytes:
        self.got.append(key)
        return super().get(key, limit)

    def list(self, prefix: str = ""):  # type: ignore[no-untyped-def]
        self.listed.append(prefix)
        return super().list(prefix)


def test_listing_and_deleting_read_only_the_callers_tenant():
    store = RecordingReads()
    pool = ThreadPoolExecutor(2)
    fp = make_fingerprint(weights="w", config={}, vocabulary="v", chunk_size=CHUNK)
    contexts = ContextStore(store, fp, "m", CHUNK, pool)
    a = KeySpace.derive("a" * 32, b"secret a", None)
    b = KeySpace.derive("b" * 32, b"secret b", None)
    for seed in range(5):
        contexts.save(list(range(seed, seed + 8)), kv_for(8, seed), [LOSSLESS], 0.0, space=a)
    mine = contexts.save(list(range(100, 108)), kv_for(8), [LOSSLESS], 0.0, space=b)
    contexts.save(list(range(200, 208)), kv_for(8), [LOSSLESS], 0.0)  # no tenant
    store.got.clear()
    store.listed.clear()
    assert [m.id for m in contexts.list(b)] == [mine.id]
    assert store.got == [manifest_key(mine.id, b.tenant)]  # one manifest read: its own
    assert all(p.startswith(manifest_prefix(b.tenant)) for p in store.listed)
    store.got.clear()
    store.listed.clear()
    contexts.delete(mine.id, b)
    manifests_read = [k for k in store.got if k.startswith("contexts/")]
    assert manifests_read == [manifest_key(mine.id, b.tenant)]
    assert not any(p.startswith("contexts/") and not p.startswith(manifest_prefix(b.tenant)) for p in store.listed)
    assert len(contexts.list(a)) == 5 and len(contexts.list()) == 1 and contexts.list(b) == []
    # the collector still sees every tenant's contexts
    assert len(read_manifests(store)) == 6
    pool.shutdown()
