"""Round trips: lossless levels are bit-exact, lossy levels stay within their step bound."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import codec
from codec import DEFAULT_LEVELS, LOSSLESS, Level, Scheme, decode_chunk, encode_chunk, load_level_table
from codec.backends import NumbaBackend, decode_into
from codec.levels import V4_TABLE_FILE, shipped_level_table
from codec.parsed import parse_chunks
from codec.quantized import STEP_TABLE, QuantParams
from codec.transformed import TransformParams, group_steps

ZSTD = Level("zstd", Scheme.ZSTD)


def _kv(
    tokens: int,
    dtype: torch.dtype = torch.float32,
    layers: int = 3,
    heads: int = 2,
    dim: int = 16,
    seed: int = 0,
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(layers, 2, heads, tokens, dim, generator=g)
    kv[:, 0] *= torch.linspace(0.2, 8.0, dim)  # key channels with very different spreads, as in real keys
    kv[:, 0] += torch.linspace(-3.0, 3.0, dim)  # and offsets
    return kv.to(dtype)


@pytest.mark.parametrize("level", [LOSSLESS, ZSTD], ids=["raw", "zstd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 256, 301])
def test_lossless_round_trip_is_bit_exact(level: Level, dtype: torch.dtype, tokens: int) -> None:
    kv = _kv(tokens, dtype)
    out = decode_chunk(encode_chunk(kv, level))
    assert out.dtype == dtype and out.shape == kv.shape
    assert torch.equal(
        out.view(torch.int16 if dtype != torch.float32 else torch.int32),
        kv.view(torch.int16 if dtype != torch.float32 else torch.int32),
    )


def test_default_levels_are_ordered_and_named() -> None:
    names = [lv.name for lv in DEFAULT_LEVELS]
    assert names[0] == "lossless" and DEFAULT_LEVELS[0].lossless
    assert {"high", "medium", "low"} <= set(names)
    assert isinstance(codec.level_by_name("medium").quant, TransformParams)
    with pytest.raises(KeyError):
        codec.level_by_name("nope")


def _bound(kv: torch.Tensor, p: QuantParams) -> np.ndarray:
    """Half the step each value was quantized with, recomputed from the level's rule (x 2^(1/16) for the step code)."""
    x = kv.float().numpy()[:, :, :, p.exact_tokens :]
    layers = x.shape[0]
    ks = np.resize(np.asarray(p.key_step), layers)[:, None, None]
    vs = np.resize(np.asarray(p.value_step), layers)[:, None, None]
    if p.key_channel_rms is not None:
        k = ks / p.key_channel_rms
    else:
        k = ks * x[:, 0].std(axis=2, dtype=np.float64)
    v = vs * np.sqrt(np.mean(np.square(x[:, 1], dtype=np.float64), axis=(2, 3)))[:, :, None]
    step = np.stack([k, np.broadcast_to(v, k.shape)], axis=1)
    return 0.5 * step * 2 ** (1 / 16) * (1 + 1e-6)


V4_LEVELS = load_level_table(shipped_level_table(V4_TABLE_FILE))


@pytest.mark.parametrize("name", ["high", "medium", "low"])
@pytest.mark.parametrize("tokens", [2, 37, 256])
def test_format4_lossy_levels_error_is_within_half_a_step(name: str, tokens: int) -> None:
    level = codec.level_by_name(name, V4_LEVELS)
    p = level.quant
    assert p is not None and p.key_channel_rms is not None
    layers, heads, dim = p.key_channel_rms.shape
    kv = _kv(tokens, layers=layers, heads=heads, dim=dim)
    out = decode_chunk(encode_chunk(kv, level))
    assert out.dtype == torch.float32 and out.shape == kv.shape
    err = (out - kv).abs().numpy()
    # the first tokens are kept as fp16 (the attention sink)
    assert err[:, :, :, : p.exact_tokens].max() <= 1e-3 * kv.abs().max().item()
    assert (err[:, :, :, p.exact_tokens :] <= _bound(kv, p)[:, :, :, None, :]).all()


@pytest.mark.parametrize("groups", [1, 2, 4, 16])
@pytest.mark.parametrize("exact", [0, 1, 3])
def test_lossy_without_calibration_uses_key_spread(groups: int, exact: int) -> None:
    p = QuantParams(key_step=(0.5, 0.25, 1.0), value_step=(0.5,), exact_tokens=exact, groups=groups)
    level = Level("custom", Scheme.QUANT, lossless=False, quant=p)
    kv = _kv(50)
    out = decode_chunk(encode_chunk(kv, level))
    err = (out - kv).abs().numpy()[:, :, :, exact:]
    assert (err <= _bound(kv, p)[:, :, :, None, :]).all()


def test_lossy_handles_outliers_through_escapes() -> None:
    kv = _kv(64)
    kv[1, 0, 1, 10, 3] = 900.0  # a massive activation: far outside every probability table
    kv[2, 1, 0, 20, 5] = -1e4
    p = QuantParams(key_step=(0.5,), value_step=(0.5,))
    out = decode_chunk(encode_chunk(kv, Level("x", Scheme.QUANT, lossless=False, quant=p)))
    err = (out - kv).abs().numpy()[:, :, :, 1:]
    assert (err <= _bound(kv, p)[:, :, :, None, :] + 1e4 / 15000).all()


def test_lossy_rejects_non_finite_input() -> None:
    kv = _kv(8)
    kv[0, 0, 0, 3, 0] = float("nan")
    with pytest.raises(ValueError):
        encode_chunk(
            kv,
            Level("x", Scheme.QUANT, lossless=False, quant=QuantParams(key_step=(1.0,), value_step=(1.0,))),
        )


def test_step_table_is_powers_of_two_eighths() -> None:
    assert STEP_TABLE[128] == 1.0 and STEP_TABLE[136] == 2.0 and STEP_TABLE.dtype == np.float32


GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "golden"


def _decode(data: bytes, inverse_bf16: bool) -> torch.Tensor:
    batch = parse_chunks([data])
    out = torch.empty(batch.shape)
    decode_into(batch, out, NumbaBackend(inverse_bf16=inverse_bf16))
    return out


@pytest.mark.parametrize("name", ["high", "medium", "low"])
@pytest.mark.parametrize(
    ("tokens", "position"), [(2, 0), (37, 0), (256, 256), (100, 3000), ("model", 0), ("model", 700)]
)
def test_default_transform_levels_error_is_within_half_a_step_of_each_coefficient(
    name: str, tokens: int | str, position: int
) -> None:
    """Scheme 4 quantizes coefficients: transformed again, the decoded KV is within half a step of
    the input's coefficients (the basis is orthonormal), and the sinks are the input's."""
    level = codec.level_by_name(name)
    p = level.quant
    assert isinstance(p, TransformParams)
    t = p.transform
    layers, heads, dim = t.shape
    if tokens == "model":  # the default model's own KV of a text's first 4 tokens, its sink among them
        kv = decode_chunk((GOLDEN / "model_kv.bin").read_bytes()).float()
    else:
        kv = _kv(tokens, layers=layers, heads=heads, dim=dim)
    tokens = kv.shape[3]
    data = encode_chunk(kv, level, position=position)
    out = _decode(data, inverse_bf16=False)  # the quantizer's bound, through a float32 inverse
    assert out.dtype == torch.float32 and out.shape == kv.shape
    # a bf16 inverse (a CPU with native bf16 takes it) adds no more than bf16's rounding of KV
    fast = _decode(data, inverse_bf16=True)
    assert (fast - out).norm() <= 2**-7 * out.norm()
    sinks = min(max(p.sink_tokens - position, 0), tokens)
    assert torch.allclose(out[:, :, :, :sinks], kv[:, :, :, :sinks].half().float())
    coded = slice(sinks, tokens)
    if sinks == tokens:
        return  # all sinks: nothing coded
    want = t.forward(kv[:, :, :, coded].numpy(), position + sinks)
    got = t.forward(out[:, :, :, coded].numpy(), position + sinks)
    bound = 0.5 * group_steps(p, layers)[:, :, None, None, None] * 2 ** (1 / 16)
    # float32 round trips through the basis and RoPE add a little to the quantizer's half step
    assert (np.abs(got - want) <= bound * 1.001 + 1e-3 * np.abs(want).max()).all()
