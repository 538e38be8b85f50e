"""The compiled decode kernel against plain torch attention, over own and shared KV parts."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine import decode_attention
from engine.decode_attention import DecodeTable, shares, supports

LAYERS, KV_HEADS, Q_HEADS, DIM = 3, 3, 9, 64


def reference(query: torch.Tensor, parts: list[torch.Tensor], layer: int, scale: float) -> torch.Tensor:
    """One query (q_heads, dim) over the parts' keys laid end to end, by SDPA with GQA."""
    keys = torch.cat([part[layer, 0] for part in parts], dim=1)[None]
    values = torch.cat([part[layer, 1] for part in parts], dim=1)[None]
    out = F.scaled_dot_product_attention(query[None, :, None], keys, values, scale=scale, enable_gqa=True)
    return out[0, :, 0]


def buffer(tokens: int, capacity: int) -> torch.Tensor:
    """A sequence's own KV up to ``tokens``, a view of a larger buffer as the engine holds it."""
    return torch.randn(LAYERS, 2, KV_HEADS, capacity, DIM)[:, :, :, :tokens]


@pytest.fixture
def step():
    torch.manual_seed(0)
    shared = torch.randn(LAYERS, 2, KV_HEADS, 700, DIM)
    sequences = [
        [buffer(1, 16)],  # a first token: one key, its own
        [buffer(137, 256)],
        [shared[:, :, :, :512], buffer(40, 64)],  # reads a prefix it does not own, then its own
        [shared[:, :, :, :256], shared[:, :, :, 256:512], buffer(3, 16)],
        [buffer(2100, 2200)],  # longer than a padded batch takes
    ]
    # the step's queries as the projection lays them: (1, q_heads, tokens, dim), token-major
    query = torch.randn(1, 7, Q_HEADS, DIM).transpose(1, 2)
    key, value = torch.randn(2, 1, 7, KV_HEADS, DIM).transpose(2, 3)
    rows = [0, 2, 3, 5, 6]
    return query, key, value, shared, list(zip(rows, sequences))


@pytest.mark.parametrize("layer", [0, LAYERS - 1])
def test_each_decode_matches_sdpa_over_its_parts(step, layer):
    query, key, value, shared, sequences = step
    before = shared.clone()
    out = torch.full_like(query, float("nan"))
    DecodeTable(sequences).attend(layer, query, key, value, 0.125, out)
    assert torch.equal(shared, before), "shared parts are only read"
    for row, parts in sequences:
        own = parts[-1]
        assert torch.equal(own[layer, 0, :, -1], key[0, :, row]), "the new key is in its buffer"
        assert torch.equal(own[layer, 1, :, -1], value[0, :, row])
        want = reference(query[0, :, row], parts, layer, 0.125)
        torch.testing.assert_close(out[0, :, row], want, atol=1e-5, rtol=1e-4)
    untouched = [r for r in range(query.shape[2]) if r not in {row for row, _ in sequences}]
    assert torch.isnan(out[0, :, untouched]).all(), "rows that are not decodes are left alone"


def test_the_default_scale_is_one_over_root_head_dim(step):
    query, key, value, _, sequences = step
    got, want = torch.empty_like(query), torch.empty_like(query)
    DecodeTable(sequences).attend(1, query, key, value, None, got)
    DecodeTable(sequences).attend(1, query, key, value, DIM**-0.5, want)
    assert torch.equal(got[0, :, [r for r, _ in sequences]], want[0, :, [r for r, _ in sequences]])


def test_a_decode_gets_the_same_bits_whatever_shares_its_call(step):
    query, key, value, _, sequences = step
    together = torch.empty_like(query)
    DecodeTable(sequences).attend(2, query, key, value, 0.125, together)
    for row, parts in sequences:
        alone = torch.empty_like(query)
        DecodeTable([(row, parts)]).attend(2, query, key, value, 0.125, alone)
        assert torch.equal(alone[0, :, row], together[0, :, row])


def test_only_float32_cpu_kv_with_contiguous_channels_is_taken():
    kv = torch.zeros(LAYERS, 2, KV_HEADS, 8, DIM)
    assert supports(kv) and not supports(kv.bfloat16())
    with pytest.raises(ValueError, match="contiguous head_dim"):
        DecodeTable([(0, [kv.transpose(3, 4)])])
    with pytest.raises(ValueError, match="float32"):
        DecodeTable([(0, [kv.bfloat16()])])


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_the_split_over_torch_threads_changes_no_bits(step, torch_threads):
    """A layer's pairs are shared out over the caller's torch threads in one OpenMP region of
    torch's own runtime: every thread count gives the outputs (and KV writes) of one thread."""
    query, key, value, _, sequences = step
    assert sys.platform != "linux" or decode_attention._PARALLEL is not None, "torch's libgomp is found"
    results = {}
    for threads in (1, 2, 3):
        torch_threads(threads)
        out = torch.full_like(query, float("nan"))
        table = DecodeTable(sequences)
        table.attend(1, query, key, value, 0.125, out)
        assert table._call[decode_attention.THREADS] == (threads if decode_attention._PARALLEL else 1)
        results[threads] = out
    rows = [row for row, _ in sequences]
    assert not torch.isnan(results[1][0, :, rows]).any()
    for threads in (2, 3):
        assert torch.equal(results[threads][0, :, rows], results[1][0, :, rows])
    for row, parts in sequences:
        want = reference(query[0, :, row], parts, 1, 0.125)
        torch.testing.assert_close(results[2][0, :, row], want, atol=1e-5, rtol=1e-4)


def test_a_table_with_fewer_pairs_than_threads_uses_fewer_threads(step, torch_threads):
    query, key, value, _, sequences = step
    torch_threads(8)
    table = DecodeTable(sequences[4:])  # one sequence over 2,100 keys: KV_HEADS pairs
    table.attend(0, query, key, value, None, torch.empty_like(query))
    assert table._call[decode_attention.THREADS] == (KV_HEADS if decode_attention._PARALLEL else 1)


def test_a_step_of_few_keys_stays_on_the_calling_thread(step, torch_threads):
    query, key, value, _, sequences = step
    torch_threads(2)
    table = DecodeTable(sequences[:2])  # 1 + 137 keys
    assert table.keys < decode_attention.PARALLEL_MIN_KEYS
    table.attend(0, query, key, value, None, torch.empty_like(query))
    assert table._call[decode_attention.THREADS] == 1


def test_shares_are_contiguous_runs_of_about_equal_cost():
    costs = np.array([1, 1, 1, 100, 1, 1, 100, 1])
    bounds = shares(costs, 2)
    assert bounds[0] == 0 and bounds[-1] == len(costs) and list(bounds) == sorted(bounds)
    halves = [costs[bounds[0] : bounds[1]].sum(), costs[bounds[1] : bounds[2]].sum()]
    assert max(halves) <= 105, halves
    assert list(shares(np.ones(6, dtype=np.int64), 3)) == [0, 2, 4, 6]
    assert list(shares(np.ones(2, dtype=np.int64), 1)) == [0, 2]
