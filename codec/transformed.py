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

Scheme 5 adds salient tokens: per layer, the few tokens of a chunk whose keys
carry the most energy in the transform's weighted units (the tokens attention
concentrates on, besides the sinks) are quantized with a finer step, the
group's step times one ratio per chunk. The encoder divides their
coefficients by the ratio before scheme 2's quantizer, the decoder multiplies
them back before the inverse; a bitmap per layer names them. On the default
model a 0.8-bit level loses about a quarter as much perplexity this way
(docs/codec.md, "Salient tokens"). Layout: codec/BITSTREAM.md, "Scheme 5".
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from codec import quantized
from codec.errors import CodecError
from codec.quantized import DEFAULT_GROUPS, STEP_TABLE, QuantBody
from codec.transform import ID_BYTES, KVTransform, RowScale

# transform id, position of the chunk's first token in its context
_PREFIX = struct.Struct(f"<{ID_BYTES}sI")
MAX_POSITION = 1 << 31  # a chunk's last position stays below this
# Scheme 5: a salient token's step is the group's times STEP_TABLE[code], code below this (finer).
SALIENT_CODES = 128


def salient_code(ratio: float) -> int:
    """The scheme-5 step code nearest ``ratio`` (0 < ratio < 1): its step is ``STEP_TABLE[code]``."""
    if not 0.0 < ratio < 1.0:
        raise ValueError(f"a salient step ratio must be in (0, 1), got {ratio}")
    return int(min(max(round(128 + 8 * np.log2(ratio)), 0), SALIENT_CODES - 1))


@dataclass(frozen=True)
class TransformParams:
    """How a transform level chooses its steps; the encoder's business only, never stored."""

    transform: KVTransform
    key_step: tuple[float, ...]  # per layer (or one for all), in the transform's weighted units
    value_step: tuple[float, ...]
    sink_tokens: int = 4  # positions of a context below this are stored exactly
    groups: int = DEFAULT_GROUPS
    # scheme 5: per layer, this fraction of a chunk's coded tokens (rounded up) whose keys carry the
    # most energy get a step ``salient_step`` times finer (a ratio, rounded to a step code); 0: scheme 4
    salient_fraction: float = 0.0
    salient_step: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.salient_fraction <= 1.0:
            raise ValueError(f"salient_fraction must be in [0, 1], got {self.salient_fraction}")
        if self.salient_fraction:
            salient_code(self.salient_step)  # raises if out of range

    def __hash__(self) -> int:
        return id(self)

    @property
    def salient(self) -> bool:
        """Whether the level writes scheme 5."""
        return self.salient_fraction > 0.0


@dataclass(frozen=True)
class TransformBody:
    """A scheme-4 payload after the host-side parse: its scheme-2 body over coefficients."""

    transform: KVTransform
    position: int
    quant: QuantBody
    # scheme 5: the salient tokens' step ratio and their (layer, chunk token) indices, int64 each
    salient_ratio: float = 1.0
    salient_rows: tuple[np.ndarray, np.ndarray] | None = None

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
    salient = b""
    if p.salient:
        code = salient_code(p.salient_step)
        flags = salient_tokens(coefficients, p.salient_fraction)  # (layers, coded tokens)
        # quantized with the group's step, these decode to coefficient / ratio: finer by the ratio
        layer, token = np.nonzero(flags)
        coefficients[layer, :, :, token, :] /= STEP_TABLE[code]
        mask = np.zeros((layers, tokens), dtype=bool)
        mask[:, n_exact:] = flags
        salient = bytes([code]) + np.packbits(mask, axis=1, bitorder="little").tobytes()
    body = quantized.encode_body(x[:, :, :, :n_exact], coefficients, steps, p.groups)
    return _PREFIX.pack(t.id, position) + salient + body


def salient_tokens(coefficients: np.ndarray, fraction: float) -> np.ndarray:
    """(layers, tokens) bool: per layer, the ``ceil(fraction * tokens)`` tokens whose key
    coefficients (layers, 2, heads, tokens, head_dim) carry the most energy. The weights put keys
    in units of logit error, so a key far from the mean in them is one queries react to: on the
    default model these are the tokens attention concentrates on besides the sinks."""
    layers, _, _, tokens, _ = coefficients.shape
    flags = np.zeros((layers, tokens), dtype=bool)
    k = min(tokens, math.ceil(fraction * tokens - 1e-9))
    if k:
        # the largest k per layer; ties go to the earlier token (a stable sort of the negation)
        order = np.argsort(-coefficient_energy(coefficients, 0), axis=1, kind="stable")[:, :k]
        np.put_along_axis(flags, order, True, axis=1)
    return flags


def coefficient_energy(coefficients: np.ndarray, side: int) -> np.ndarray:
    """(layers, tokens), float64: the sum of squares of each token's key (``side`` 0) or value (1)
    coefficients, over every head and component."""
    return np.square(coefficients[:, side], dtype=np.float64).sum(axis=(1, 3))


def parse(
    payload: bytes | memoryview,
    shape: tuple[int, int, int, int, int],
    version: int,
    transforms: Mapping[bytes, KVTransform],
    salient: bool = False,
) -> TransformBody:
    """A scheme-4 payload, or with ``salient`` a scheme-5 one."""
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
    offset, ratio, mask = _PREFIX.size, 1.0, None
    if salient:
        width = (tokens + 7) // 8
        if len(view) < offset + 1 + layers * width:
            raise CodecError("salient-token section truncated")
        code = view[offset]
        if code >= SALIENT_CODES:
            raise CodecError(f"salient step code {code} is not finer than the group's step")
        bits = np.frombuffer(view[offset + 1 : offset + 1 + layers * width], dtype=np.uint8)
        mask = np.unpackbits(bits.reshape(layers, width), axis=1, bitorder="little").astype(bool)
        if mask[:, tokens:].any():
            raise CodecError("salient-token bitmap has bits set past the chunk's tokens")
        ratio, mask, offset = float(STEP_TABLE[code]), mask[:, :tokens], offset + 1 + layers * width
    quant = quantized.parse(view[offset:], shape, version)
    if mask is None:
        return TransformBody(transform, position, quant)
    if mask[:, : quant.exact_tokens].any():
        raise CodecError("salient-token bitmap names an exact token")
    layer, token = np.nonzero(mask)
    return TransformBody(transform, position, quant, ratio, (layer.astype(np.int64), token.astype(np.int64)))


def inverse_(body: TransformBody, values: torch.Tensor, bf16: bool | None = None) -> None:
    """Turn a decoded chunk's coefficients in ``values`` (its float32 output, any strides, on any
    device) into KV in place; its exact tokens are already KV. ``bf16``: as ``KVTransform.inverse_``."""
    e = body.exact_tokens
    scale = None
    if body.salient_rows is not None and body.salient_rows[0].size:  # back from the group's step to their own
        layer, token = body.salient_rows
        scale = RowScale(layer, token - e, body.salient_ratio)
    body.transform.inverse_(values[:, :, :, e:], body.position + e, bf16, scale)
