"""Prompt attention in fixed tiles (``engine.tiled_attention``): right, and the same bits however
the prompt is cut into chunks and whichever buffers hold its keys."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from engine import tiled_attention
from engine.ragged import Segment
from engine.tiled_attention import TILE_TOKENS, TRIM_MAX, TiledPrefill

HEADS, KV_HEADS, DIM, LENGTH = 9, 3, 64, 1100  # the default model's heads; 4+ tiles
SCALE = DIM**-0.5


@pytest.fixture(scope="module")
def data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    kv = torch.randn(1, 2, KV_HEADS, LENGTH, DIM)  # one layer
    query = torch.randn(HEADS, LENGTH, DIM)
    return kv, query


def attend(kv: torch.Tensor, query: torch.Tensor, cuts: list[int], shared_until: int = 0) -> torch.Tensor:
    """The queries of ``[cuts[0], cuts[-1])`` attended chunk by chunk, the chunks ending at ``cuts``;
    chunks from ``shared_until`` on read the keys before it as a shared part and own the rest."""
    outs = []
    for start, end in zip(cuts, cuts[1:]):
        if shared_until and start >= shared_until:
            own, shared = kv[:, :, :, shared_until:], (kv[:, :, :, :shared_until],)
            segment = Segment(own, start, [0] * (end - start), shared=shared)
        else:
            segment = Segment(kv, start, [0] * (end - start))
        outs.append(TiledPrefill(segment).attend(0, query[:, start:end], SCALE))
    return torch.cat(outs, dim=1)


def test_it_is_causal_attention(data):
    kv, query = data
    got = attend(kv, query, [0, LENGTH])
    want = F.scaled_dot_product_attention(
        query[None], kv[0, 0][None], kv[0, 1][None], is_causal=True, scale=SCALE, enable_gqa=True
    )[0]
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize(
    "cuts",
    [
        [0, 512, 1024, LENGTH],  # the step loop alone: 512 a step
        [0, 1, 2, 300, 301, 777, LENGTH],  # one-token chunks, chunks ending early and late in a tile
        list(range(0, LENGTH, 7)) + [LENGTH],
        [0, *sorted(random.Random(1).sample(range(1, LENGTH), 40)), LENGTH],
    ],
)
def test_a_query_gets_the_same_bits_however_the_prompt_is_cut(data, cuts):
    kv, query = data
    assert torch.equal(attend(kv, query, cuts), attend(kv, query, [0, LENGTH]))


@pytest.mark.parametrize("shared_until", [16, 256, 288, 512, 800])
def test_a_query_gets_the_same_bits_whichever_buffers_hold_its_keys(data, shared_until):
    """Keys before ``shared_until`` in a prefix cache's part, the rest in the request's own buffer:
    a tile that straddles them is copied whole, so its sums are those of the one-buffer case."""
    kv, query = data
    cuts = [0, shared_until, shared_until + 5, 1000, LENGTH]
    assert torch.equal(attend(kv, query, cuts, shared_until), attend(kv, query, [0, LENGTH]))


def test_tiles_inside_one_buffer_are_read_in_place(data):
    kv, _ = data
    plan = TiledPrefill(Segment(kv, 600, [0] * 400))  # tiles 0-3 inside, the chunk ends in tile 3
    views = [g for g in plan.groups if g.view is not None]
    assert [(g.first, g.count, g.masked) for g in views] == [(0, 2, False), (2, 1, True)]  # tile 2 holds 600
    assert [(g.first, g.keys) for g in plan.groups if g.view is None] == [(3, 256)]  # 232 keys: untrimmed

    short = TiledPrefill(Segment(kv, 1024, [0] * 30))
    last = short.groups[-1]
    assert last.view is None and last.keys == 32 <= TRIM_MAX  # a tile the chunk ends early in: trimmed

    shared = Segment(kv[:, :, :, 288:], 288, [0] * 200, shared=(kv[:, :, :, :288],))
    plan = TiledPrefill(shared)
    copied = [g.first for g in plan.groups if g.view is None]
    assert copied == [1]  # [256, 512) straddles the part and the own buffer; [0, 256) is a view
    assert {source.part for _, source, _, _ in plan.copies} == {0, 1}


def test_without_the_fixed_tiles_the_bits_would_move(data, monkeypatch):
    """The check above can fail: with tiles as long as the prompt (one kernel call over every key,
    as the chunk's own and earlier keys used to be attended), the cuts change the bits."""
    kv, query = data
    monkeypatch.setattr(tiled_attention, "TILE_TOKENS", 2048)
    monkeypatch.setattr(tiled_attention, "TRIM_MAX", 2048)
    assert not torch.equal(attend(kv, query, [0, 7, 300, 777, LENGTH]), attend(kv, query, [0, LENGTH]))


def test_the_matmul_properties_the_tiles_rely_on():
    """MKL's float32 matmul, as this CPU runs it: a row's bits are the same for any row count that
    is a multiple of ROW_MULTIPLE, and a product's bits the same with zeros after it up to TRIM_MAX
    deep (and up to TILE_TOKENS deep for a whole tile). If a new torch or CPU breaks either, this
    says which, before the invariance tests above fail for it."""
    torch.manual_seed(0)
    rows = torch.randn(256, DIM)
    keys = torch.randn(DIM, TILE_TOKENS)
    by_four = torch.cat([rows[i : i + 4] @ keys for i in range(0, 256, 4)])
    for count in (8, 12, 32, 96, 256):
        assert torch.equal(torch.cat([rows[i : i + count] @ keys for i in range(0, 256, count)]), by_four)
    weights = torch.rand(8, TRIM_MAX)
    values = torch.randn(TILE_TOKENS, DIM)
    padded = torch.cat([weights, torch.zeros(8, TILE_TOKENS - TRIM_MAX)], dim=1)
    assert torch.equal(weights @ values[:TRIM_MAX], padded @ values)
