"""The loader decodes the store chunks that have arrived in one batch, straight into the KV buffer.

Fetches run on a pool that completes them at once, so every chunk's bytes
are there when the loader gets to the first one: one decode takes all that
the load's staging memory holds (up to MAX_BATCH), and faults inside a batch
still end the prefix at the chunk before the bad one.
"""

from __future__ import annotations

import struct
import threading
import time
import zlib
from concurrent.futures import Future

import pytest
import torch

import scheduler.loader as loader_module
from codec import LOSSLESS, Level, Scheme, decode_chunk, encode_chunk, level_digest
from codec.quantized import QuantParams
from engine.kv_pool import KVPool
from scheduler.contexts import ContextStore
from scheduler.geometry import KVGeometry
from scheduler.layout import chunk_object_key
from scheduler.loader import MAX_BATCH, PrefixLoader
from scheduler.prefix import make_fingerprint
from scheduler.prefix_load import KVRequest
from scheduler.profile import CostProfile
from scheduler.stored import find_stored_prefix
from storage.local import LocalStore
from storage.memory import MemoryStore

CHUNK = 8
GEOMETRY = KVGeometry(layers=2, kv_heads=2, head_dim=8)
MEDIUM = Level("medium", Scheme.QUANT, lossless=False, quant=QuantParams(key_step=(0.5,), value_step=(0.5,)))


class ImmediatePool:
    """Runs each fetch when it is submitted: its future is done before the loader looks."""

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except Exception as exc:  # noqa: BLE001 - the loader reads it from the future
            future.set_exception(exc)
        return future


class Buffer:
    def new_kv(self, tokens: int) -> torch.Tensor:
        return torch.full(GEOMETRY.chunk_shape(tokens), float("nan"))

    def start_prefill(
        self, kv: torch.Tensor, start: int, token_ids: list[int], after: Future | None = None
    ) -> Future:
        raise AssertionError("no text chunk here")


@pytest.fixture
def saved():
    store = MemoryStore()
    fp = make_fingerprint(weights="w", config={}, vocabulary="v", chunk_size=CHUNK)
    contexts = ContextStore(store, fp, "m", CHUNK, ImmediatePool())  # type: ignore[arg-type]
    tokens = list(range(5 * CHUNK + 3))  # 5 chunks and a 3-token tail
    kv = torch.randn(GEOMETRY.chunk_shape(len(tokens)), generator=torch.Generator().manual_seed(0))
    contexts.save(tokens, kv, [LOSSLESS, MEDIUM], 0.0)
    return store, contexts, tokens


@pytest.fixture
def batches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    sizes: list[int] = []
    decode_into = loader_module.decode_into

    def counted(batch, out, backend=None):
        sizes.append(len(batch.chunks))
        return decode_into(batch, out, backend)

    monkeypatch.setattr(loader_module, "decode_into", counted)
    return sizes


def stored(store, contexts, tokens, level: Level):
    return find_stored_prefix(store, contexts.fingerprint, CHUNK, contexts.keys(tokens), tokens, [level])


def load(
    store,
    contexts,
    tokens,
    level: Level,
    profile: CostProfile | None = None,
    staging_bytes: int | None = None,
    codec_gate=None,
    chunk_size: int | None = None,
):
    profile = profile or CostProfile({"lossless": 1e-6, "medium": 3e-6}, 0.0, 1e-3, 0.0)
    loader = PrefixLoader(store, GEOMETRY, ImmediatePool(), profile, codec_gate=codec_gate, chunk_size=chunk_size)  # type: ignore[arg-type]
    request = KVRequest([level], {level.name: 0.0}, fixed=True)
    prefix = stored(store, contexts, tokens, level)
    return loader.load(
        Buffer(), prefix, tokens, request, len(tokens) + 1, time.perf_counter(), staging_bytes=staging_bytes
    )


def chunk_key(store, contexts, tokens, index: int, level: Level) -> str:
    key = stored(store, contexts, tokens, level).chunks[index].key
    return chunk_object_key(key, level.name, level_digest(level))


def expected_kv(store, contexts, tokens, level: Level, chunks: int = 6) -> torch.Tensor:
    """What decode_chunk makes of the first ``chunks`` stored objects, one after the other."""
    keys = [chunk_key(store, contexts, tokens, i, level) for i in range(chunks)]
    return torch.cat([decode_chunk(store.get(k)) for k in keys], 3)


@pytest.mark.parametrize(
    "level, expected",
    # a medium chunk is a fraction of a raw one, so all 6 (5 chunks and the tail) fit the staging
    # memory of 3 raw chunks; lossless chunks are raw, 3 at a time
    [(LOSSLESS, [3, 3]), (MEDIUM, [6])],
    ids=["lossless", "medium"],
)
def test_arrived_chunks_decode_in_one_batch_into_the_buffer(saved, batches, level: Level, expected) -> None:
    store, contexts, tokens = saved
    result = load(store, contexts, tokens, level)
    assert batches == expected and MAX_BATCH >= 6
    assert result.tokens == len(tokens) and result.faults == []
    assert [c.index for c in result.chunks] == list(range(6)) and [c.tokens for c in result.chunks][-1] == 3
    assert torch.equal(result.kv, expected_kv(store, contexts, tokens, level))
    assert all(c.decode_ms >= 0 and c.bytes > 0 for c in result.chunks)


def test_decode_time_is_shared_and_observed_per_chunk(saved, batches) -> None:
    store, contexts, tokens = saved
    seen: list[tuple[str, int, float]] = []
    whole: list[int | None] = []

    class Profile(CostProfile):
        def observe_decode(self, level: str, tokens: int, seconds: float, full_tokens: int | None = None) -> None:
            seen.append((level, tokens, seconds))
            whole.append(full_tokens)

    result = load(store, contexts, tokens, MEDIUM, Profile({"medium": 1e-6}, 0.0, 1e-3, 0.0))
    assert [(lv, n) for lv, n, _ in seen] == [("medium", CHUNK)] * 5 + [("medium", 3)]
    assert whole == [CHUNK] * 6  # the tail counts for its share of a whole chunk
    full, tail = seen[0][2], seen[-1][2]
    assert full == pytest.approx(tail * CHUNK / 3)  # shared in proportion to the predicted cost
    assert sum(c.decode_ms for c in result.chunks) == pytest.approx(sum(s for *_, s in seen) * 1000, abs=0.05)


def test_the_loaders_chunk_size_is_the_measure_of_a_whole_chunk(saved) -> None:
    """Not the longest chunk of the load: a load may hold only a context's tail (its whole chunks
    came from memory)."""
    store, contexts, tokens = saved
    whole: list[int | None] = []

    class Profile(CostProfile):
        def observe_decode(self, level: str, tokens: int, seconds: float, full_tokens: int | None = None) -> None:
            whole.append(full_tokens)

    load(store, contexts, tokens, MEDIUM, Profile({"medium": 1e-6}, 0.0, 1e-3, 0.0), chunk_size=2 * CHUNK)
    assert whole == [2 * CHUNK] * 6


def test_waiting_for_the_codec_is_reported_apart_and_never_learned_as_decode_time(saved) -> None:
    """Another load's decode holds the gate; this one's profile learns only its own decode."""
    store, contexts, tokens = saved
    seen: list[float] = []

    class Profile(CostProfile):
        def observe_decode(self, level: str, tokens: int, seconds: float, full_tokens: int | None = None) -> None:
            seen.append(seconds)

    gate = threading.Lock()
    gate.acquire()  # the other load's decode
    threading.Timer(0.3, gate.release).start()
    result = load(store, contexts, tokens, MEDIUM, Profile({"medium": 1e-6}, 0.0, 1e-3, 0.0), codec_gate=gate)
    assert result.tokens == len(tokens)
    assert result.chunks[0].gate_ms >= 250
    assert sum(seen) < 0.25, "the wait for the gate was learned as decode time"
    assert sum(c.decode_ms for c in result.chunks) == pytest.approx(sum(seen) * 1000, abs=0.05)


def test_fetched_chunks_are_read_into_staging_memory_that_comes_back(saved, tmp_path) -> None:
    """A local store reads each chunk into the KV pool's blocks; they are free again after the load."""
    store, contexts, tokens = saved
    local = LocalStore(tmp_path / "store")
    for info in store.list():
        local.put(info.key, store.get(info.key))
    pool = KVPool(16 << 20, 4096, prefault=False)
    views: list[memoryview] = []

    def staging(nbytes: int) -> memoryview | None:
        buffer = pool.buffer(nbytes)
        assert buffer is not None
        views.append(buffer)
        return buffer

    profile = CostProfile({"lossless": 1e-6}, 0.0, 1e-3, 0.0)
    loader = PrefixLoader(local, GEOMETRY, ImmediatePool(), profile, staging=staging)  # type: ignore[arg-type]
    request = KVRequest([LOSSLESS], {"lossless": 0.0}, fixed=True)
    prefix = stored(local, contexts, tokens, LOSSLESS)
    result = loader.load(Buffer(), prefix, tokens, request, len(tokens) + 1, time.perf_counter())
    assert result.tokens == len(tokens) and result.faults == []
    assert torch.equal(result.kv, expected_kv(store, contexts, tokens, LOSSLESS))
    assert len(views) == 6
    views.clear()
    assert pool.used_bytes == 0, "a fetched chunk's staging memory outlived its load"


def forge_crc(data: bytes | bytearray) -> bytes:
    body = bytes(data[:-4])
    return body + struct.pack("<I", zlib.crc32(body))


def test_a_corrupt_chunk_inside_a_batch_ends_the_prefix_before_it(saved, batches) -> None:
    store, contexts, tokens = saved
    expected = expected_kv(store, contexts, tokens, MEDIUM, 3)
    key = chunk_key(store, contexts, tokens, 3, MEDIUM)
    bad = bytearray(store.get(key))
    bad[40] ^= 1
    store.put(key, bytes(bad))
    result = load(store, contexts, tokens, MEDIUM)
    assert result.tokens == 3 * CHUNK and result.faults == ["corrupt_chunk"] and batches == [3]
    assert torch.equal(result.kv[:, :, :, : 3 * CHUNK], expected)


def test_a_forged_stream_inside_a_batch_ends_the_prefix_before_it(saved, batches) -> None:
    """Valid CRC, wrong words: found by the decoder, after chunks 0 and 1 were written."""
    store, contexts, tokens = saved
    key = chunk_key(store, contexts, tokens, 2, MEDIUM)
    good = store.get(key)
    for pos in range(len(good) - 6, len(good) - 40, -1):
        bad = bytearray(good)
        bad[pos] ^= 0x5A
        store.put(key, forge_crc(bad))
        result = load(store, contexts, tokens, MEDIUM)
        if result.faults:
            break
    assert result.tokens == 2 * CHUNK and result.faults == ["corrupt_chunk"]
    assert [c.index for c in result.chunks] == [0, 1] and batches[-1] == 6


def test_a_chunk_of_another_shape_inside_a_batch(saved, batches) -> None:
    store, contexts, tokens = saved
    other = torch.randn(3, 2, 2, CHUNK, 8)  # 3 layers, the model has 2
    store.put(chunk_key(store, contexts, tokens, 1, LOSSLESS), encode_chunk(other, LOSSLESS))
    result = load(store, contexts, tokens, LOSSLESS)
    assert result.tokens == CHUNK and result.faults == ["shape_mismatch"] and batches == [1]


def test_a_missing_object_after_a_batch(saved, batches) -> None:
    store, contexts, tokens = saved
    store.delete(chunk_key(store, contexts, tokens, 4, MEDIUM))
    result = load(store, contexts, tokens, MEDIUM)
    assert result.tokens == 4 * CHUNK and result.faults == ["object_missing"] and batches == [4]


class CountingStore:
    """The store, counting the bytes fetched."""

    def __init__(self, store) -> None:
        self.store = store
        self.fetched = 0

    def get(self, key: str, limit: int | None = None) -> bytes:
        data = self.store.get(key) if limit is None else self.store.get(key, limit=limit)
        self.fetched += len(data)
        return data

    def __getattr__(self, name: str):
        return getattr(self.store, name)


@pytest.mark.parametrize("staging", [None, 0], ids=["default", "none reserved"])
def test_a_load_holds_no_more_fetched_bytes_than_its_staging_memory(saved, batches, staging) -> None:
    """On a store that answers at once, fetches used to run ahead of the decoder without limit:
    a load held every chunk of its prefix. Now the bytes fetched and not yet decoded stay within
    the staging memory the request reserved, or one chunk when it reserved none."""
    store, contexts, tokens = saved
    counting = CountingStore(store)
    fetched_at: list[int] = []

    class Gate:  # entered around each decode: what is held then is the most the load holds
        def __enter__(self):
            fetched_at.append(counting.fetched)

        def __exit__(self, *exc):
            return False

    loader = PrefixLoader(
        counting, GEOMETRY, ImmediatePool(), CostProfile({"lossless": 1e-6}, 0.0, 1e-3, 0.0)
    )  # type: ignore[arg-type]
    cap = loader.staging_bytes(CHUNK) if staging is None else staging
    chunk_bytes = len(store.get(chunk_key(store, contexts, tokens, 0, LOSSLESS)))
    assert 2 * chunk_bytes < loader.staging_bytes(CHUNK) < 6 * chunk_bytes  # the old rule held all 6
    result = load(counting, contexts, tokens, LOSSLESS, staging_bytes=staging, codec_gate=Gate())
    assert result.tokens == len(tokens) and torch.equal(
        result.kv, expected_kv(store, contexts, tokens, LOSSLESS)
    )
    sizes = [c.bytes for c in result.chunks]
    starts = [sum(batches[:k]) for k in range(len(batches))]  # the first chunk of each batch
    held = [fetched - sum(sizes[:start]) for fetched, start in zip(fetched_at, starts, strict=True)]
    assert held and max(held) <= max(cap, chunk_bytes)
    assert len(batches) == (6 if staging == 0 else 2)
