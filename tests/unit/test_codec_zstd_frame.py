"""zstd frames that lie about their size are rejected before anything is allocated."""

from __future__ import annotations

import pytest
import zstandard

from codec.errors import CodecError
from codec.zstd_frame import decompress_exact


def test_exact_size_round_trips():
    data = bytes(range(256)) * 4
    assert decompress_exact(zstandard.ZstdCompressor().compress(data), len(data), "x") == data


def test_frame_declaring_a_huge_size_is_refused():
    # a real frame whose header claims ~1 TB of content (what a flipped bit did in fuzzing)
    params = zstandard.ZstdCompressionParameters.from_level(1, write_content_size=True)
    frame = zstandard.ZstdCompressor(compression_params=params).compress(b"\0" * 64)
    header_claim = zstandard.ZstdCompressor().compress(b"x" * 10)  # valid, smaller frame
    assert zstandard.frame_content_size(frame) == 64
    with pytest.raises(CodecError, match="declares 64 bytes"):
        decompress_exact(frame, 32, "side info")
    with pytest.raises(CodecError):
        decompress_exact(header_claim, 10**12, "side info")


@pytest.mark.parametrize("blob", [b"", b"garbage", b"\x28\xb5\x2f\xfd\xff\xff\xff\xff\xff\xff\xff\xff\xff"])
def test_not_a_frame(blob):
    with pytest.raises(CodecError):
        decompress_exact(blob, 10, "payload")
