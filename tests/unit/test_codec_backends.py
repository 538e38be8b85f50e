"""The parse / backend split: parsed batches decode into slices of a bigger buffer, like decode_chunk."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch

from codec import (
    CodecError,
    Level,
    NumbaBackend,
    ParsedBatch,
    StreamError,
    backend_for,
    decode_chunk,
    decode_into,
    encode_chunk,
    load_level_table,
    parse_chunk,
    parse_chunks,
)
from codec.levels import BASELINES_TABLE_FILE, Scheme, shipped_level_table

# Every level there is: the default model's table with its baselines (fp16, int8), and zstd.
LEVELS = {lv.name: lv for lv in load_level_table(shipped_level_table(BASELINES_TABLE_FILE))}
LEVELS["zstd"] = Level("zstd", Scheme.ZSTD)


def _kv(tokens: int, seed: int = 0, layers: int = 30, heads: int = 3, dim: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(layers, 2, heads, tokens, dim, generator=g)
    kv[:, 0] *= torch.linspace(0.2, 6.0, dim)
    kv[:, :, :, 0] *= 20.0  # an attention-sink-like first token
    return kv


def _forge_crc(data: bytes | bytearray) -> bytes:
    body = bytes(data[:-4])
    return body + struct.pack("<I", zlib.crc32(body))


def _chunks(names: list[str], tokens: list[int]) -> list[bytes]:
    return [encode_chunk(_kv(t, seed=i), LEVELS[n]) for i, (n, t) in enumerate(zip(names, tokens))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_batch_decodes_into_a_slice_like_decode_chunk(dtype: torch.dtype) -> None:
    names = list(LEVELS)
    data = _chunks(names, [5, 1, 7, 3, 4, 9, 2][: len(names)])
    batch = parse_chunks(data)
    layers, _, heads, tokens, dim = batch.shape
    buffer = torch.full((layers, 2, heads, tokens + 10, dim), 7.0, dtype=dtype)
    out = buffer[:, :, :, 4 : 4 + tokens]
    decode_into(batch, out, NumbaBackend())
    expected = torch.cat([decode_chunk(d).to(dtype) for d in data], dim=3)
    assert torch.equal(out, expected)
    assert (buffer[:, :, :, :4] == 7).all() and (buffer[:, :, :, 4 + tokens :] == 7).all()


def test_cpu_tensors_get_the_numba_backend() -> None:
    assert isinstance(backend_for(torch.device("cpu")), NumbaBackend)


def test_a_batch_of_different_models_is_refused() -> None:
    a = parse_chunk(encode_chunk(_kv(3), LEVELS["lossless"]))
    b = parse_chunk(encode_chunk(_kv(3, heads=2), LEVELS["lossless"]))
    with pytest.raises(ValueError, match="share"):
        ParsedBatch((a, b))


def test_an_output_of_the_wrong_shape_is_refused() -> None:
    batch = parse_chunks(_chunks(["lossless"], [3]))
    with pytest.raises(ValueError, match="shape"):
        decode_into(batch, torch.empty(30, 2, 3, 4, 64))
    with pytest.raises(ValueError, match="int32"):
        decode_into(batch, torch.empty(batch.shape, dtype=torch.int32))


def _forged_stream(data: bytes) -> bytes:
    """The chunk with its last stream's words changed and the CRC made to match."""
    for pos in range(len(data) - 8, len(data) - 40, -1):
        bad = bytearray(data)
        bad[pos] ^= 0x5A
        forged = _forge_crc(bad)
        parse_chunk(forged)  # the parse cannot see it
        try:
            decode_chunk(forged)
        except StreamError:
            return forged
    raise AssertionError("no flip was caught")


def test_a_forged_stream_is_found_while_decoding_and_names_its_chunk() -> None:
    good = _chunks(["medium", "low", "medium"], [4, 4, 4])
    batch = parse_chunks([good[0], good[1], _forged_stream(good[2])])
    out = torch.zeros(batch.shape)
    with pytest.raises(StreamError) as info:
        decode_into(batch, out, NumbaBackend())
    assert info.value.chunk == 2 and isinstance(info.value, CodecError)
    assert torch.equal(out[:, :, :, :8], torch.cat([decode_chunk(d) for d in good[:2]], dim=3))


def test_parse_rejects_a_chunk_that_decode_chunk_rejects() -> None:
    data = bytearray(_chunks(["medium"], [4])[0])
    data[40] ^= 1
    with pytest.raises(CodecError, match="checksum"):
        parse_chunks([bytes(data)])
