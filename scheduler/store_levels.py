"""Which levels a context is stored at when nobody says (``CACHEGEN_ENCODE_LEVELS`` and
``CACHEGEN_WRITE_BACK_LEVELS`` unset).

Every lossy level is stored: together they cost about a fifth of the raw KV,
and they are what ``auto`` loads on all but the fastest links. ``lossless``
is the raw KV (46 KB per token for the default model in fp32): 80% of what
the four levels take. What it buys is exactness without recomputation: a
request that asks for ``lossless`` (or ``auto`` on a link fast enough to
afford it) loads it instead of recomputing the prefix. So it is stored where
loading it beats recomputing it: when a chunk of raw KV crosses a 1 Gbps link
and is decoded faster than the model prefills that chunk (measured by this
gateway's cost profile, at a position 2K tokens in).

Measured (``benchmarks/level_set.py``, 4K tokens): on 2 CPU cores the prefill
takes 30 s and the raw KV loads in 1.6 s at 1 Gbps, so a CPU gateway stores
``lossless``; on a GPU the same model prefills 4K tokens in tens of
milliseconds, far less than the raw KV takes to arrive, so a GPU gateway does
not, and an exact request recomputes.
"""

from __future__ import annotations

from collections.abc import Sequence

from codec import Level
from scheduler.profile import CostProfile

REFERENCE_LINK_BYTES_PER_S = 1e9 / 8
REFERENCE_POSITION = 2048


def lossless_pays(profile: CostProfile, lossless: Level, chunk_tokens: int, raw_bytes_per_token: int) -> bool:
    load = chunk_tokens * raw_bytes_per_token / REFERENCE_LINK_BYTES_PER_S
    load += profile.decode_seconds(lossless.name, chunk_tokens)
    return load < profile.prefill_seconds(chunk_tokens, REFERENCE_POSITION)


def default_store_levels(
    levels: Sequence[Level], profile: CostProfile, chunk_tokens: int, raw_bytes_per_token: int
) -> list[Level]:
    """The table's levels, less the lossless ones when recomputing beats loading them."""
    return [
        lv
        for lv in levels
        if not lv.lossless or lossless_pays(profile, lv, chunk_tokens, raw_bytes_per_token)
    ]
