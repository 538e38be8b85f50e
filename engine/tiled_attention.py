"""Prompt attention that gives each query the same bits however its prompt was cut into chunks.

The step loop cuts a prompt into chunks by what else runs: 512 tokens a step
alone, fewer beside decodes (``scheduler.step_loop``). Attention that merges
its sums in an order set by the chunk (one pass over a chunk's own keys, then
the keys before it, as ``engine.ragged._attend_parts`` does) gives a query's
output different last bits in each cut. In float32 that is a 1e-7 wobble; with
bf16 weights (``engine.bf16_weights``) the next projection rounds its input to
bf16, and now and then the wobble becomes a whole bf16 step that grows over
the layers, so a seeded request's tokens would depend on what shared its steps.

Here every sum has a fixed order, set by the query's position alone:

- **Tiles.** Keys are cut into tiles of ``TILE_TOKENS`` at absolute positions
  (0, 256, 512, ...). A tile inside one buffer is attended where it lies (a
  view); one that straddles two buffers (a prefix-cache part and the
  request's own buffer, ``Segment.shared``) or that the chunk ends inside is
  first copied into a zeroed tile, so the kernel sees the same 256 keys at the
  same places whatever holds them.
- **Rows.** A chunk's queries are grouped by KV head, as elsewhere, and padded
  to a multiple of ``ROW_MULTIPLE`` rows: MKL's float32 matmul gives a row
  the same bits for every row count that is a multiple of 4, and other bits
  below 4 (measured on this project's CPUs; ``tests/unit/test_tiled_attention.py``
  holds it).
- **One tile, one kernel call.** Each (rows, tile) pair goes to torch's CPU
  flash kernel with a 256-key sequence: one block of keys, so its sums over a
  row run over the same 256 places, keys after the query masked to exactly
  zero weight.
- **Merged in tile order.** The tiles' outputs are merged by their
  log-sum-exps with one multiply and one add per tile, in tile order: tiles
  a query cannot see add exact zeros.

So a query's output depends on its position, its keys and its own row, not on
the chunk around it, the step around it or the buffers its keys sit in.
Decodes (``Segment.decode``) are attended one sequence at a time by
``engine.ragged``, which is as fixed: the same shapes alone or beside others.

The cost, against the cut-dependent path it replaces (2 cores, float32, one
layer): a 512-token chunk after 3K tokens 27 -> 32 ms, a first 512-token chunk
4.0 -> 6.0 ms (the masked half of its diagonal tiles is computed, where a
causal kernel skips it).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

TILE_TOKENS = 256  # a divisor of the store's 256-token chunks, and no deeper than MKL's one-block sums
ROW_MULTIPLE = 4
# A chunk that ends in the first half of its last tile attends only that tile's first keys, rounded
# up to KEY_MULTIPLE: a row's bits are the same as over the whole tile up to TRIM_MAX keys (MKL sums
# deeper products in another order), measured by tests/unit/test_tiled_attention.py
KEY_MULTIPLE = 16
TRIM_MAX = 128

_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@dataclass(frozen=True)
class _Source:
    """Where a stretch of a sequence's keys lies: in ``part`` (an index into the segment's parts),
    from the part's index ``local`` on, holding the absolute positions ``[first, first + tokens)``."""

    part: int
    local: int
    first: int
    tokens: int


@dataclass(frozen=True)
class _Group:
    """Consecutive tiles attended in one kernel call."""

    first: int  # the first tile's index
    count: int
    masked: bool  # some key of these tiles lies after some query
    view: _Source | None  # the tiles as a view of one part; None: copies in ``TiledPrefill._gathered``
    gathered: int = 0  # for copies, the first one's index in ``_gathered``
    keys: int = TILE_TOKENS  # keys per tile: fewer only for the chunk's last tile, when it ends inside


class TiledPrefill:
    """One prompt chunk's attention plan for a step: the same for every layer, built once.

    ``segment`` is an ``engine.ragged.Segment``; its new keys and values must be in its buffer
    before ``attend`` reads them.
    """

    def __init__(self, segment) -> None:
        self.segment = segment
        self.start, self.end = segment.start, segment.end
        self.tiles = -(-self.end // TILE_TOKENS)
        self.first_masked = self.start // TILE_TOKENS
        sources, at = [], 0
        for index, part in enumerate(segment.shared):
            sources.append(_Source(index, 0, at, part.shape[3]))
            at += part.shape[3]
        sources.append(_Source(len(segment.shared), 0, at, self.end - at))  # the own buffer
        self.sources = sources
        self.groups, self.copies = self._plan()
        self._by_group: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}  # see ``_rows``

    def _plan(self) -> tuple[list[_Group], list[tuple[int, _Source, int, int]]]:
        """The kernel calls, in tile order, and the copies that fill the gathered tiles: (gathered
        tile, source, first position, tokens)."""
        groups: list[_Group] = []
        copies: list[tuple[int, _Source, int, int]] = []
        gathered = 0
        for tile in range(self.tiles):
            lo, hi = tile * TILE_TOKENS, (tile + 1) * TILE_TOKENS
            masked = tile >= self.first_masked
            last = groups[-1] if groups else None
            holder = next((s for s in self.sources if s.first <= lo and hi <= s.first + s.tokens), None)
            if holder is not None:
                view = _Source(holder.part, holder.local + lo - holder.first, lo, TILE_TOKENS)
                if last and last.masked == masked and last.view and last.view.part == view.part:
                    groups[-1] = _Group(last.first, last.count + 1, masked, last.view)
                else:
                    groups.append(_Group(tile, 1, masked, view))
                continue
            for source in self.sources:  # the tile's stretches, buffer by buffer
                a, b = max(lo, source.first), min(hi, source.first + source.tokens)
                if a < b:
                    copies.append((gathered, source, a, b - a))
            keys = -(-(self.end - lo) // KEY_MULTIPLE) * KEY_MULTIPLE
            if keys <= TRIM_MAX:  # the chunk ends early in it: a call of its own, on the keys it needs
                groups.append(_Group(tile, 1, masked, None, gathered, keys))
            elif last and last.masked == masked and last.view is None:
                groups[-1] = _Group(last.first, last.count + 1, masked, None, last.gathered)
            else:
                groups.append(_Group(tile, 1, masked, None, gathered))
            gathered += 1
        return groups, copies

    @cached_property
    def _gathered(self) -> torch.Tensor:
        """The copied tiles, zeroed once: (tiles, 2, kv_heads, TILE_TOKENS, head_dim). Every layer
        writes the same places, so the places no buffer covers stay zero."""
        count = sum(g.count for g in self.groups if g.view is None)
        kv = self.segment.kv
        return kv.new_zeros((count, 2, kv.shape[2], TILE_TOKENS, kv.shape[4]))

    def _rows(self, group: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """For ``group`` query heads per KV head: the padded row count, the masked tiles' additive
        mask (tiles, 1, rows, TILE_TOKENS), and which rows see none of a masked tile's keys (tiles,
        1, rows)."""
        if group not in self._by_group:
            n = self.end - self.start
            rows = -(-group * n // ROW_MULTIPLE) * ROW_MULTIPLE
            positions = torch.arange(self.start, self.end).repeat(group)
            padding = positions.new_full((rows - group * n,), self.end - 1)  # sees every key; dropped
            positions = torch.cat((positions, padding))
            tiles = torch.arange(self.first_masked, self.tiles)
            keys = tiles[:, None] * TILE_TOKENS + torch.arange(TILE_TOKENS)  # (tiles, TILE_TOKENS)
            hidden = keys[:, None, :] > positions[None, :, None]  # (tiles, rows, TILE_TOKENS)
            additive = torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf"))
            kv = self.segment.kv
            self._by_group[group] = (
                rows,
                additive[:, None].to(kv.device, kv.dtype),
                hidden.all(-1)[:, None].to(kv.device),
            )
        return self._by_group[group]

    def attend(self, layer: int, query: torch.Tensor, scale: float | None) -> torch.Tensor:
        """``query`` (q_heads, tokens, head_dim): this chunk's queries; returns their outputs, the
        same shape."""
        heads, n, dim = query.shape
        segment = self.segment
        own = segment.kv[layer]
        kv_heads = own.shape[1]
        group = heads // kv_heads
        rows, mask, blind = self._rows(group)
        grouped = query.new_zeros(1, kv_heads, rows, dim)
        grouped[0, :, : group * n] = query.reshape(kv_heads, group * n, dim)

        parts = [part[layer] for part in segment.shared] + [own]
        if self.copies:
            into, sources = [], []
            for index, source, first, tokens in self.copies:
                local = source.local + first - source.first
                at = first % TILE_TOKENS
                into.append(self._gathered[index, :, :, at : at + tokens])
                sources.append(parts[source.part][:, :, local : local + tokens])
            torch._foreach_copy_(into, sources)

        outs, lses = [], []
        for g in self.groups:
            if g.view is not None:
                span = slice(g.view.local, g.view.local + g.count * TILE_TOKENS)
                block = parts[g.view.part][:, :, span].unflatten(2, (g.count, TILE_TOKENS))
                keys, values = block[0].transpose(0, 1), block[1].transpose(0, 1)
            else:
                block = self._gathered[g.gathered : g.gathered + g.count, :, :, : g.keys]
                keys, values = block[:, 0], block[:, 1]
            tile_mask = None
            if g.masked:
                at = g.first - self.first_masked
                tile_mask = mask[at : at + g.count, :, :, : g.keys]
            out, lse = _flash_cpu(
                grouped.expand(g.count, -1, -1, -1), keys, values, attn_mask=tile_mask, scale=scale
            )
            outs.append(out)
            lses.append(lse)
        merged = _merge(torch.cat(outs), torch.cat(lses), blind, self.first_masked)
        return merged[:, : group * n].reshape(heads, n, dim)


def _merge(outs: torch.Tensor, lses: torch.Tensor, blind: torch.Tensor, first_masked: int) -> torch.Tensor:
    """The tiles' outputs (tiles, kv_heads, rows, dim) merged by their log-sum-exps (tiles, kv_heads,
    rows); returns (kv_heads, rows, dim).

    Every sum runs in tile order: the outputs' one add per tile, the weights' by ``cumsum`` (a
    sequential scan). A torch ``sum`` over the tiles would not do: its order depends on where a
    row lies in memory."""
    if first_masked < lses.shape[0]:  # the kernel gives a row that sees no key of a tile 0, not -inf
        lses[first_masked:].masked_fill_(blind, float("-inf"))
    weights = (lses - lses.amax(0)).exp_()
    terms = outs.mul_(weights[..., None])
    total = terms[0]
    for term in terms[1:]:
        total.add_(term)
    return total.div_(weights.cumsum(0)[-1][..., None])
