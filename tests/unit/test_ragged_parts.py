"""Attention over KV in several buffers (``engine.ragged._attend_parts``) equals attention over
their concatenation, on the CPU's flash path and on the matmul path other devices take."""

from __future__ import annotations

import pytest
import torch

from engine.ragged import _attend_parts, _attend_parts_matmul, _own_apart


def reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Causal attention by the definition: ``query`` (heads, n, dim), the last n of ``keys`` and
    ``values`` (kv_heads, tokens, dim), each KV head read by ``heads / kv_heads`` query heads."""
    group = query.shape[0] // keys.shape[0]
    k, v = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
    n, total = query.shape[1], keys.shape[1]
    scores = query @ k.transpose(1, 2) / query.shape[-1] ** 0.5
    hidden = torch.arange(total)[None, :] > (torch.arange(n) + total - n)[:, None]
    return torch.softmax(scores.masked_fill(hidden, float("-inf")), -1) @ v


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
    keys = torch.cat([p[0] for p in parts], dim=1)
    values = torch.cat([p[1] for p in parts], dim=1)
    want = reference(query, keys, values)
    for split in (parts, _own_apart(parts, queries)):  # the queries' own keys apart, or not
        got = attend(query, split, None)
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
