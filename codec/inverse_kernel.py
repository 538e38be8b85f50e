"""The CPU inverse transform's last steps in one pass, compiled with numba.

After the bf16 matmul, ``KVTransform.inverse_`` has each (layer, K/V) group's
product ``y @ decode`` as bf16, (tokens, heads * head_dim). What is left is
three elementwise steps over the chunk: add the mean (float32), rotate the
keys (RoPE, float32) and copy into the output's (heads, tokens, head_dim)
layout. In torch these were three passes with temporaries between them: 2.9
of a ``high`` chunk's 4.1 ms of inverse on this 2-core CPU (docs/codec.md,
"Speed"). Here one pass reads each product row once and writes the KV.

The arithmetic is torch's, in float32 and in the same order: the sum, then
``a * cos - b * sin`` and ``b * cos + a * sin`` per channel pair.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types

_IN2 = types.Array(types.float32, 2, "C", readonly=True)
# one signature, compiled (or loaded from numba's cache) at import: ``out`` converts to it with any
# strides (a whole chunk's buffer or a slice of a KV buffer), so no request compiles a variant
# that start-up's warm-up did not (see codec.rans._DECODE_STREAMS)
_SIGNATURE = (types.Array(types.uint16, 3, "C", readonly=True), _IN2, _IN2, _IN2)
_SIGNATURE += (types.Array(types.float32, 5, "A"),)


@numba.njit([_SIGNATURE], cache=True, parallel=True, nogil=True)
def finish_bf16_inverse(product, mean, cos, sin, out):
    """``out[l, k, h, t, :]`` = the head-``h`` slice of ``mean[g] + product[g, t]`` (g = 2l + k),
    keys (k = 0) turned by RoPE with the per-token ``cos`` and ``sin`` (tokens, head_dim / 2)
    unless those have no rows.

    ``product``: uint16, the bits of bf16 values, (layers * 2, tokens, heads * head_dim);
    ``mean``: float32, (layers * 2, heads * head_dim); ``out``: float32 (layers, 2, heads,
    tokens, head_dim), any strides."""
    layers, _, heads, tokens, dim = out.shape
    half = dim // 2
    rope = cos.shape[0] > 0
    for g in numba.prange(layers * 2):
        layer, kind = g // 2, g % 2
        bits = np.empty(heads * dim, np.uint32)
        x = bits.view(np.float32)  # bf16 is float32's upper half: shift the bits, then read
        turn = rope and kind == 0
        for t in range(tokens):
            for c in range(heads * dim):
                bits[c] = np.uint32(product[g, t, c]) << np.uint32(16)
            for c in range(heads * dim):
                x[c] = x[c] + mean[g, c]
            for h in range(heads):
                row = out[layer, kind, h, t]
                base = h * dim
                if turn:
                    for i in range(half):
                        a, b = x[base + i], x[base + half + i]
                        row[i] = a * cos[t, i] - b * sin[t, i]
                        row[half + i] = b * cos[t, i] + a * sin[t, i]
                else:
                    for d in range(dim):
                        row[d] = x[base + d]
