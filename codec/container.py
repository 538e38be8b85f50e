"""The chunk container: fixed header, scheme payload, CRC32 trailer.

Layout (little-endian) is specified in codec/BITSTREAM.md; this module is the
one place that reads and writes it. Everything read is validated before use.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

# zlib's CRC-32, computed with ISA-L's carry-less multiply kernels: 7x faster than zlib's own on
# an 11 MB lossless chunk (0.4 against 2.8 ms), and every chunk of a load is checked
from isal.isal_zlib import crc32

from codec.errors import CodecError, ShapeMismatch

MAGIC = b"CGKV"
# 2: adds the lossy QUANT scheme (scheme byte 2); 3: its side info is zstd-compressed;
# 4: scheme 2 says whether its exact tokens are float16 or float32; 5: adds scheme 4, transform
# coding (codec/BITSTREAM.md).
FORMAT_VERSION = 5
READ_VERSIONS = (3, 4, 5)  # what this build decodes; it writes FORMAT_VERSION only

# magic, version, scheme, dtype, layers, kv_heads, head_dim, tokens, payload_len
_HEADER = struct.Struct("<4sHBBHHHIQ")
_TRAILER = struct.Struct("<I")
HEADER_SIZE = _HEADER.size
OVERHEAD = _HEADER.size + _TRAILER.size
# A forged header must not make a decoder allocate without bound, whatever the scheme: a
# chunk is a few million values (SmolLM2-135M: 2.9M for 256 tokens), and a 16-bit rANS word
# can hold at most this many symbols. Callers that know the model pass its exact shape.
MAX_VALUES = 1 << 27

Shape = tuple[int, int, int, int, int]


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


def max_chunk_bytes(shape: Shape) -> int:
    """An upper bound on the size of a valid chunk of ``shape``, under any scheme: what a reader
    may download for it. Raw float32 is 4 bytes a value; a lossy chunk stays under 8 (at most 4
    for its exact tokens, under 2 for coded ones) plus per-channel side info and stream tables
    (under 16 bytes a channel), plus the prefix and zstd framing."""
    layers, _, heads, tokens, dim = shape
    return OVERHEAD + 8 * layers * 2 * heads * tokens * dim + 16 * layers * 2 * heads * dim + (1 << 16)


def raw_chunk_bytes(shape: Shape) -> int:
    """The size of a lossless float32 chunk of ``shape``: what a chunk of any level takes at most
    in practice (a lossy one is a fraction of it; ``max_chunk_bytes`` is the bound to refuse at)."""
    layers, _, heads, tokens, dim = shape
    return OVERHEAD + 4 * layers * 2 * heads * tokens * dim


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
    crc = crc32(payload, crc32(head))
    return b"".join((head, payload, _TRAILER.pack(crc)))


def read_header(data: bytes | memoryview, expect: Shape | None = None) -> ChunkHeader:
    """Parse and check the fixed header alone (no checksum: for inspection).

    ``expect``: the (layers, 2, kv_heads, tokens, head_dim) the caller will decode into; any
    other shape raises ``ShapeMismatch`` here, before the payload is touched.
    """
    if len(data) < _HEADER.size:
        raise CodecError(f"chunk too short for a header: {len(data)} bytes")
    magic, version, scheme, dtype, layers, heads, head_dim, tokens, payload_len = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CodecError("not a KV chunk (bad magic)")
    if version not in READ_VERSIONS:
        raise CodecError(f"unsupported chunk format version {version} (this build reads {READ_VERSIONS})")
    if min(layers, heads, head_dim, tokens) == 0:
        raise CodecError("chunk header has a zero dimension")
    header = ChunkHeader(scheme, dtype, layers, heads, head_dim, tokens, payload_len, version)
    if expect is not None and header.shape != tuple(expect):
        raise ShapeMismatch(f"chunk header declares shape {header.shape}, expected {tuple(expect)}")
    if header.values > MAX_VALUES:
        raise CodecError(f"chunk header declares {header.values} values, over the limit of {MAX_VALUES}")
    return header


def unpack(data: bytes | memoryview, expect: Shape | None = None) -> tuple[ChunkHeader, memoryview]:
    """Header and payload of a whole container, after the shape, length and CRC checks."""
    view = memoryview(data)
    header = read_header(view, expect)
    expected = OVERHEAD + header.payload_len
    if len(view) != expected:
        raise CodecError(f"chunk length {len(view)} does not match its header ({expected})")
    body_end = len(view) - _TRAILER.size
    (crc,) = _TRAILER.unpack_from(view, body_end)
    if crc32(view[:body_end]) != crc:
        raise CodecError("chunk checksum mismatch")
    return header, view[_HEADER.size : body_end]
