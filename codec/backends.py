"""The reconstructing half of decoding: a parsed batch into a caller's tensor.

A backend writes a ``ParsedBatch`` into ``out``, a ``(layers, 2, heads, tokens,
head_dim)`` tensor of any strides (typically ``kv[:, :, :, start:end]`` of a
model's preallocated cache), on the backend's device, in ``out``'s dtype. The
values written are the CPU decoder's float32 values (the stored values, for
lossless chunks) cast to that dtype, bit for bit, whatever the backend.

``NumbaBackend`` decodes on the CPU and copies to the device if ``out`` is not
a CPU float32 tensor; ``TritonBackend`` (codec/triton_backend.py) decodes on a
GPU, every stream of the batch in one launch. ``decode_into`` picks one from
``out``'s device unless it is handed one.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import cache
from typing import Protocol

import numpy as np
import torch

from codec import int8, quantized, transformed
from codec.errors import StreamError
from codec.int8 import Int8Body
from codec.parsed import DenseBody, ParsedBatch, ParsedChunk, Transforms, parse_chunks
from codec.quantized import QuantBody
from codec.transformed import TransformBody

OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Backend(Protocol):
    def decode_into(self, batch: ParsedBatch, out: torch.Tensor) -> None:
        """Write ``batch`` into ``out``; raise ``StreamError`` (after writing) for a corrupt stream."""
        ...


def check_out(batch: ParsedBatch, out: torch.Tensor) -> None:
    if tuple(out.shape) != batch.shape:
        raise ValueError(f"output has shape {tuple(out.shape)}, the batch decodes to {batch.shape}")
    if out.dtype not in OUT_DTYPES:
        raise ValueError(f"cannot decode into {out.dtype}")


@dataclass(frozen=True)
class NumbaBackend:
    """The CPU decoder (codec/rans.py): the reference the other backends match.

    ``inverse_bf16``: the precision of scheme 4's inverse transform (None: the CPU's own choice,
    ``codec.transform.bf16_inverse``)."""

    inverse_bf16: bool | None = None

    def decode_into(self, batch: ParsedBatch, out: torch.Tensor) -> None:
        check_out(batch, out)
        for k, (chunk, start) in enumerate(zip(batch.chunks, batch.starts, strict=True)):
            try:
                decode_chunk_into(chunk, out[:, :, :, start : start + chunk.tokens], self.inverse_bf16)
            except StreamError as exc:
                raise StreamError(str(exc), k) from None


def decode_chunk_into(chunk: ParsedChunk, out: torch.Tensor, inverse_bf16: bool | None = None) -> None:
    body = chunk.body
    if isinstance(body, DenseBody):
        out.copy_(body.values)
        return
    direct = out.device.type == "cpu" and out.dtype == torch.float32
    target = out if direct else torch.empty(chunk.shape, dtype=torch.float32)
    if isinstance(body, Int8Body):
        int8.decode_into(body, target.numpy())
    else:
        quant = body.quant if isinstance(body, TransformBody) else body
        assert isinstance(quant, QuantBody)
        layers, _, heads, tokens, dim = chunk.shape
        try:  # the rows (layer, k/v, head) of a slice of a cache buffer merge into one axis
            rows = target.view(layers * 2 * heads, tokens, dim)
        except RuntimeError:
            rows = None
        if rows is None:
            scratch = np.empty((layers * 2 * heads, tokens, dim), dtype=np.float32)
            quantized.decode_into(quant, scratch)
            target.copy_(torch.from_numpy(scratch).view(chunk.shape))
        else:
            quantized.decode_into(quant, rows.numpy())
        if isinstance(body, TransformBody):  # coefficients to KV, in torch on the CPU
            transformed.inverse_(body, target, inverse_bf16)
    if not direct:
        out.copy_(target)


@cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@cache
def _triton_backend() -> Backend:
    from codec.triton_backend import TritonBackend

    return TritonBackend()


def backend_for(device: torch.device) -> Backend:
    """Triton on a CUDA device when it is installed, else the CPU decoder (and a copy)."""
    if device.type == "cuda" and triton_available():
        return _triton_backend()  # one per process: it keeps the probability tables per device
    return NumbaBackend()


def decode_into(batch: ParsedBatch, out: torch.Tensor, backend: Backend | None = None) -> None:
    """Decode ``batch`` into ``out`` (see the module docstring); ``backend`` forces one."""
    (backend or backend_for(out.device)).decode_into(batch, out)


def decode_chunks_into(
    chunks: list[bytes],
    out: torch.Tensor,
    backend: Backend | None = None,
    transforms: Transforms | None = None,
) -> None:
    """Parse every chunk, then decode them into consecutive tokens of ``out``: a chunk that the
    parse rejects raises ``CodecError`` before anything is decoded."""
    decode_into(parse_chunks(chunks, transforms), out, backend)
