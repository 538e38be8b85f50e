"""Scheme 5 (format 5): salient tokens get a finer step, named per layer in a bitmap the parse checks.

The encoder picks, per layer, the coded tokens whose key coefficients carry
the most energy and quantizes them with the group's step times one ratio; the
decoder scales them back before the inverse transform. Every field of the
section is checked in the parse, before anything is decoded.
"""

from __future__ import annotations

import copy
import math
import struct
import zlib
from dataclasses import replace

import numpy as np
import pytest
import torch

from codec import CodecError, Level, LevelTableError, Scheme, decode_chunk, encode_chunk, load_level_table
from codec.container import HEADER_SIZE
from codec.levels import default_level_table, level_digest
from codec.parsed import parse_chunk
from codec.quantized import STEP_TABLE
from codec.transform import fit_transform
from codec.transformed import TransformParams, salient_code, salient_tokens

LAYERS, HEADS, DIM = 2, 2, 16
PREFIX = 20  # transform id and position: the salient section follows


def _kv(tokens: int, seed: int) -> torch.Tensor:
    """Correlated KV with a few tokens far out in the keys, as attention's favourites are."""
    g = torch.Generator().manual_seed(seed)
    c = HEADS * DIM
    x = torch.randn(LAYERS, 2, tokens, c, generator=g) @ torch.randn(LAYERS, 2, c, c, generator=g)
    x[:, 0, 5::11] *= 6.0
    return x.reshape(LAYERS, 2, tokens, HEADS, DIM).permute(0, 1, 3, 2, 4).contiguous()


T = fit_transform(
    _kv(400, 1),
    np.ones((LAYERS, HEADS, DIM)),
    inv_freq=(1.0 / 10000 ** (np.arange(0, DIM, 2) / DIM)).astype(np.float32),
    model="m1",
)
PLAIN = TransformParams(T, (0.4,), (0.3,), sink_tokens=3)
SALIENT = replace(PLAIN, salient_fraction=0.1, salient_step=0.25)
TRANSFORMS = {T.id: T}


def _chunk(tokens: int = 40, position: int = 0, params: TransformParams = SALIENT) -> bytes:
    scheme = Scheme.SALIENT if params.salient else Scheme.TRANSFORM
    return encode_chunk(_kv(tokens, 7), Level("s", scheme, False, params), position=position)


def _forge_crc(data: bytes | bytearray) -> bytes:
    body = bytes(data[:-4])
    return body + struct.pack("<I", zlib.crc32(body))


def test_the_tokens_with_the_most_key_energy_are_coded_finer() -> None:
    kv = _kv(40, 7)
    data = _chunk()
    chunk = parse_chunk(data, transforms=TRANSFORMS)
    assert chunk.body.salient_ratio == STEP_TABLE[salient_code(0.25)] == 0.25
    layer, token = chunk.body.salient_rows
    # at position 0 the first 3 tokens are exact sinks: ceil(0.1 x 37) = 4 per layer among the rest
    assert np.array_equal(np.bincount(layer, minlength=LAYERS), [4] * LAYERS)
    coefficients = T.forward(kv[:, :, :, 3:].numpy(), 3)
    energy = np.square(coefficients[:, 0]).sum(axis=(1, 3))
    for lay in range(LAYERS):
        picked = sorted(token[layer == lay] - 3)
        assert picked == sorted(np.argsort(-energy[lay])[:4].tolist())
    out = decode_chunk(data, TRANSFORMS, inverse_bf16=False)
    plain = decode_chunk(_chunk(params=PLAIN), TRANSFORMS, inverse_bf16=False)
    for lay, tok in zip(layer, token, strict=True):  # a quarter of the step: a smaller error
        assert (out[lay, :, :, tok] - kv[lay, :, :, tok]).norm() < 0.5 * (
            plain[lay, :, :, tok] - kv[lay, :, :, tok]
        ).norm()
    assert torch.equal(out[:, :, :, :3], kv[:, :, :, :3].half().float())  # the sinks stay exact


def test_the_other_tokens_decode_as_in_scheme_4() -> None:
    """Only the named tokens are scaled: the rest of a chunk decodes to scheme 4's values."""
    salient = decode_chunk(_chunk(position=900), TRANSFORMS, inverse_bf16=False)
    plain = decode_chunk(_chunk(position=900, params=PLAIN), TRANSFORMS, inverse_bf16=False)
    layer, token = parse_chunk(_chunk(position=900), transforms=TRANSFORMS).body.salient_rows
    same = torch.ones(LAYERS, 40, dtype=torch.bool)
    same[torch.from_numpy(layer), torch.from_numpy(token)] = False
    for lay in range(LAYERS):
        rows = same[lay]
        torch.testing.assert_close(salient[lay][:, :, rows], plain[lay][:, :, rows], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("fraction", "tokens", "expected"), [(0.05, 1, 1), (0.05, 20, 1), (0.05, 21, 2), (1.0, 7, 7)]
)
def test_the_count_rounds_up(fraction: float, tokens: int, expected: int) -> None:
    coefficients = np.random.default_rng(0).normal(size=(3, 2, 2, tokens, 4)).astype(np.float32)
    flags = salient_tokens(coefficients, fraction)
    assert flags.sum(axis=1).tolist() == [min(expected, math.ceil(fraction * tokens))] * 3


def _with_bit(layer: int, token: int, width: int):
    def edit(d: bytearray) -> bytearray:
        d[HEADER_SIZE + PREFIX + 1 + layer * width + token // 8] |= 1 << (token % 8)
        return d

    return edit


def _set(at: int, value: bytes):
    def edit(d: bytearray) -> bytearray:
        d[at : at + len(value)] = value
        return d

    return edit


CHUNK = _chunk(tokens=13)  # 2 bytes a layer: bits 13..15 of each row are padding


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_set(HEADER_SIZE + PREFIX, b"\x80"), "salient step code 128"),  # not finer than the group's
        (_set(HEADER_SIZE + PREFIX, b"\xff"), "salient step code 255"),
        (_with_bit(1, 14, 2), "past the chunk's tokens"),  # a padding bit
        (_with_bit(0, 1, 2), "exact token"),  # token 1 is a sink, stored exactly
        (_set(4, struct.pack("<H", 4)), "scheme 5"),  # scheme 5 inside a format-4 chunk
        (_set(HEADER_SIZE, b"\x00" * 16), "transform"),
    ],
)
def test_forged_fields_are_rejected_in_the_parse(edit, message: str) -> None:
    data = _forge_crc(edit(bytearray(CHUNK)))
    with pytest.raises(CodecError, match=message):
        parse_chunk(data, transforms=TRANSFORMS)


def test_a_truncated_section_is_rejected() -> None:
    """A payload that ends inside the bitmap (length field and CRC made to agree)."""
    data = bytearray(CHUNK[: HEADER_SIZE + PREFIX + 2] + b"\0\0\0\0")
    data[18:26] = struct.pack("<Q", len(data) - HEADER_SIZE - 4)
    with pytest.raises(CodecError, match="salient-token section truncated"):
        parse_chunk(_forge_crc(data), transforms=TRANSFORMS)


def test_a_level_table_names_both_salient_fields_on_transform_levels_only() -> None:
    table = copy.deepcopy(default_level_table())
    low = next(e for e in table["levels"] if e["name"] == "low")
    for key in ("salient_fraction", "salient_step"):
        low.pop(key, None)
    before = next(lv for lv in load_level_table(copy.deepcopy(table)) if lv.name == "low")
    low |= {"salient_fraction": 0.05, "salient_step": 0.4}
    after = next(lv for lv in load_level_table(table) if lv.name == "low")
    assert before.scheme is Scheme.TRANSFORM and after.scheme is Scheme.SALIENT
    assert level_digest(after) != level_digest(before)  # its chunks are stored under other names
    for broken, message in (
        ({"salient_fraction": 0.05}, "go together"),
        ({"salient_fraction": 0.0, "salient_step": 0.4}, "salient_fraction"),
        ({"salient_fraction": 0.05, "salient_step": 1.0}, "salient_step"),
        ({"salient_fraction": 0.05, "salient_step": 1e-6}, "finer than a step code"),
    ):
        bad = copy.deepcopy(table)
        entry = next(e for e in bad["levels"] if e["name"] == "low")
        for key in ("salient_fraction", "salient_step"):
            entry.pop(key, None)
        entry |= broken
        with pytest.raises(LevelTableError, match=message):
            load_level_table(bad)


def test_a_scheme_and_params_that_disagree_are_refused_by_the_encoder() -> None:
    with pytest.raises(ValueError, match="TRANSFORM and its salient_fraction disagree"):
        encode_chunk(_kv(8, 1), Level("s", Scheme.TRANSFORM, False, SALIENT))
    with pytest.raises(ValueError, match="SALIENT and its salient_fraction disagree"):
        encode_chunk(_kv(8, 1), Level("s", Scheme.SALIENT, False, PLAIN))
    with pytest.raises(ValueError, match="salient_fraction"):
        replace(PLAIN, salient_fraction=1.5)
