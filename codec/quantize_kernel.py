"""The lossy encoder's per-channel work, compiled: quantize, centre, choose a table, map to symbols.

One pass per (layer, k/v, head) row in parallel; numpy did the same in five
passes over the chunk and was the encoder's bottleneck.
"""

from __future__ import annotations

import numba
import numpy as np

from codec.entropy_model import SPREADS_PER_SHAPE
from codec.rans import ALPHABET, BIAS, ESCAPE

_OUTSIDE = ALPHABET  # histogram bin of residuals beyond +-BIAS


@numba.njit(cache=True, parallel=True, nogil=True)
def quantize_rows(x, step, cost, freq, symbols, escapes, family, center):
    """``x`` (rows, tokens, dim) float32, ``step`` (rows, dim) float32.

    Writes, per channel ``ch = row * dim + d``: ``symbols[ch, t]`` (uint8),
    ``escapes[ch, t]`` (the int16 residual, read only for ESCAPE symbols),
    ``family[ch]`` (the cheapest table under ``cost``) and ``center[ch]``.
    """
    rows, tokens, dim = x.shape
    n_families = cost.shape[0]
    for row in numba.prange(rows):
        q = np.empty((tokens, dim), dtype=np.int32)
        sums = np.zeros(dim, dtype=np.int64)
        for t in range(tokens):
            for d in range(dim):
                v = np.int32(np.rint(x[row, t, d] / step[row, d]))
                q[t, d] = v
                sums[d] += v
        hist = np.zeros((dim, ALPHABET + 1), dtype=np.int64)
        cen = np.zeros(dim, dtype=np.int64)
        for d in range(dim):
            c = np.rint(sums[d] / tokens) if tokens else 0.0
            cen[d] = max(-32768, min(32767, np.int64(c)))
        lo = np.full(dim, ALPHABET, dtype=np.int64)
        hi = np.zeros(dim, dtype=np.int64)
        for t in range(tokens):
            for d in range(dim):
                r = q[t, d] - cen[d]
                b = r + BIAS if -BIAS <= r <= BIAS else _OUTSIDE
                hist[d, b] += 1
                if b != _OUTSIDE:
                    lo[d] = min(lo[d], b)
                    hi[d] = max(hi[d], b)
        for d in range(dim):
            # Tables are ordered by spread within each shape; only those near the
            # residuals' own spread can win, so only those are costed.
            m1 = 0.0
            m2 = 0.0
            for b in range(lo[d], hi[d] + 1):
                m1 += hist[d, b] * (b - BIAS)
                m2 += hist[d, b] * (b - BIAS) * (b - BIAS)
            inside = tokens - hist[d, _OUTSIDE]
            var = m2 / inside - (m1 / inside) ** 2 if inside > 0 else 1.0
            near = int(np.rint(4.0 * (0.5 * np.log2(max(var, 1e-6)) + 2.5)))
            near = max(0, min(SPREADS_PER_SHAPE - 1, near))
            best = 0
            best_cost = np.inf
            for f in range(n_families):
                if abs(f % SPREADS_PER_SHAPE - near) > 3 and f % SPREADS_PER_SHAPE != SPREADS_PER_SHAPE - 1:
                    continue
                total = hist[d, _OUTSIDE] * cost[f, _OUTSIDE]
                for b in range(lo[d], hi[d] + 1):  # only the residuals that occur
                    n = hist[d, b]
                    if n:
                        total += n * cost[f, b]
                if total < best_cost:
                    best_cost = total
                    best = f
            ch = row * dim + d
            family[ch] = best
            center[ch] = cen[d]
        for t in range(tokens):
            for d in range(dim):
                ch = row * dim + d
                r = q[t, d] - cen[d]
                s = ESCAPE
                if -BIAS <= r <= BIAS and freq[family[ch], r + BIAS] > 0:
                    s = r + BIAS
                symbols[ch, t] = s
                escapes[ch, t] = r
