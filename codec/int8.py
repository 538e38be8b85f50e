"""Scheme 3: per-token absmax int8, the baseline of the CacheGen paper and LMCache.

One float32 scale per (layer, k/v, token), the absolute maximum over heads and
channels divided by 127, and one int8 per value, rounded to nearest. It is
here as a quality level that benchmarks (and users) can name, not as a rival
to scheme 2: it spends 8 bits where scheme 2's `high` spends ~4.5 at similar
quality (docs/codec.md). Layout and validation: codec/BITSTREAM.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from codec.errors import CodecError

QMAX = 127  # symmetric: -128 is never written, and a reader rejects it


def payload_size(shape: tuple[int, int, int, int, int]) -> int:
    layers, _, heads, tokens, dim = shape
    return 4 * layers * 2 * tokens + layers * 2 * heads * tokens * dim


def encode(kv: torch.Tensor) -> bytes:
    x = kv.detach().to(device="cpu", dtype=torch.float32)
    absmax = x.abs().amax(dim=(2, 4))  # (L, 2, T); NaN and inf propagate into it
    if not torch.isfinite(absmax).all():
        raise ValueError("KV chunk has non-finite values")
    scale = absmax / QMAX
    if not torch.isfinite(scale * QMAX).all():  # the reader's check: no decoded value may overflow
        raise ValueError("KV chunk has values too close to float32's largest for int8 scales")
    # An all-zero token row has scale 0 and codes 0; divide it by 1 instead of 0.
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))[:, :, None, :, None]
    q = torch.round(x / divisor).clamp_(-QMAX, QMAX).to(torch.int8)
    return scale.numpy().astype("<f4").tobytes() + q.numpy().tobytes()


@dataclass(frozen=True)
class Int8Body:
    """A scheme-3 payload after the host-side parse: scales checked, no reserved code."""

    scales: np.ndarray  # float32, (layers*2*tokens,) in order (l, kv, t)
    codes: np.ndarray  # int8, the tensor's values in C order


def parse(payload: bytes | memoryview, shape: tuple[int, int, int, int, int]) -> Int8Body:
    layers, _, _, tokens, _ = shape
    if len(payload) != payload_size(shape):
        raise CodecError(f"int8 payload is {len(payload)} bytes, the header needs {payload_size(shape)}")
    n_scales = layers * 2 * tokens
    scale = np.frombuffer(payload, dtype="<f4", count=n_scales)
    # scale * 127 finite: also no decoded value overflows (a forged huge scale would make infinities).
    with np.errstate(over="ignore", invalid="ignore"):
        bounded = np.isfinite(scale * np.float32(QMAX)).all()
    if not bounded or (scale < 0).any():
        raise CodecError("int8 payload has a non-finite, overflowing or negative scale")
    q = np.frombuffer(payload, dtype=np.int8, offset=4 * n_scales)
    if q.size and int(q.min()) < -QMAX:
        raise CodecError("int8 payload has the reserved code -128")
    return Int8Body(scales=scale, codes=q)


def decode_into(body: Int8Body, out: np.ndarray) -> None:
    """``out``: float32 (layers, 2, heads, tokens, head_dim), any strides, on the CPU."""
    layers, _, _, tokens, _ = out.shape
    # One pass: int8 times float32 scale straight into float32 (about 1 ms per 256-token chunk).
    np.multiply(
        body.codes.reshape(out.shape), body.scales.reshape(layers, 2, 1, tokens, 1), out=out, dtype=np.float32
    )
