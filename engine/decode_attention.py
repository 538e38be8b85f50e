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


@intrinsic
def _float_pointer(typingctx, address):
    """A float32 pointer to the byte ``address`` (an int64)."""
    signature = types.CPointer(types.float32)(types.int64)

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(sig.return_type))

    return signature, codegen


@numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract", "nsz"})
def _attend(query, out, rows, parts, first_part, layer, kv_heads, scale):  # pragma: no cover - compiled
    """``out[:, rows[s]]`` = sequence ``s``'s query ``query[:, rows[s]]`` (q_heads, dim) attended
    over the keys and values of its parts ``parts[first_part[s]:first_part[s + 1]]``."""
    q_heads, _, dim = query.shape
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
                top = scores[h, 0]
                for j in range(1, t):
                    top = max(top, scores[h, j])
                total = np.float32(0.0)
                for j in range(t):
                    e = np.exp(scores[h, j] - top)
                    scores[h, j] = e
                    total += e
                inverse = np.float32(1.0) / total
                for j in range(t):
                    scores[h, j] *= inverse
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
        self.kv_heads = sequences[0][1][0].shape[2]
        self._keep = [parts for _, parts in sequences]  # the addresses stay valid while the table lives

    def attend(self, layer: int, query: torch.Tensor, scale: float | None, out: torch.Tensor) -> None:
        """The decodes' outputs into ``out`` (1, q_heads, tokens, dim) for ``query`` (the same
        shape); their new keys and values are already in their buffers."""
        dim = query.shape[3]
        scale = dim**-0.5 if scale is None else scale
        _attend(
            query[0].numpy(), out[0].numpy(), self.rows, self.parts, self.first_part,
            layer, self.kv_heads, np.float32(scale),
        )  # fmt: skip
