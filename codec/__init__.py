"""KV-cache codec: pure computation from KV tensors to bytes and back.

No I/O, no asyncio, no settings: callers hand in tensors and level objects.
"""

from codec.chunk import decode_chunk, encode_chunk
from codec.container import FORMAT_VERSION
from codec.errors import CodecError
from codec.levels import (
    DEFAULT_LEVELS,
    LOSSLESS,
    Level,
    LevelTableError,
    Scheme,
    level_by_name,
    level_digest,
    load_level_table,
)

__all__ = [
    "DEFAULT_LEVELS",
    "FORMAT_VERSION",
    "LOSSLESS",
    "CodecError",
    "Level",
    "LevelTableError",
    "Scheme",
    "decode_chunk",
    "encode_chunk",
    "level_by_name",
    "level_digest",
    "load_level_table",
]
