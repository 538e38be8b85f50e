"""Attention over KV in several buffers (``engine.ragged._attend_parts``) equals attention over
their concatenation, on the CPU's flash path and on the matmul path other devices take."""

from __future__ import annotations

import pytest
import torch

from engine.ragged import _attend_parts, _attend_parts_matmul, _causal


@pytest.mark.parametrize("attend", [_attend_parts, _attend_parts_matmul])
@pytest.mark.parametrize(
    ("queries", "lengths"),
    [(1, [300, 5]), (7, [32, 20]), (40, [100, 60, 45]), (1, [1]), (5, [16, 5])],
)
def test_parts_attend_as_their_concatenation(attend, queries, lengths):
    torch.manual_seed(queries + sum(lengths))
    kv_heads, group, dim = 3, 3, 64
    query = torch.randn(kv_heads * group, queries, dim)
    parts = [torch.randn(2, kv_heads, n, dim) for n in lengths]
    keys = torch.cat([p[0] for p in parts], dim=1)[None]
    values = torch.cat([p[1] for p in parts], dim=1)[None]
    want = _causal(query[None], keys, values, None)[0].transpose(0, 1)
    got = attend(query, parts, None)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_the_last_part_is_masked_causally():
    """Without the mask the first query would see the keys after it: the result must differ."""
    torch.manual_seed(1)
    query = torch.randn(2, 4, 8)
    parts = [torch.randn(2, 1, 6, 8), torch.randn(2, 1, 4, 8)]
    got = _attend_parts(query, parts, None)
    unmasked = _attend_parts(query[:, -1:], parts, None)  # the last query sees every key
    assert torch.allclose(got[:, -1:], unmasked, atol=1e-6)
    assert not torch.allclose(got[:, :1], unmasked, atol=1e-3)
