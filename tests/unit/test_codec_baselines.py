"""The paper's baselines as codec levels: fp16 (raw scheme after a cast) and int8 (scheme 3)."""

from __future__ import annotations

import copy
import struct
import zlib

import numpy as np
import pytest
import torch

from codec import (
    DEFAULT_LEVELS,
    CodecError,
    Level,
    LevelTableError,
    Scheme,
    decode_chunk,
    encode_chunk,
    level_by_name,
    level_digest,
    load_level_table,
)
from codec.container import HEADER_SIZE, OVERHEAD, read_header
from codec.levels import (
    BASELINES_TABLE_FILE,
    SCHEME4_TABLE_FILE,
    V4_TABLE_FILE,
    default_level_table,
    shipped_level_table,
)
from codec.transformed import TransformParams

FP16 = Level("fp16", Scheme.RAW, lossless=False, cast=torch.float16)
INT8 = Level("int8", Scheme.INT8, lossless=False)


def _kv(layers: int = 3, heads: int = 2, tokens: int = 37, dim: int = 16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(layers, 2, heads, tokens, dim, generator=g)
    kv[:, 0] *= torch.linspace(0.2, 8.0, dim)  # key channels of very different spreads, as in real keys
    kv[:, 0, :, tokens // 2] *= 50.0  # and a token with outliers
    return kv


def _forge_crc(data: bytes | bytearray) -> bytes:
    body = bytes(data[:-4])
    return body + struct.pack("<I", zlib.crc32(body))


def _with_payload(chunk: bytes, payload: bytes) -> bytes:
    """A container with ``chunk``'s header, a new payload, and a valid length and CRC."""
    head = bytearray(chunk[:HEADER_SIZE])
    head[-8:] = struct.pack("<Q", len(payload))
    return _forge_crc(bytes(head) + payload + bytes(4))


# -- fp16 ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fp16_round_trip_is_kv_half(dtype: torch.dtype) -> None:
    kv = _kv().to(dtype)
    data = encode_chunk(kv, FP16)
    out = decode_chunk(data)
    assert out.dtype == torch.float16
    assert torch.equal(out.view(torch.int16), kv.half().view(torch.int16))
    header = read_header(data)
    assert header.scheme == Scheme.RAW and header.dtype == 1  # an ordinary float16 raw chunk


def test_fp16_is_two_bytes_per_value() -> None:
    kv = _kv()
    assert len(encode_chunk(kv, FP16)) == 2 * kv.numel() + OVERHEAD


def test_fp16_refuses_values_beyond_its_range() -> None:
    kv = _kv()
    kv[1, 1, 0, 5, 7] = 70000.0
    with pytest.raises(ValueError, match="range"):
        encode_chunk(kv, FP16)
    kv[1, 1, 0, 5, 7] = 65504.0  # the largest float16 is fine
    assert decode_chunk(encode_chunk(kv, FP16))[1, 1, 0, 5, 7] == 65504.0


def test_fp16_keeps_infinities_and_nan_that_were_there() -> None:
    """The raw scheme stores what it gets; only values the cast would break are refused."""
    kv = _kv()
    kv[0, 0, 0, 0, 0] = float("inf")
    kv[0, 0, 0, 0, 1] = float("nan")
    out = decode_chunk(encode_chunk(kv, FP16))
    assert out[0, 0, 0, 0, 0] == float("inf") and out[0, 0, 0, 0, 1].isnan()


def test_a_cast_to_float16_or_bfloat16_must_be_marked_lossy() -> None:
    with pytest.raises(ValueError, match="lossless=False"):
        Level("fp16", Scheme.RAW, cast=torch.float16)
    with pytest.raises(ValueError, match="raw and zstd"):
        Level("x", Scheme.INT8, lossless=False, cast=torch.float16)
    assert Level("f32", Scheme.RAW, cast=torch.float32).lossless  # widening is exact


def test_zstd_level_can_cast_too() -> None:
    kv = _kv()
    level = Level("zfp16", Scheme.ZSTD, lossless=False, cast=torch.float16)
    out = decode_chunk(encode_chunk(kv, level))
    assert torch.equal(out.view(torch.int16), kv.half().view(torch.int16))


# -- int8 ------------------------------------------------------------------------------------------------


def _scales(kv: torch.Tensor) -> torch.Tensor:
    return kv.float().abs().amax(dim=(2, 4), keepdim=True) / 127


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 37, 256])
def test_int8_error_is_at_most_half_a_scale(dtype: torch.dtype, tokens: int) -> None:
    kv = _kv(tokens=tokens).to(dtype)
    out = decode_chunk(encode_chunk(kv, INT8))
    assert out.dtype == torch.float32 and out.shape == kv.shape
    bound = _scales(kv) / 2
    err = (out - kv.float()).abs()
    assert (err <= bound * (1 + 1e-5) + 1e-30).all()
    # and it is the scheme as specified: codes in [-127, 127] times the row's scale
    codes = out / _scales(kv)
    assert torch.allclose(codes, codes.round(), atol=1e-3) and codes.abs().max() <= 127.001


def test_int8_zero_rows_and_zero_chunks() -> None:
    kv = _kv()
    kv[2, 1, :, 10] = 0.0
    out = decode_chunk(encode_chunk(kv, INT8))
    assert (out[2, 1, :, 10] == 0).all()
    zero = torch.zeros(2, 2, 2, 5, 8)
    assert torch.equal(decode_chunk(encode_chunk(zero, INT8)), zero)


def test_int8_refuses_non_finite_input() -> None:
    for bad in (float("nan"), float("inf")):
        kv = _kv()
        kv[0, 1, 1, 2, 3] = bad
        with pytest.raises(ValueError, match="non-finite"):
            encode_chunk(kv, INT8)


def test_int8_refuses_values_whose_scale_would_overflow_on_decode() -> None:
    kv = _kv()
    kv[0, 0, 0, 0, 0] = torch.finfo(torch.float32).max
    with pytest.raises(ValueError, match="largest"):
        encode_chunk(kv, INT8)
    kv[0, 0, 0, 0, 0] = 1e38  # large but fine
    assert decode_chunk(encode_chunk(kv, INT8))[0, 0, 0, 0, 0] == pytest.approx(1e38, rel=1 / 254)


def test_int8_is_one_byte_per_value_plus_a_scale_per_token_row() -> None:
    layers, heads, tokens, dim = 3, 2, 37, 16
    kv = _kv(layers, heads, tokens, dim)
    values = kv.numel()
    size = len(encode_chunk(kv, INT8))
    assert size == values + 4 * layers * 2 * tokens + OVERHEAD
    # the default model's geometry: 8 + 32/192 bits per value
    big = torch.randn(30, 2, 3, 256, 64)
    assert 8 * len(encode_chunk(big, INT8)) / big.numel() == pytest.approx(8 + 32 / 192, abs=1e-3)


def test_int8_payload_size_must_match_exactly() -> None:
    data = encode_chunk(_kv(), INT8)
    payload = data[HEADER_SIZE:-4]
    for bad in (payload[:-1], payload + b"\0", payload[4:], b"", payload[:100]):
        with pytest.raises(CodecError, match="int8 payload"):
            decode_chunk(_with_payload(data, bad))


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), float("-inf"), -1.0, -1e-30, 3e38])
def test_int8_rejects_bad_scales(scale: float) -> None:
    data = bytearray(encode_chunk(_kv(), INT8))
    struct.pack_into("<f", data, HEADER_SIZE + 4 * 7, scale)
    with pytest.raises(CodecError, match="scale"):
        decode_chunk(_forge_crc(data))


def test_int8_rejects_the_reserved_code() -> None:
    kv = _kv()
    data = bytearray(encode_chunk(kv, INT8))
    scales = 4 * kv.shape[0] * 2 * kv.shape[3]
    data[HEADER_SIZE + scales + 11] = 0x80  # -128
    with pytest.raises(CodecError, match="-128"):
        decode_chunk(_forge_crc(data))


def test_int8_truncations_and_bit_flips_are_rejected() -> None:
    data = encode_chunk(_kv(layers=1, heads=1, tokens=5, dim=8), INT8)
    for n in range(len(data)):
        with pytest.raises(CodecError):
            decode_chunk(data[:n])
    for bit in range(0, 8 * len(data), 7):
        bad = bytearray(data)
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CodecError):
            decode_chunk(bytes(bad))


def test_a_reader_without_scheme_3_rejects_it_clearly() -> None:
    """What the spec promises old readers do: the scheme byte alone decides, with a clear error."""
    data = bytearray(encode_chunk(_kv(), INT8))
    data[6] = 9  # a scheme this reader does not know, as 3 is to a reader that predates it
    with pytest.raises(CodecError, match="unknown scheme 9"):
        decode_chunk(_forge_crc(data))


# -- level tables and digests ----------------------------------------------------------------------------


def test_baselines_table_loads_best_quality_first() -> None:
    levels = load_level_table(shipped_level_table(BASELINES_TABLE_FILE))
    assert [lv.name for lv in levels] == ["lossless", "fp16", "int8", "high", "medium", "low"]
    fp16, int8 = level_by_name("fp16", levels), level_by_name("int8", levels)
    assert fp16 == FP16 and fp16.cast == torch.float16 and not fp16.lossless
    assert int8 == INT8 and int8.quant is None


def test_baselines_table_is_the_default_table_plus_two_levels() -> None:
    """So that recalibrating the default table without updating this one fails here."""
    base, extended = default_level_table(), shipped_level_table(BASELINES_TABLE_FILE)
    extra = [lv for lv in extended["levels"] if lv["name"] in ("fp16", "int8")]
    assert extra == [
        {"name": "fp16", "scheme": "raw", "dtype": "float16"},
        {"name": "int8", "scheme": "int8"},
    ]
    rest = dict(extended, levels=[lv for lv in extended["levels"] if lv not in extra])
    assert {**rest, "comment": None} == {**base, "comment": None}


def test_baseline_levels_are_not_in_the_default_table() -> None:
    assert {lv.name for lv in DEFAULT_LEVELS}.isdisjoint({"fp16", "int8"})


def test_baselines_table_sizes_shrink_in_table_order() -> None:
    levels = load_level_table(shipped_level_table(BASELINES_TABLE_FILE))
    p = levels[-1].quant
    assert isinstance(p, TransformParams)
    layers, heads, dim = p.transform.shape
    kv = torch.randn(layers, 2, heads, 64, dim, generator=torch.Generator().manual_seed(3))
    sizes = [len(encode_chunk(kv, lv, position=256)) for lv in levels]
    assert sizes == sorted(sizes, reverse=True)


def _table_with(*entries: dict) -> dict:
    return {"format": "cachegen-level-table/1", "levels": [{"name": "lossless", "scheme": "raw"}, *entries]}


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"name": "x", "scheme": "raw", "dtype": "float64"}, "dtype must be one of"),
        ({"name": "x", "scheme": "raw", "dtype": 16}, "dtype must be one of"),
        ({"name": "x", "scheme": "int8", "dtype": "float16"}, "raw and zstd levels only"),
        (
            {"name": "x", "scheme": "quant", "key_step": 1, "value_step": 1, "dtype": "float16"},
            "raw and zstd",
        ),
        ({"name": "x", "scheme": "int8", "key_step": 1.0}, "no parameters"),
        ({"name": "x", "scheme": "int4"}, "'int8'"),
    ],
)
def test_bad_baseline_entries_are_rejected(entry: dict, message: str) -> None:
    with pytest.raises(LevelTableError, match=message):
        load_level_table(_table_with(entry))


def test_a_casting_level_cannot_be_first() -> None:
    table = {
        "format": "cachegen-level-table/1",
        "levels": [{"name": "fp16", "scheme": "raw", "dtype": "float16"}],
    }
    with pytest.raises(LevelTableError, match="first level must be lossless"):
        load_level_table(table)
    table["levels"][0]["dtype"] = "float32"  # a widening cast is exact
    assert load_level_table(table)[0].lossless


def test_default_digests_are_unchanged() -> None:
    assert {lv.name: level_digest(lv) for lv in DEFAULT_LEVELS} == {
        "lossless": "ac0562bba4a57c68",
        # the transform levels (format 5); the format-4 table's digests are pinned below
        "high": "1e51866f480477e0",
        "medium": "70b2994426456f2a",
        "low": "18f4a9612998bd5e",  # scheme 5 (salient tokens); scheme 4's is pinned below
    }


def test_the_scheme4_table_is_the_one_scheme_5_replaced() -> None:
    """``SmolLM2-135M-Instruct.scheme4.json``, kept for the benchmarks to measure beside the
    default table: the same high and medium, and the scheme-4 low that stored chunks name."""
    levels = load_level_table(shipped_level_table(SCHEME4_TABLE_FILE))
    assert {lv.name: level_digest(lv) for lv in levels} == {
        "lossless": "ac0562bba4a57c68",
        "high": "1e51866f480477e0",
        "medium": "70b2994426456f2a",
        "low": "7df7e90dc3fdbdf4",
    }
    assert all(lv.scheme is not Scheme.SALIENT for lv in levels)


def test_format4_digests_are_unchanged() -> None:
    levels = load_level_table(shipped_level_table(V4_TABLE_FILE))
    assert {lv.name: level_digest(lv) for lv in levels if not lv.lossless} == {
        "high": "9668b89025355602",
        "medium": "80ecc416c02f4fbd",
        "low": "4d698e1edb4030ec",
    }


def test_new_fields_change_the_digest() -> None:
    lossless = level_digest(level_by_name("lossless"))
    digests = {
        level_digest(FP16),
        level_digest(Level("bf16", Scheme.RAW, lossless=False, cast=torch.bfloat16)),
        level_digest(Level("f32", Scheme.RAW, cast=torch.float32)),
        level_digest(INT8),
        lossless,
    }
    assert len(digests) == 5
    # the digest is of what is encoded, not of the name
    assert level_digest(Level("other-name", Scheme.RAW, lossless=False, cast=torch.float16)) == level_digest(
        FP16
    )


def test_baseline_levels_round_trip_from_the_table() -> None:
    levels = load_level_table(copy.deepcopy(shipped_level_table(BASELINES_TABLE_FILE)))
    kv = _kv(layers=30, heads=3, tokens=20, dim=64)  # the default model's geometry
    for level in levels:
        out = decode_chunk(encode_chunk(kv, level))
        assert out.shape == kv.shape
        assert np.isfinite(out.float().numpy()).all()
