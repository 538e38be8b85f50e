"""Hostile chunk bytes for the tests: valid containers whose fields lie."""

from __future__ import annotations

import struct
import zlib

import zstandard

from codec import Scheme


def forge_crc(data: bytes | bytearray) -> bytes:
    """``data`` with its CRC-32 trailer recomputed, so only the inner checks can refuse it."""
    body = bytes(data[:-4])
    return body + struct.pack("<I", zlib.crc32(body))


def zstd_bomb(layers: int, heads: int, tokens: int, dim: int) -> bytes:
    """A float32 zstd chunk, CRC valid, whose frame of zeros inflates to the whole declared tensor;
    made without ever holding that tensor (a streaming compressor over zero blocks)."""
    block = bytes(1 << 20)
    total = 4 * layers * 2 * heads * tokens * dim
    out = zstandard.ZstdCompressor(level=1).compressobj(size=total)
    parts = [out.compress(block) for _ in range(total // len(block))]
    parts.append(out.compress(bytes(total % len(block))))
    parts.append(out.flush())
    payload = b"".join(parts)
    head = struct.pack("<4sHBBHHHIQ", b"CGKV", 4, int(Scheme.ZSTD), 0, layers, heads, dim, tokens, len(payload))
    return forge_crc(head + payload + bytes(4))
