"""Dtype codes stored in chunk headers."""

from __future__ import annotations

import torch

from codec.errors import CodecError

DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
# Names a level table uses for them (a level's "dtype" field).
DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
NAME_OF_DTYPE = {dtype: name for name, dtype in DTYPE_NAMES.items()}


def dtype_code(dtype: torch.dtype) -> int:
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise CodecError(f"unsupported KV dtype {dtype}") from None


def code_dtype(code: int) -> torch.dtype:
    try:
        return CODE_DTYPES[code]
    except KeyError:
        raise CodecError(f"unknown dtype code {code}") from None
