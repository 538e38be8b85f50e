"""Per-chunk plan for loading a stored prefix: a level for each chunk, or text.

Pure computation over estimates, so it is deterministic and unit-tested on
simulated costs. The executor calls ``plan`` again after every chunk with the
time and bandwidth it measured, so a wrong estimate costs one chunk, not the
request.

Time model of the pipeline (fetch overlaps compute; decode, text prefill and
the final prefill share the compute side, in chunk order):

    start = max(compute_busy, link_busy)   # the chunks already committed are consumed first, in order
    end = max(start + recompute + decode,  link_busy + bytes / rate + last decode) + suffix

Candidate plans: the first ``k`` remaining chunks as text (prefilled while
later chunks are still on the link), then ``j`` chunks at a level ``a`` and
the rest at a lower level ``b``. Cost and quality depend on how many chunks
take each route, and an optimum of one budget over such counts mixes at most
two routes besides text, so this family holds the best plan while staying
small (levels^2 * chunks^2 / 4 candidates, evaluated at once with numpy).
Text first gives the link time to work while the model recomputes. Quality
loss is the sum of the chunks' level distortions (0 = exact; text is exact):
measured KL divergence per level where the level table has it, which grows
much faster than linearly from one level to the next, so one lossless and one
low chunk never pass for two middling ones.

- With a budget: the best quality whose predicted end fits it, then the
  fastest; when none fits, the fastest plan of all.
- Without one: the fastest plan that uses no level below the quality floor.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

TEXT = "text"
_MISSING = 1e30  # bytes of a level a chunk does not have: no plan through it is ever chosen


@dataclass(frozen=True)
class ChunkCosts:
    """What one remaining chunk would cost by each route."""

    bytes: dict[str, int]  # level -> bytes on the link (0 when already in memory)
    decode_s: dict[str, float]  # level -> decode and placement time
    recompute_s: float  # prefill of this chunk's tokens at its position


@dataclass(frozen=True)
class PlanInputs:
    chunks: list[ChunkCosts]  # the chunks not yet started, in order
    levels: list[str]  # candidates, best quality first (their rank is their position in ``ranks``)
    distortion: dict[str, float]  # level -> quality loss, 0 = exact (text is exact)
    rate_bps: float  # link estimate, bytes per second
    suffix_s: float  # final prefill of the tokens after the prefix
    link_busy_s: float = 0.0  # link time still owed to fetches already issued
    compute_busy_s: float = 0.0  # decode time still owed to chunks already fetched or in flight
    budget_s: float | None = None  # time left for the whole prompt, or None
    allow_text: bool = True


@dataclass(frozen=True)
class Plan:
    sources: list[str]  # per remaining chunk: a level name or TEXT
    predicted_s: float
    distortion: float

    @property
    def text_chunks(self) -> int:
        return sum(1 for s in self.sources if s == TEXT)


def plan(inputs: PlanInputs) -> Plan:
    n = len(inputs.chunks)
    if n == 0 or not inputs.levels:
        return _explicit(inputs, [TEXT] * n)
    levels = inputs.levels
    pairs = list(itertools.combinations(levels, 2)) or [(levels[0], levels[0])]
    recompute = _prefix_sums([c.recompute_s for c in inputs.chunks])
    k, j = (g.ravel() for g in np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij"))
    keep = (k + j <= n) & ((k == 0) | inputs.allow_text)
    k, j = k[keep], j[keep]
    m = k + j  # chunks [k, m) at level a, [m, n) at level b

    start = _compute_start(inputs)
    ends, dists = [], []  # per pair, one entry per (k, j)
    for a, b in pairs:
        size_a, dec_a = _sums(inputs.chunks, a)
        size_b, dec_b = _sums(inputs.chunks, b)
        fetched = (size_a[m] - size_a[k]) + (size_b[n] - size_b[m])
        compute = start + recompute[k] + (dec_a[m] - dec_a[k]) + (dec_b[n] - dec_b[m])
        link = inputs.link_busy_s + fetched / max(inputs.rate_bps, 1.0)
        last_a = dec_a[np.maximum(m, 1)] - dec_a[np.maximum(m, 1) - 1]
        last = np.where(m < n, dec_b[n] - dec_b[n - 1], np.where(j > 0, last_a, 0.0))
        end = np.maximum(compute, link + last) + inputs.suffix_s
        ends.append(np.where(fetched >= _MISSING / 2, np.inf, end))
        dists.append(inputs.distortion[a] * j + inputs.distortion[b] * (n - m))
    end, dist = np.concatenate(ends), np.concatenate(dists)
    if inputs.budget_s is not None and (end <= inputs.budget_s).any():
        # best quality among the plans that fit, then the fastest of those
        fits = end <= inputs.budget_s
        i = np.lexsort((end, np.where(fits, dist, np.inf)))[0]
    else:
        i = np.lexsort((dist, end))[0]
    pair, at = divmod(int(i), len(k))
    a, b = pairs[pair]
    k_i, j_i = int(k[at]), int(j[at])
    return _explicit(inputs, [TEXT] * k_i + [a] * j_i + [b] * (n - k_i - j_i))


def _prefix_sums(values: list[float]) -> np.ndarray:
    return np.concatenate(([0.0], np.cumsum(values)))


def _sums(chunks: list[ChunkCosts], level: str) -> tuple[np.ndarray, np.ndarray]:
    sizes = _prefix_sums([float(c.bytes.get(level, _MISSING)) for c in chunks])
    return sizes, _prefix_sums([c.decode_s.get(level, 0.0) for c in chunks])


def predict(inputs: PlanInputs, sources: list[str]) -> float:
    """The time model for one explicit plan (the search above evaluates the same formula)."""
    compute, link, last = _compute_start(inputs), inputs.link_busy_s, 0.0
    for chunk, source in zip(inputs.chunks, sources, strict=True):
        if source == TEXT:
            compute += chunk.recompute_s
            continue
        if source not in chunk.bytes:
            return float("inf")
        link += chunk.bytes[source] / max(inputs.rate_bps, 1.0)
        last = chunk.decode_s.get(source, 0.0)
        compute += last
    return max(compute, link + last) + inputs.suffix_s


def _compute_start(inputs: PlanInputs) -> float:
    """When the model is free for the remaining chunks: chunks are consumed in order, so those
    already committed must have arrived (``link_busy``) and been decoded (``compute_busy``)."""
    return max(inputs.compute_busy_s, inputs.link_busy_s)


def _explicit(inputs: PlanInputs, sources: list[str]) -> Plan:
    distortion = sum(inputs.distortion.get(s, 0) for s in sources if s != TEXT)
    return Plan(sources, predict(inputs, sources), distortion)
