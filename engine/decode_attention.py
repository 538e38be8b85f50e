"""A step's decodes attended in one compiled call per layer on a CPU, each over its own KV in place.

A decode is one query token against its sequence's keys: a few hundred
thousand multiply-adds, far less than the fixed cost of the dozen tensor
operations that torch needs for it (or for a padded batch of them: the
gather, the mask, two matmuls, a softmax, the scatter back). Measured on 2
cores for 8 decodes over 50-170 keys, one layer: 0.95 ms as a padded batch
(``_DecodeBatch``), 0.07 ms in vLLM's paged CPU kernel
(``benchmarks/attention_candidates.py``). This is that kind of kernel for our
layout: numba-compiled, it reads each sequence's KV where it lies (its own
buffer and any shared prefix parts, each ``(layers, 2, kv_heads, tokens,
head_dim)`` with any strides but a contiguous ``head_dim``), so nothing is
gathered or padded, and it runs without the GIL, so the event loop is not held
up by the model thread's attention.

Per (sequence, KV head) it computes the scores of the query heads that share
that KV head (no key is read twice), a softmax, and the weighted sum of the
values, in float32, one sequence at a time in a fixed order: a sequence's
output does not depend on what else is in the call. ``fastmath`` lets the
compiler reorder the sums over ``head_dim`` into vector lanes (and fuse
multiply-adds); ``exp`` and infinities keep their exact meaning.

The parts are described by a table made once per step (``DecodeTable``): one
row per part, with its layer-0 address, strides and length. The addresses are
only read while the step holds the tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import numba
import numpy as np
import torch
from numba import types
from numba.extending import intrinsic

# a part's row in the table: byte address of layer 0's keys, head 0, token 0; then strides in
# elements (layer, K -> V, head, token) and its number of tokens
ADDRESS, LAYER_STRIDE, VALUE_OFFSET, HEAD_STRIDE, TOKEN_STRIDE, TOKENS = range(6)
_FLOAT_BYTES = 4
# let the compiler reorder float sums into vector lanes and fuse multiply-adds; NaNs and
# infinities keep their meaning
_FAST = {"reassoc", "contract", "nsz"}


@intrinsic
def _float_pointer(typingctx, address):
    """A float32 pointer to the byte ``address`` (an int64)."""
    signature = types.CPointer(types.float32)(types.int64)

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(sig.return_type))

    return signature, codegen


@numba.njit(cache=True, nogil=True, inline="always", fastmath=_FAST)
def _softmax(x, powers):  # pragma: no cover - compiled
    """``x`` (float32) turned into its softmax in place; ``powers``: int32 scratch of its length.

    ``exp`` is Cephes' single-precision one (a degree-6 polynomial on ``x - n ln 2``, times
    ``2**n`` built in the exponent bits), written out so that it vectorizes: libm's scalar
    ``expf`` took 40% of a decode over 3.7K keys. Within 2 ulp of ``expf``; arguments are at
    most 0 (the maximum is taken off first) and held above -87, where the weight is < 2e-38.
    """
    top = x[0]
    for j in range(1, x.shape[0]):
        top = max(top, x[j])
    for j in range(x.shape[0]):
        v = max(x[j] - top, np.float32(-87.0))
        n = np.floor(v * np.float32(1.44269504) + np.float32(0.5))
        r = v - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        x[j] = p * r * r + r + np.float32(1.0)
        powers[j] = (np.int32(n) + np.int32(127)) << np.int32(23)
    scale = powers.view(np.float32)
    total = np.float32(0.0)
    for j in range(x.shape[0]):
        x[j] *= scale[j]
        total += x[j]
    inverse = np.float32(1.0) / total
    for j in range(x.shape[0]):
        x[j] *= inverse


_KV = types.Array(types.float32, 3, "A", readonly=True)  # (heads, tokens, dim), any strides
_TABLE = types.Array(types.int64, 1, "C", readonly=True)
# one signature, compiled (or loaded from numba's cache) at import: a step's arrays convert to it
# whatever their strides (one token's transposed views are contiguous, several tokens' are not),
# so no step compiles a variant that ``ModelRunner.warm_up`` did not
_ATTEND = (_KV, _KV, _KV, types.Array(types.float32, 3, "A"), _TABLE)
_ATTEND += (types.Array(types.int64, 2, "C", readonly=True), _TABLE, types.int64, types.float32)


@numba.njit([_ATTEND], cache=True, nogil=True, fastmath=_FAST)
def _attend(query, key, value, out, rows, parts, first_part, layer, scale):  # pragma: no cover - compiled
    """``out[:, rows[s]]`` = sequence ``s``'s query ``query[:, rows[s]]`` (q_heads, dim) attended
    over the keys and values of its parts ``parts[first_part[s]:first_part[s + 1]]``, after its
    new key and value (``key[:, rows[s]]``, ``value[...]``: (kv_heads, dim)) are written into the
    last token of its last part, its own buffer."""
    q_heads, _, dim = query.shape
    kv_heads = key.shape[0]
    for s in range(rows.shape[0]):
        own = first_part[s + 1] - 1
        at = (parts[own, TOKENS] - 1) * parts[own, TOKEN_STRIDE]
        keys = _float_pointer(parts[own, ADDRESS] + _FLOAT_BYTES * layer * parts[own, LAYER_STRIDE])
        values = _float_pointer(
            parts[own, ADDRESS] + _FLOAT_BYTES * (layer * parts[own, LAYER_STRIDE] + parts[own, VALUE_OFFSET])
        )
        for g in range(kv_heads):
            head = at + g * parts[own, HEAD_STRIDE]
            for d in range(dim):
                keys[head + d] = key[g, rows[s], d]
                values[head + d] = value[g, rows[s], d]
    group = q_heads // kv_heads
    longest = 0
    for s in range(rows.shape[0]):
        n = 0
        for p in range(first_part[s], first_part[s + 1]):
            n += parts[p, TOKENS]
        longest = max(longest, n)
    scores = np.empty((group, longest), np.float32)
    q = np.empty((group, dim), np.float32)
    acc = np.empty((group, dim), np.float32)
    powers = np.empty(longest, np.int32)
    for s in range(rows.shape[0]):
        row = rows[s]
        for g in range(kv_heads):
            for h in range(group):
                for d in range(dim):
                    q[h, d] = query[g * group + h, row, d]
            t = 0
            for p in range(first_part[s], first_part[s + 1]):
                keys = _float_pointer(parts[p, ADDRESS] + _FLOAT_BYTES * layer * parts[p, LAYER_STRIDE])
                head = g * parts[p, HEAD_STRIDE]
                for j in range(parts[p, TOKENS]):
                    at = head + j * parts[p, TOKEN_STRIDE]
                    for h in range(group):
                        total = np.float32(0.0)
                        for d in range(dim):
                            total += q[h, d] * keys[at + d]
                        scores[h, t + j] = total * scale
                t += parts[p, TOKENS]
            for h in range(group):
                _softmax(scores[h, :t], powers[:t])
            acc[:] = 0.0
            t = 0
            for p in range(first_part[s], first_part[s + 1]):
                values = _float_pointer(
                    parts[p, ADDRESS]
                    + _FLOAT_BYTES * (layer * parts[p, LAYER_STRIDE] + parts[p, VALUE_OFFSET])
                )
                head = g * parts[p, HEAD_STRIDE]
                for j in range(parts[p, TOKENS]):
                    at = head + j * parts[p, TOKEN_STRIDE]
                    for h in range(group):
                        w = scores[h, t + j]
                        for d in range(dim):
                            acc[h, d] += w * values[at + d]
                t += parts[p, TOKENS]
            for h in range(group):
                for d in range(dim):
                    out[g * group + h, row, d] = acc[h, d]


def supports(kv: torch.Tensor) -> bool:
    """Whether decodes over KV like ``kv`` can go to the kernel: float32 on a CPU."""
    return kv.device.type == "cpu" and kv.dtype == torch.float32


class DecodeTable:
    """The parts of a step's decodes, laid out for ``_attend``: made once per step, read by every
    layer. ``sequences``: each decode's row in the step's tokens and its KV parts in order (each
    ``(layers, 2, kv_heads, tokens, head_dim)``, up to and including the decode's own token)."""

    def __init__(self, sequences: Sequence[tuple[int, Sequence[torch.Tensor]]]) -> None:
        rows, table, first = [], [], [0]
        for row, parts in sequences:
            rows.append(row)
            for part in parts:
                layer, kind, head, token, channel = part.stride()
                if channel != 1 or part.dtype != torch.float32 or part.device.type != "cpu":
                    raise ValueError("decode_attention reads float32 CPU KV with a contiguous head_dim")
                table.append((part.data_ptr(), layer, kind, head, token, part.shape[3]))
            first.append(len(table))
        self.rows = np.array(rows, dtype=np.int64)
        self.parts = np.array(table, dtype=np.int64).reshape(-1, 6)
        self.first_part = np.array(first, dtype=np.int64)
        self._keep = [parts for _, parts in sequences]  # the addresses stay valid while the table lives

    def attend(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        scale: float | None, out: torch.Tensor,
    ) -> None:  # fmt: skip
        """The decodes' new keys and values (``key``, ``value``: (1, kv_heads, tokens, dim), the
        step's) into their buffers, then their outputs into ``out`` (1, q_heads, tokens, dim) for
        ``query`` (the same shape)."""
        dim = query.shape[3]
        scale = dim**-0.5 if scale is None else scale
        _attend(
            query[0].numpy(), key[0].numpy(), value[0].numpy(), out[0].numpy(),
            self.rows, self.parts, self.first_part, layer, np.float32(scale),
        )  # fmt: skip
