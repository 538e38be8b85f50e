"""The chunk container: fixed header, scheme payload, CRC32 trailer.

Layout (little-endian) is specified in codec/BITSTREAM.md; this module is the
one place that reads and writes it. Everything read is validated before use.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from codec.errors import CodecError

MAGIC = b"CGKV"
# 2: adds the lossy QUANT scheme (scheme byte 2); 3: its side info is zstd-compressed;
# 4: scheme 2 says whether its exact tokens are float16 or float32 (codec/BITSTREAM.md).
FORMAT_VERSION = 4
READ_VERSIONS = (3, 4)  # what this build decodes; it writes FORMAT_VERSION only

# magic, version, scheme, dtype, layers, kv_heads, head_dim, tokens, payload_len
_HEADER = struct.Struct("<4sHBBHHHIQ")
_TRAILER = struct.Struct("<I")
HEADER_SIZE = _HEADER.size
OVERHEAD = _HEADER.size + _TRAILER.size


@dataclass(frozen=True)
class ChunkHeader:
    scheme: int
    dtype: int
    layers: int
    kv_heads: int
    head_dim: int
    tokens: int
    payload_len: int
    version: int = FORMAT_VERSION  # of the chunk read; a writer always writes FORMAT_VERSION

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """Shape of the KV tensor: (layers, 2 [key, value], kv_heads, tokens, head_dim)."""
        return (self.layers, 2, self.kv_heads, self.tokens, self.head_dim)

    @property
    def values(self) -> int:
        return self.layers * 2 * self.kv_heads * self.tokens * self.head_dim


def pack(header: ChunkHeader, payload: bytes | memoryview) -> bytes:
    if header.payload_len != len(payload):
        raise ValueError("payload_len does not match the payload")
    head = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        header.scheme,
        header.dtype,
        header.layers,
        header.kv_heads,
        header.head_dim,
        header.tokens,
        header.payload_len,
    )
    crc = zlib.crc32(payload, zlib.crc32(head))
    return b"".join((head, payload, _TRAILER.pack(crc)))


def read_header(data: bytes | memoryview) -> ChunkHeader:
    """Parse and check the fixed header alone (no checksum: for inspection)."""
    if len(data) < _HEADER.size:
        raise CodecError(f"chunk too short for a header: {len(data)} bytes")
    magic, version, scheme, dtype, layers, heads, head_dim, tokens, payload_len = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CodecError("not a KV chunk (bad magic)")
    if version not in READ_VERSIONS:
        raise CodecError(f"unsupported chunk format version {version} (this build reads {READ_VERSIONS})")
    if min(layers, heads, head_dim, tokens) == 0:
        raise CodecError("chunk header has a zero dimension")
    return ChunkHeader(scheme, dtype, layers, heads, head_dim, tokens, payload_len, version)


def unpack(data: bytes | memoryview) -> tuple[ChunkHeader, memoryview]:
    """Header and payload of a whole container, after the length and CRC checks."""
    view = memoryview(data)
    header = read_header(view)
    expected = OVERHEAD + header.payload_len
    if len(view) != expected:
        raise CodecError(f"chunk length {len(view)} does not match its header ({expected})")
    body_end = len(view) - _TRAILER.size
    (crc,) = _TRAILER.unpack_from(view, body_end)
    if zlib.crc32(view[:body_end]) != crc:
        raise CodecError("chunk checksum mismatch")
    return header, view[_HEADER.size : body_end]
