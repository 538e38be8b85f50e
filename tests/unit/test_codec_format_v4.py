"""Format 4 on: scheme 2's exact tokens are float32 when float16 would turn a value into an infinity."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch

from codec import FORMAT_VERSION, CodecError, decode_chunk, encode_chunk, level_by_name, load_level_table
from codec.container import HEADER_SIZE, READ_VERSIONS, read_header
from codec.levels import V4_TABLE_FILE, shipped_level_table

MEDIUM = level_by_name("medium", load_level_table(shipped_level_table(V4_TABLE_FILE)))  # scheme 2

# groups (u8), bank (u8), exact tokens (u16), then the exact tokens' dtype code
_EXACT_CODE = HEADER_SIZE + 4


def _kv(tokens: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn(30, 2, 3, tokens, 64, generator=g)  # the default model's KV shape


def _forge_crc(data: bytes | bytearray) -> bytes:
    body = bytes(data[:-4])
    return body + struct.pack("<I", zlib.crc32(body))


def test_this_build_writes_5_and_reads_3_4_and_5() -> None:
    assert FORMAT_VERSION == 5 and READ_VERSIONS == (3, 4, 5)
    assert read_header(encode_chunk(_kv(), MEDIUM)).version == 5


@pytest.mark.parametrize("value", [1e6, -1e6, 65520.0, 3.0e38])
def test_an_exact_token_beyond_float16_round_trips_exactly(value: float) -> None:
    kv = _kv()
    kv[7, 0, 1, 0, 12] = value  # token 0: the attention sink, stored exactly
    data = encode_chunk(kv, MEDIUM)
    out = decode_chunk(data)
    assert data[_EXACT_CODE] == 0  # float32
    assert out[7, 0, 1, 0, 12] == kv[7, 0, 1, 0, 12] and torch.isfinite(out).all()
    assert torch.equal(out[:, :, :, 0], kv[:, :, :, 0])  # every exact value, not just the big one


def test_exact_tokens_stay_float16_when_they_fit() -> None:
    kv = _kv()
    kv[7, 0, 1, 0, 12] = 65504.0  # float16's largest
    small = encode_chunk(kv, MEDIUM)
    kv[7, 0, 1, 0, 12] = 1e6
    large = encode_chunk(kv, MEDIUM)
    assert small[_EXACT_CODE] == 1
    assert len(large) - len(small) == 30 * 2 * 3 * 64 * 2  # one token's values, 2 more bytes each
    assert torch.equal(
        decode_chunk(small)[:, :, :, 0], kv[:, :, :, 0].half().float().where(kv[:, :, :, 0] != 1e6, 65504.0)
    )


@pytest.mark.parametrize("code", [2, 3, 255])
def test_an_unknown_exact_dtype_is_rejected(code: int) -> None:
    data = bytearray(encode_chunk(_kv(), MEDIUM))
    data[_EXACT_CODE] = code
    with pytest.raises(CodecError, match="dtype code"):
        decode_chunk(_forge_crc(data))


def test_a_version_3_header_on_a_version_4_payload_is_rejected() -> None:
    """The prefix is one byte shorter in format 3: the sections no longer add up."""
    data = bytearray(encode_chunk(_kv(), MEDIUM))
    data[4:6] = struct.pack("<H", 3)
    with pytest.raises(CodecError):
        decode_chunk(_forge_crc(data))


def _exact_offset(data: bytes) -> int:
    side = struct.unpack_from("<I", data, HEADER_SIZE + 5)[0]
    return HEADER_SIZE + 9 + side


@pytest.mark.parametrize("bits", [0x7E00, 0x7C00, 0xFC00])  # NaN, inf, -inf as float16
def test_non_finite_exact_values_are_rejected(bits: int) -> None:
    data = bytearray(encode_chunk(_kv(), MEDIUM))
    struct.pack_into("<H", data, _exact_offset(data) + 2 * 5, bits)
    with pytest.raises(CodecError, match="non-finite"):
        decode_chunk(_forge_crc(data))
