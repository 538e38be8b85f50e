"""The host-side half of decoding: bytes to a checked, parsed chunk.

Everything that can be checked without running the entropy decoder is checked
here (container, CRC, scheme fields, section sizes, side info, table indices,
stream lengths, int8 scales and codes), so a backend only reconstructs values
from a ``ParsedChunk`` and a corrupt chunk is rejected before any kernel is
launched. The one fault left for the backend is a stream forged under a valid
CRC whose rANS state does not end where the encoder started (``StreamError``).
Lossless payloads are decompressed here: there is nothing left for a backend
to do but copy them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from codec import container, int8, lossless, quantized, transformed
from codec.dtypes import code_dtype
from codec.errors import CodecError
from codec.int8 import Int8Body
from codec.levels import TRANSFORM_SCHEMES, Scheme, loaded_transforms
from codec.quantized import QuantBody
from codec.transform import KVTransform
from codec.transformed import TransformBody


@dataclass(frozen=True)
class DenseBody:
    """A lossless chunk's values, decompressed, in the dtype it was stored in."""

    values: torch.Tensor  # (layers, 2, heads, tokens, head_dim), on the CPU


Body = DenseBody | Int8Body | QuantBody | TransformBody
Transforms = Mapping[bytes, KVTransform]  # by id: the transforms a reader decodes


@dataclass(frozen=True)
class ParsedChunk:
    header: container.ChunkHeader
    body: Body

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return self.header.shape

    @property
    def tokens(self) -> int:
        return self.header.tokens

    @property
    def dtype(self) -> torch.dtype:
        """What ``decode_chunk`` returns: the stored dtype if lossless, float32 if lossy."""
        return self.body.values.dtype if isinstance(self.body, DenseBody) else torch.float32


@dataclass(frozen=True)
class ParsedBatch:
    """Chunks of one model's KV that decode into consecutive tokens of one output.

    Chunk ``k`` goes to tokens ``starts[k] : starts[k] + chunks[k].tokens`` of a
    ``(layers, 2, heads, tokens, head_dim)`` output; their layers, heads and
    head_dim must agree.
    """

    chunks: tuple[ParsedChunk, ...]

    def __post_init__(self) -> None:
        if not self.chunks:
            raise ValueError("a batch needs at least one chunk")
        dims = {(c.shape[0], c.shape[2], c.shape[4]) for c in self.chunks}
        if len(dims) > 1:
            raise ValueError(f"chunks of one batch must share layers, heads and head_dim, got {sorted(dims)}")

    @property
    def starts(self) -> list[int]:
        return [0, *accumulate(c.tokens for c in self.chunks)][:-1]

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        layers, _, heads, _, dim = self.chunks[0].shape
        return (layers, 2, heads, sum(c.tokens for c in self.chunks), dim)


def parse_chunk(
    data: bytes | memoryview, expect: container.Shape | None = None, transforms: Transforms | None = None
) -> ParsedChunk:
    """``expect``: the shape the caller needs; a chunk of any other shape raises ``ShapeMismatch``
    from its header alone. Without it, only the codec's own bound (``container.MAX_VALUES``)
    limits what a header may make the parse allocate. ``transforms``: the ones a scheme-4 chunk
    may name (by ``KVTransform.id``), default every one a level table loaded in this process
    named (``codec.levels.loaded_transforms``); a chunk coded with any other is refused."""
    header, payload = container.unpack(data, expect)
    dtype = code_dtype(header.dtype)
    try:
        scheme = Scheme(header.scheme)
    except ValueError:
        raise CodecError(f"unknown scheme {header.scheme}") from None
    body: Body
    if scheme is Scheme.RAW:
        body = DenseBody(lossless.from_raw(payload, dtype, header.shape))
    elif scheme is Scheme.ZSTD:
        body = DenseBody(lossless.zstd_decode(payload, dtype, header.shape))
    elif scheme is Scheme.QUANT:
        body = quantized.parse(payload, header.shape, header.version)
    elif scheme is Scheme.INT8:
        body = int8.parse(payload, header.shape)
    elif scheme in TRANSFORM_SCHEMES:
        if header.version < 5:
            raise CodecError(f"scheme {int(scheme)} is not part of format {header.version}")
        body = transformed.parse(
            payload,
            header.shape,
            header.version,
            loaded_transforms() if transforms is None else transforms,
            salient=scheme is Scheme.SALIENT,
        )
    else:  # pragma: no cover - every scheme is handled above
        raise CodecError(f"no decoder for scheme {scheme.name}")
    return ParsedChunk(header, body)


def parse_chunks(chunks: Sequence[bytes | memoryview], transforms: Transforms | None = None) -> ParsedBatch:
    """Parse every chunk (the first bad one raises ``CodecError``) into one batch."""
    return ParsedBatch(tuple(parse_chunk(data, transforms=transforms) for data in chunks))
