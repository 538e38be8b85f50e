"""The loader decodes the store chunks that have arrived in one batch, straight into the KV buffer.

Fetches run on a pool that completes them at once, so every chunk's bytes
are there when the loader gets to the first one: one decode takes them all
(up to MAX_BATCH), and faults inside a batch still end the prefix at the
chunk before the bad one.
"""

from __future__ import annotations

import struct
import time
import zlib
from concurrent.futures import Future

import pytest
import torch

import scheduler.loader as loader_module
from codec import LOSSLESS, Level, Scheme, decode_chunk, encode_chunk, level_digest
from codec.quantized import QuantParams
from scheduler.contexts import ContextStore
from scheduler.geometry import KVGeometry
from scheduler.layout import chunk_object_key
from scheduler.loader import MAX_BATCH, PrefixLoader
from scheduler.prefix import make_fingerprint
from scheduler.prefix_load import KVRequest
from scheduler.profile import CostProfile
from scheduler.stored import find_stored_prefix
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

    def prefill_into(self, kv: torch.Tensor, start: int, token_ids: list[int]) -> None:
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


def load(store, contexts, tokens, level: Level, profile: CostProfile | None = None):
    profile = profile or CostProfile({"lossless": 1e-6, "medium": 3e-6}, 0.0, 1e-3, 0.0)
    loader = PrefixLoader(store, GEOMETRY, ImmediatePool(), profile)  # type: ignore[arg-type]
    request = KVRequest([level], {level.name: 0.0}, fixed=True)
    prefix = stored(store, contexts, tokens, level)
    return loader.load(Buffer(), prefix, tokens, request, len(tokens) + 1, time.perf_counter())


def chunk_key(store, contexts, tokens, index: int, level: Level) -> str:
    key = stored(store, contexts, tokens, level).chunks[index].key
    return chunk_object_key(key, level.name, level_digest(level))


def expected_kv(store, contexts, tokens, level: Level, chunks: int = 6) -> torch.Tensor:
    """What decode_chunk makes of the first ``chunks`` stored objects, one after the other."""
    keys = [chunk_key(store, contexts, tokens, i, level) for i in range(chunks)]
    return torch.cat([decode_chunk(store.get(k)) for k in keys], 3)


@pytest.mark.parametrize("level", [LOSSLESS, MEDIUM], ids=["lossless", "medium"])
def test_arrived_chunks_decode_in_one_batch_into_the_buffer(saved, batches, level: Level) -> None:
    store, contexts, tokens = saved
    result = load(store, contexts, tokens, level)
    assert batches == [6] and MAX_BATCH >= 6  # 5 chunks and the tail
    assert result.tokens == len(tokens) and result.faults == []
    assert [c.index for c in result.chunks] == list(range(6)) and [c.tokens for c in result.chunks][-1] == 3
    assert torch.equal(result.kv, expected_kv(store, contexts, tokens, level))
    assert all(c.decode_ms >= 0 and c.bytes > 0 for c in result.chunks)


def test_decode_time_is_shared_and_observed_per_chunk(saved, batches) -> None:
    store, contexts, tokens = saved
    seen: list[tuple[str, int, float]] = []

    class Profile(CostProfile):
        def observe_decode(self, level: str, tokens: int, seconds: float) -> None:
            seen.append((level, tokens, seconds))

    result = load(store, contexts, tokens, MEDIUM, Profile({"medium": 1e-6}, 0.0, 1e-3, 0.0))
    assert [(lv, n) for lv, n, _ in seen] == [("medium", CHUNK)] * 5 + [("medium", 3)]
    full, tail = seen[0][2], seen[-1][2]
    assert full == pytest.approx(tail * CHUNK / 3)  # shared in proportion to the predicted cost
    assert sum(c.decode_ms for c in result.chunks) == pytest.approx(sum(s for *_, s in seen) * 1000, abs=0.05)


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
