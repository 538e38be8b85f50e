"""KV-cache codec: pure computation from KV tensors to bytes and back.

No I/O, no asyncio, no settings: callers hand in tensors and level objects.
"""

from codec.backends import Backend, NumbaBackend, backend_for, decode_chunks_into, decode_into
from codec.chunk import decode_chunk, encode_chunk
from codec.container import FORMAT_VERSION, max_chunk_bytes, raw_chunk_bytes
from codec.errors import CodecError, ShapeMismatch, StreamError
from codec.levels import (
    DEFAULT_LEVELS,
    LOSSLESS,
    Level,
    LevelTableError,
    TRANSFORM_SCHEMES,
    Scheme,
    level_by_name,
    level_digest,
    level_transforms,
    load_level_table,
)
from codec.parsed import ParsedBatch, ParsedChunk, parse_chunk, parse_chunks
from codec.transform import KVTransform, TransformError

__all__ = [
    "DEFAULT_LEVELS",
    "FORMAT_VERSION",
    "LOSSLESS",
    "Backend",
    "CodecError",
    "KVTransform",
    "Level",
    "LevelTableError",
    "NumbaBackend",
    "ParsedBatch",
    "ParsedChunk",
    "Scheme",
    "ShapeMismatch",
    "StreamError",
    "TRANSFORM_SCHEMES",
    "TransformError",
    "backend_for",
    "decode_chunk",
    "decode_chunks_into",
    "decode_into",
    "encode_chunk",
    "level_by_name",
    "level_digest",
    "level_transforms",
    "load_level_table",
    "max_chunk_bytes",
    "parse_chunk",
    "parse_chunks",
    "raw_chunk_bytes",
]
