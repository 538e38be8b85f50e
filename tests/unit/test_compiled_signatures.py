"""The serving path's compiled kernels have one signature each, whatever their callers' arrays are.

numba compiles a lazily typed kernel again for every new combination of array layouts and flags
it is called with. Start-up warms the kernels up, but a variant that the warm-up did not call was
compiled inside the first request that needed it: 7 s on a cold cache for a fresh gateway's first
load from a writable buffer into a slice of a KV buffer. The kernels' pinned signatures take any
caller's arrays by conversion instead; these tests call them every way the serving path does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from codec import Level, Scheme, encode_chunk, rans
from codec.backends import NumbaBackend
from codec.inverse_kernel import finish_bf16_inverse
from codec.parsed import parse_chunks
from codec.transform import fit_transform
from codec.transformed import TransformParams
from engine import decode_attention
from engine.decode_attention import DecodeTable

LAYERS, HEADS, DIM, TOKENS = 2, 2, 16, 40


def _kv(tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    c = HEADS * DIM
    x = torch.randn(LAYERS, 2, tokens, c, generator=g) @ torch.randn(LAYERS, 2, c, c, generator=g)
    return x.reshape(LAYERS, 2, tokens, HEADS, DIM).permute(0, 1, 3, 2, 4).contiguous()


@pytest.fixture(scope="module")
def transformed_chunk() -> tuple[bytes, dict]:
    inv_freq = (1.0 / 10000 ** (np.arange(0, DIM, 2) / DIM)).astype(np.float32)
    t = fit_transform(_kv(400, 1), np.ones((LAYERS, HEADS, DIM)), inv_freq=inv_freq, model="signatures")
    level = Level("t", Scheme.TRANSFORM, False, TransformParams(t, (0.2,), (0.1,), sink_tokens=2))
    return encode_chunk(_kv(TOKENS, 7), level, position=256), {t.id: t}


@pytest.mark.parametrize("inverse_bf16", [False, True], ids=["float32 inverse", "bf16 inverse"])
def test_a_chunk_decodes_alike_from_any_bytes_into_any_strides(transformed_chunk, inverse_bf16):
    blob, transforms = transformed_chunk
    backend = NumbaBackend(inverse_bf16=inverse_bf16)
    shape = (LAYERS, 2, HEADS, TOKENS, DIM)
    outs = []
    # bytes as a store's read returns them, and writable buffers (a socket's, an mmap's)
    for data in (blob, bytearray(blob), memoryview(bytearray(blob))):
        whole = torch.empty(shape)  # a chunk of its own: contiguous
        backend.decode_into(parse_chunks([data], transforms), whole)
        buffer = torch.zeros(LAYERS, 2, HEADS, 64, DIM)  # a slice of a KV buffer: strided
        backend.decode_into(parse_chunks([data], transforms), buffer[:, :, :, 5 : 5 + TOKENS])
        assert not buffer[:, :, :, :5].any() and not buffer[:, :, :, 5 + TOKENS :].any()
        outs += [whole, buffer[:, :, :, 5 : 5 + TOKENS]]
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    assert len(rans.decode_streams.signatures) == 1
    assert len(finish_bf16_inverse.signatures) == 1


@pytest.mark.parametrize("tokens", [1, 3], ids=["one decode: contiguous views", "three: strided"])
def test_decode_steps_of_any_width_share_one_kernel(tokens):
    torch.manual_seed(0)
    q_heads = 3 * HEADS
    own = [torch.randn(LAYERS, 2, HEADS, 64, DIM)[:, :, :, : 10 + i] for i in range(tokens)]
    # the step's projections as transformers lays them out: (1, heads, tokens, dim), token-major
    query = torch.randn(1, tokens, q_heads, DIM).transpose(1, 2)
    key, value = torch.randn(2, 1, tokens, HEADS, DIM).transpose(2, 3)
    out = torch.empty_like(query)
    DecodeTable([(row, [kv]) for row, kv in enumerate(own)]).attend(0, query, key, value, None, out)
    for row, kv in enumerate(own):
        keys, values = kv[0, 0][None], kv[0, 1][None]
        want = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, row : row + 1], keys, values, enable_gqa=True
        )
        torch.testing.assert_close(out[:, :, row : row + 1], want, atol=1e-5, rtol=1e-4)
    assert len(decode_attention._attend.signatures) == 1
