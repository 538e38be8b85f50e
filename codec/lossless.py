"""Lossless schemes: the exact KV bytes, optionally zstd-compressed.

The zstd variant first splits every value into byte planes (all first bytes,
then all second bytes, ...): sign/exponent bytes are highly repetitive and
compress well once they sit next to each other, mantissa bytes do not.
"""

from __future__ import annotations

import numpy as np
import torch
import zstandard

from codec.errors import CodecError
from codec.zstd_frame import decompress_exact

_ZSTD_LEVEL = 1


def raw_bytes(kv: torch.Tensor) -> bytes:
    """The tensor's bytes in C order; bf16 is reinterpreted as int16 for numpy."""
    flat = kv.detach().contiguous().cpu()
    if flat.dtype == torch.bfloat16:
        flat = flat.view(torch.int16)
    return flat.numpy().tobytes()


def from_raw(payload: bytes | memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if len(payload) != itemsize * int(np.prod(shape)):
        raise CodecError("raw payload size does not match the header")
    storage_dtype = torch.int16 if dtype == torch.bfloat16 else dtype
    tensor = torch.frombuffer(bytearray(payload), dtype=storage_dtype).reshape(shape)
    return tensor.view(dtype) if dtype == torch.bfloat16 else tensor


def zstd_encode(kv: torch.Tensor) -> bytes:
    raw = np.frombuffer(raw_bytes(kv), dtype=np.uint8)
    planes = raw.reshape(-1, kv.element_size()).T.copy()
    return zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(planes.tobytes())


def zstd_decode(payload: bytes | memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    expected = itemsize * int(np.prod(shape))
    planes = decompress_exact(payload, expected, "zstd payload")
    raw = np.frombuffer(planes, dtype=np.uint8).reshape(itemsize, -1).T.copy()
    return from_raw(raw.tobytes(), dtype, shape)
