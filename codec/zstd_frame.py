"""zstd decompression that never allocates more than the caller expects.

A zstd frame may declare its own content size, and the decompressor sizes its
output buffer from that field, ignoring ``max_output_size``: a corrupted (or
hostile) frame could ask for gigabytes. The declared size is checked first.
"""

from __future__ import annotations

import zstandard

from codec.errors import CodecError


def decompress_exact(data: bytes | memoryview, expected: int, what: str) -> bytes:
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise CodecError(f"{what} is not a zstd frame: {exc}") from None
    if declared not in (expected, -1):  # -1: the frame does not say
        raise CodecError(f"{what} declares {declared} bytes, expected {expected}")
    try:
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=expected)
    except zstandard.ZstdError as exc:
        raise CodecError(f"{what} is corrupt: {exc}") from None
    if len(out) != expected:
        raise CodecError(f"{what} has {len(out)} bytes, expected {expected}")
    return out
