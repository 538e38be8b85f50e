"""encode_chunk / decode_chunk: the codec's public entry points.

A chunk's KV is a tensor of shape (layers, 2, kv_heads, tokens, head_dim),
keys at index 0 and values at index 1 of the second axis.
"""

from __future__ import annotations

import torch

from codec import container, int8, lossless, quantized, transformed
from codec.backends import decode_chunk_into
from codec.dtypes import dtype_code
from codec.levels import TRANSFORM_SCHEMES, Level, Scheme
from codec.parsed import DenseBody, Transforms, parse_chunk


def encode_chunk(kv: torch.Tensor, level: Level, position: int = 0) -> bytes:
    """``position``: where the chunk's first token sits in its context (a transform level codes
    keys before RoPE, and stores the first tokens of a context exactly)."""
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"KV chunk must be (layers, 2, kv_heads, tokens, head_dim), got {tuple(kv.shape)}")
    if level.cast is not None:
        kv = lossless.cast(kv, level.cast)
    if level.scheme is Scheme.RAW:
        payload = lossless.raw_bytes(kv)
    elif level.scheme is Scheme.ZSTD:
        payload = lossless.zstd_encode(kv)
    elif level.scheme is Scheme.QUANT:
        if level.quant is None:
            raise ValueError(f"level {level.name!r} has no quantization parameters")
        payload = quantized.encode(kv, level.quant)
    elif level.scheme is Scheme.INT8:
        payload = int8.encode(kv)
    elif level.scheme in TRANSFORM_SCHEMES:
        if not isinstance(level.quant, transformed.TransformParams):
            raise ValueError(f"level {level.name!r} has no transform parameters")
        if level.quant.salient != (level.scheme is Scheme.SALIENT):
            raise ValueError(
                f"level {level.name!r}: scheme {level.scheme.name} and its salient_fraction disagree"
            )
        payload = transformed.encode(kv, level.quant, position)
    else:  # pragma: no cover - every scheme is handled above
        raise ValueError(f"no encoder for scheme {level.scheme}")
    layers, _, heads, tokens, head_dim = kv.shape
    header = container.ChunkHeader(
        scheme=int(level.scheme),
        dtype=dtype_code(kv.dtype),
        layers=layers,
        kv_heads=heads,
        head_dim=head_dim,
        tokens=tokens,
        payload_len=len(payload),
    )
    return container.pack(header, payload)


def decode_chunk(
    data: bytes | memoryview, transforms: Transforms | None = None, inverse_bf16: bool | None = None
) -> torch.Tensor:
    """The KV tensor of a chunk, on the CPU.

    Lossless schemes return the exact dtype and bits they were given (a casting
    level's dtype: float16 for ``fp16``); the lossy schemes return float32 (the
    caller casts to the model's dtype). To decode straight into a model's cache,
    on its device, use ``parse_chunks`` and ``decode_into``. ``inverse_bf16``: as
    ``NumbaBackend``'s.
    """
    chunk = parse_chunk(data, transforms=transforms)
    if isinstance(chunk.body, DenseBody):
        return chunk.body.values.clone()  # a raw chunk's values are a read-only view of ``data``
    out = torch.empty(chunk.shape, dtype=torch.float32)
    decode_chunk_into(chunk, out, inverse_bf16)
    return out
