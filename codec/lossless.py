"""Lossless schemes: the exact KV bytes, optionally zstd-compressed.

The zstd variant first splits every value into byte planes (all first bytes,
then all second bytes, ...): sign/exponent bytes are highly repetitive and
compress well once they sit next to each other, mantissa bytes do not.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
import zstandard

from codec.errors import CodecError
from codec.zstd_frame import decompress_exact

_ZSTD_LEVEL = 1

# ``from_raw``'s tensors are read-only views on purpose; torch warns about every one
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)


def cast(kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``kv`` in ``dtype``; refuses values that the cast would turn into infinities.

    A level that casts (the fp16 baseline) has no scale to absorb a large value,
    and an infinity in a key poisons every attention score that reads it: better
    an error that points at a scaled lossy level than a silently broken cache.
    """
    out = kv.detach().to(dtype)
    # amax is the cheap test (NaN and inf propagate into it); the mask only when it fails.
    if out.dtype != kv.dtype and out.numel() and not torch.isfinite(out.abs().amax()):
        overflow = torch.isinf(out) & torch.isfinite(kv)
        if overflow.any():
            largest = kv[overflow].abs().max().item()
            raise ValueError(
                f"KV value {largest:g} is beyond {dtype}'s range ({torch.finfo(dtype).max:g}); "
                "use a level that scales, such as int8 or a quant level"
            )
    return out


def raw_bytes(kv: torch.Tensor) -> bytes:
    """The tensor's bytes in C order; bf16 is reinterpreted as int16 for numpy."""
    flat = kv.detach().contiguous().cpu()
    if flat.dtype == torch.bfloat16:
        flat = flat.view(torch.int16)
    return flat.numpy().tobytes()


def from_raw(payload: bytes | memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The payload's values, read in place: a read-only view of ``payload`` (never write to it).

    A decode copies them once, into the cache buffer; copying them here first as well (to get a
    writable array) made a raw chunk cost two copies and a fresh allocation. ``decode_chunk``,
    which hands the tensor to its caller, copies it."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if len(payload) != itemsize * int(np.prod(shape)):
        raise CodecError("raw payload size does not match the header")
    return _as_tensor(np.frombuffer(payload, dtype=np.uint8), dtype, shape)


def zstd_encode(kv: torch.Tensor) -> bytes:
    raw = np.frombuffer(raw_bytes(kv), dtype=np.uint8)
    planes = raw.reshape(-1, kv.element_size()).T.copy()
    return zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(planes.tobytes())


def zstd_decode(payload: bytes | memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Two buffers of the chunk's size at most: the decompressed planes, and the values."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    expected = itemsize * int(np.prod(shape))
    planes = decompress_exact(payload, expected, "zstd payload")
    raw = np.frombuffer(planes, dtype=np.uint8).reshape(itemsize, -1).T.copy()
    return _as_tensor(raw, dtype, shape)


def _as_tensor(raw: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A C-ordered uint8 array's bytes as a tensor (no copy); bf16 through int16."""
    storage_dtype = torch.int16 if dtype == torch.bfloat16 else dtype
    tensor = torch.from_numpy(raw.reshape(-1)).view(storage_dtype).reshape(shape)
    return tensor.view(dtype) if dtype == torch.bfloat16 else tensor
