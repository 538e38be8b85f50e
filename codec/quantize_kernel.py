"""The lossy encoder's per-channel work, compiled: quantize, centre, choose a table, map to symbols.

One pass per (layer, k/v, head) row in parallel; numpy did the same in five
passes over the chunk and was the encoder's bottleneck.
"""

from __future__ import annotations

import numba
import numpy as np

from codec.rans import ALPHABET, BIAS, ESCAPE

_OUTSIDE = ALPHABET  # histogram bin of residuals beyond +-BIAS


@numba.njit(cache=True, parallel=True)
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
        for t in range(tokens):
            for d in range(dim):
                r = q[t, d] - cen[d]
                if -BIAS <= r <= BIAS:
                    hist[d, r + BIAS] += 1
                else:
                    hist[d, _OUTSIDE] += 1
        for d in range(dim):
            best = 0
            best_cost = np.inf
            for f in range(n_families):
                total = 0.0
                for b in range(ALPHABET + 1):
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
