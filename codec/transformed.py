"""Scheme 4, transform coding: scheme 2's quantizer and rANS streams over a transform's coefficients.

The encoder turns each (layer, K/V) group's KV vectors into coefficients with
the model's calibrated transform (``codec.transform``: keys rotated back to
before RoPE, a PCA basis over every KV head and channel), quantizes every
component of a group with the group's one step (the rate-distortion choice
once the weights put errors in the units that matter) and codes them with
scheme 2's body. The first ``sink_tokens`` positions of a context (the
attention sinks) are stored exactly, in the model's own domain.

Decoding is scheme 2's integer decode (the same streams, on either backend)
into float32 coefficients, then the transform's inverse (a matmul per group
and RoPE for the chunk's positions) in torch on the output's device. The
payload names the transform by id: a chunk never decodes under another.
Layout: codec/BITSTREAM.md, "Scheme 4".
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from codec import quantized
from codec.errors import CodecError
from codec.quantized import DEFAULT_GROUPS, QuantBody
from codec.transform import ID_BYTES, KVTransform

# transform id, position of the chunk's first token in its context
_PREFIX = struct.Struct(f"<{ID_BYTES}sI")
MAX_POSITION = 1 << 31  # a chunk's last position stays below this


@dataclass(frozen=True)
class TransformParams:
    """How a transform level chooses its steps; the encoder's business only, never stored."""

    transform: KVTransform
    key_step: tuple[float, ...]  # per layer (or one for all), in the transform's weighted units
    value_step: tuple[float, ...]
    sink_tokens: int = 4  # positions of a context below this are stored exactly
    groups: int = DEFAULT_GROUPS

    def __hash__(self) -> int:
        return id(self)


@dataclass(frozen=True)
class TransformBody:
    """A scheme-4 payload after the host-side parse: its scheme-2 body over coefficients."""

    transform: KVTransform
    position: int
    quant: QuantBody

    @property
    def exact_tokens(self) -> int:
        return self.quant.exact_tokens


def group_steps(p: TransformParams, layers: int) -> np.ndarray:
    """(layers, 2) steps: one per (layer, K/V) group."""
    keys = quantized._per_layer(p.key_step, layers)
    values = quantized._per_layer(p.value_step, layers)
    return np.stack([keys, values], axis=1)


def encode(kv: torch.Tensor, p: TransformParams, position: int) -> bytes:
    layers, _, heads, tokens, dim = kv.shape
    t = p.transform
    if t.shape != (layers, heads, dim):
        raise ValueError(f"the transform is for KV of {t.shape}, the chunk is {(layers, heads, dim)}")
    if dim % p.groups:
        raise ValueError(f"head_dim {dim} is not divisible into {p.groups} stream groups")
    if not 0 <= position <= MAX_POSITION - tokens:
        raise ValueError(f"position {position} out of range")
    x = kv.detach().to(device="cpu", dtype=torch.float32).numpy()
    if not np.isfinite(x).all():
        raise ValueError("KV chunk has non-finite values")
    n_exact = min(max(p.sink_tokens - position, 0), tokens)
    coefficients = t.forward(x[:, :, :, n_exact:], position + n_exact)
    steps = np.broadcast_to(group_steps(p, layers)[:, :, None, None], (layers, 2, heads, dim))
    body = quantized.encode_body(x[:, :, :, :n_exact], coefficients, steps, p.groups)
    return _PREFIX.pack(t.id, position) + body


def parse(
    payload: bytes | memoryview,
    shape: tuple[int, int, int, int, int],
    version: int,
    transforms: Mapping[bytes, KVTransform],
) -> TransformBody:
    view = memoryview(payload)
    if len(view) < _PREFIX.size:
        raise CodecError("transform payload truncated in its prefix")
    ident, position = _PREFIX.unpack_from(view)
    transform = transforms.get(bytes(ident))
    if transform is None:
        raise CodecError(
            f"chunk was coded with transform {bytes(ident).hex()}, which this reader does not have"
        )
    layers, _, heads, tokens, dim = shape
    if transform.shape != (layers, heads, dim):
        raise CodecError(f"transform {transform.id.hex()} is for KV of {transform.shape}, not {shape}")
    if position > MAX_POSITION - tokens:
        raise CodecError(f"chunk position {position} out of range")
    return TransformBody(transform, position, quantized.parse(view[_PREFIX.size :], shape, version))


def inverse_(body: TransformBody, values: torch.Tensor, bf16: bool | None = None) -> None:
    """Turn a decoded chunk's coefficients in ``values`` (its float32 output, any strides, on any
    device) into KV in place; its exact tokens are already KV. ``bf16``: as ``KVTransform.inverse_``."""
    e = body.exact_tokens
    body.transform.inverse_(values[:, :, :, e:], body.position + e, bf16)
