"""Bad bytes are rejected with CodecError: never a crash, a hang, or silent garbage.

Corruption inside the payload is exercised twice: as is (the CRC catches it)
and with the CRC forged to match, so the inner parsers and the entropy decoder
see the corrupt fields themselves.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from codec import LOSSLESS, CodecError, Level, Scheme, ShapeMismatch, decode_chunk, encode_chunk, parse_chunk
from codec.container import HEADER_SIZE, MAX_VALUES
from codec.quantized import QuantParams
from tests.forged_chunks import forge_crc, zstd_bomb

QUANT = Level("q", Scheme.QUANT, lossless=False, quant=QuantParams(key_step=(0.5,), value_step=(0.7,)))
ZSTD = Level("zstd", Scheme.ZSTD)


def _chunk(level: Level, tokens: int = 23) -> tuple[bytes, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(2, 2, 2, tokens, 8, generator=g)
    return encode_chunk(kv, level), kv


INT8 = Level("int8", Scheme.INT8, lossless=False)
FP16 = Level("fp16", Scheme.RAW, lossless=False, cast=torch.float16)


CHUNKS = {
    name: _chunk(level)
    for name, level in (("raw", LOSSLESS), ("zstd", ZSTD), ("quant", QUANT), ("int8", INT8), ("fp16", FP16))
}


def _decodes_or_rejects(data: bytes, original: torch.Tensor) -> None:
    """Either a CodecError, or a tensor of the header's shape (a corrupt value a checksum cannot see)."""
    try:
        out = decode_chunk(data)
    except CodecError:
        return
    assert isinstance(out, torch.Tensor)
    assert out.dim() == 5


@pytest.mark.parametrize("name", list(CHUNKS))
def test_every_truncation_is_rejected(name: str) -> None:
    data, _ = CHUNKS[name]
    for n in range(len(data)):
        with pytest.raises(CodecError):
            decode_chunk(data[:n])


@pytest.mark.parametrize("name", list(CHUNKS))
def test_every_single_bit_flip_is_rejected(name: str) -> None:
    data, _ = CHUNKS[name]
    rng = np.random.default_rng(0)
    positions = rng.choice(len(data) * 8, size=min(400, len(data) * 8), replace=False)
    for bit in positions:
        bad = bytearray(data)
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CodecError):
            decode_chunk(bytes(bad))


def test_foreign_and_empty_bytes_are_rejected() -> None:
    for data in (b"", b"CGKV", b"\x89PNG\r\n\x1a\n" + bytes(100), b"{}", bytes(64), b"CGKV" + bytes(60)):
        with pytest.raises(CodecError):
            decode_chunk(data)


def test_future_version_is_rejected() -> None:
    data = bytearray(CHUNKS["raw"][0])
    data[4:6] = struct.pack("<H", 99)
    with pytest.raises(CodecError, match="version"):
        decode_chunk(forge_crc(data))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400))
def test_random_bytes_are_rejected(data: bytes) -> None:
    with pytest.raises(CodecError):
        decode_chunk(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(min_size=0, max_size=300))
def test_random_payload_behind_a_valid_header_and_crc(payload: bytes) -> None:
    """A well-formed header + CRC around random bytes: the scheme parsers must reject it or stay in bounds."""
    for data, kv in CHUNKS.values():
        head = bytearray(data[:HEADER_SIZE])
        head[-8:] = struct.pack("<Q", len(payload))
        _decodes_or_rejects(forge_crc(bytes(head) + payload + bytes(4)), kv)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(CHUNKS)), st.data())
def test_inner_corruption_with_forged_crc(name: str, data: st.DataObject) -> None:
    original, kv = CHUNKS[name]
    bad = bytearray(original)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(bad) - 5))
        bad[pos] = data.draw(st.integers(0, 255))
    _decodes_or_rejects(forge_crc(bad), kv)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_forged_header_dimensions_never_allocate_unbounded(data: st.DataObject) -> None:
    original, kv = CHUNKS["quant"]
    bad = bytearray(original)
    # layers, kv_heads, head_dim (u16) and tokens (u32) follow magic, version, scheme and dtype
    fields = struct.unpack_from("<HHHI", bad, 8)
    new = [data.draw(st.integers(1, 0xFFFF)) if data.draw(st.booleans()) else f for f in fields[:3]]
    tokens = data.draw(st.integers(1, 0xFFFFFFFF)) if data.draw(st.booleans()) else fields[3]
    struct.pack_into("<HHHI", bad, 8, *new, tokens)
    _decodes_or_rejects(forge_crc(bad), kv)


def test_a_header_of_another_shape_is_refused_before_the_payload_is_read() -> None:
    """A 3 GiB decompression bomb (about 0.1 MB, CRC valid): the expected shape refuses it from the
    header alone, so nothing is decompressed; the CRC is not even looked at."""
    bomb = zstd_bomb(layers=30, heads=3, tokens=64 * 1024, dim=64)  # 30*2*3*65536*64*4 B = 3 GiB
    assert len(bomb) < 200_000
    with pytest.raises(ShapeMismatch, match="expected"):
        parse_chunk(bomb, expect=(30, 2, 3, 256, 64))
    broken = bytearray(bomb)
    broken[-1] ^= 0xFF  # a bad CRC too: the shape is what is reported, it comes first
    with pytest.raises(ShapeMismatch):
        parse_chunk(bytes(broken), expect=(30, 2, 3, 256, 64))


def test_a_chunk_of_the_expected_shape_still_decodes() -> None:
    data, kv = CHUNKS["zstd"]
    assert torch.equal(parse_chunk(data, expect=tuple(kv.shape)).body.values, kv)  # type: ignore[union-attr]


def test_without_an_expected_shape_a_header_is_bounded_for_every_scheme() -> None:
    """Callers that do not know the model (calibration, inspection) still get the codec's bound:
    a header over MAX_VALUES is refused before anything is allocated, whatever its scheme."""
    tokens = MAX_VALUES // (2 * 2 * 8) + 1  # just over the bound for a (2, 2, 2, T, 8) chunk
    for name, (original, _) in CHUNKS.items():
        bad = bytearray(original)
        struct.pack_into("<I", bad, 14, tokens)
        with pytest.raises(CodecError, match="over the limit") as info:
            parse_chunk(forge_crc(bad))
        assert not isinstance(info.value, ShapeMismatch), name


def test_stream_corruption_in_quant_payload_is_detected_by_the_entropy_decoder() -> None:
    data, _ = CHUNKS["quant"]
    rejected = 0
    for pos in range(len(data) - 60, len(data) - 4):  # inside the last streams' words
        bad = bytearray(data)
        bad[pos] ^= 0x5A
        try:
            decode_chunk(forge_crc(bad))
        except CodecError:
            rejected += 1
    # rANS ends in its initial state only if every word was right; a few flips can survive by chance.
    assert rejected >= 0.8 * 56
