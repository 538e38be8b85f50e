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

Per (sequence, KV head) pair it computes the scores of the query heads that
share that KV head (no key is read twice), a softmax, and the weighted sum of
the values, in float32, each pair in a fixed order: a sequence's output does
not depend on what else is in the call, nor on which thread computes it.
``fastmath`` lets the compiler reorder the sums over ``head_dim`` into vector
lanes (and fuse multiply-adds); ``exp`` and infinities keep their exact
meaning.

At 8-16 decodes of a few hundred keys the call is bound by memory, not by
arithmetic: a step reads every layer's KV once, far more than the caches
keep between layers (16 x 100 keys: 2.4 MB a layer, 73 MB a step). So:

- **Both cores.** A layer's pairs are split into contiguous shares of about
  equal keys, one per torch thread, and run as one parallel region of the
  OpenMP runtime that torch itself uses (``GOMP_parallel``, on a numba
  ``cfunc``). Its worker threads are awake between the step's products, so a
  region costs a few microseconds; a thread pool of our own would fight
  torch's spinning workers for the cores (``app/threads.py``).
- **Prefetch.** While a pair's scores are computed its value rows are
  prefetched, and while its values are summed the next pair's keys are: the
  hardware prefetcher alone restarts at every 4 KiB page.
- **Four keys at a time** in the scores, so each query element is loaded once
  for four keys (its sum over ``head_dim`` keeps its order).

Measured in a decode step of the real model on 2 cores, against the
one-thread kernel before (``docs/serving.md``): 16 decodes over 100 keys,
62-64 -> 54-57 ms a step in float32 and 42.4 -> 34.7 ms with bf16 weights;
over 400 keys 92 -> 70 ms. One decode is unchanged.

The parts are described by a table made once per step (``DecodeTable``): one
row per part, with its layer-0 address, strides and length; the step's
tensors go in a call record of addresses and strides that each layer
refills. The addresses are only read while the step holds the tensors.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import llvmlite.binding as llvm
import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

# a part's row in the table: byte address of layer 0's keys, head 0, token 0; then strides in
# elements (layer, K -> V, head, token) and its number of tokens
ADDRESS, LAYER_STRIDE, VALUE_OFFSET, HEAD_STRIDE, TOKEN_STRIDE, TOKENS = range(6)
_FLOAT_BYTES = 4
# let the compiler reorder float sums into vector lanes and fuse multiply-adds; NaNs and
# infinities keep their meaning
_FAST = {"reassoc", "contract", "nsz"}


def _pointer_to(element: types.Type):
    """An intrinsic that makes a pointer to ``element`` values of the byte address it is given (an
    int64)."""

    @intrinsic
    def pointer(typingctx, address):
        signature = types.CPointer(element)(types.int64)

        def codegen(context, builder, sig, args):
            return builder.inttoptr(args[0], context.get_value_type(sig.return_type))

        return signature, codegen

    return pointer


_float_pointer = _pointer_to(types.float32)
_int_pointer = _pointer_to(types.int64)


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


# the call record (``DecodeTable``): one int64 array per step, whose per-layer fields are refilled
# by each layer's ``attend``; the worker threads read everything from it
(
    LAYER, SCALE_BITS, QUERY, QUERY_HEAD, QUERY_ROW, KEY, KEY_HEAD, KEY_ROW, VALUE, VALUE_HEAD,
    VALUE_ROW, OUT, OUT_HEAD, OUT_ROW, Q_HEADS, KV_HEADS, DIM, ROWS, PARTS, FIRST_PART, SEQUENCES,
    PART_COUNT, THREADS, BOUNDS,
) = range(24)  # fmt: skip
_LINE = 64  # bytes a prefetch brings in


@intrinsic
def _address_of(typingctx, pointer):
    """A ``void*``'s byte address as an int64."""
    signature = types.int64(types.voidptr)

    def codegen(context, builder, sig, args):
        return builder.ptrtoint(args[0], ir.IntType(64))

    return signature, codegen


@intrinsic
def _prefetch(typingctx, address):
    """Start bringing the cache line at the byte ``address`` into L2 (a hint: never faults)."""
    signature = types.void(types.int64)

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        hint = ir.FunctionType(ir.VoidType(), [ir.PointerType(), i32, i32, i32])
        function = cgutils.get_or_insert_function(builder.module, hint, "llvm.prefetch.p0")
        # read, locality 2 (prefetcht1: L2 and out), data cache
        builder.call(function, [builder.inttoptr(args[0], ir.PointerType()), i32(0), i32(2), i32(1)])
        return context.get_dummy_value()

    return signature, codegen


@numba.njit(cache=True, nogil=True, inline="always")
def _prefetch_row(address, dim):  # pragma: no cover - compiled
    for line in range(0, dim * _FLOAT_BYTES, _LINE):
        _prefetch(address + line)


@numba.njit(cache=True, nogil=True, inline="always", fastmath=_FAST)
def _scores(q, keys, values, head, stride, n, scores, t, scale, dim):  # pragma: no cover - compiled
    """``scores[h, t + j]`` = ``q[h]`` . key ``j`` of a part (``keys[head + j * stride]``), four
    keys at a time, so that each query element is loaded once for four keys. Each key's sum runs
    over ``head_dim`` in the same order however many keys a part has. The part's value rows are
    prefetched beside their keys: the weighted sum reads them next."""
    group = q.shape[0]
    j = 0
    while j + 4 <= n:
        at = head + j * stride
        for r in range(4):
            _prefetch_row(values + _FLOAT_BYTES * (at + r * stride), dim)
        for h in range(group):
            s0 = np.float32(0.0)
            s1 = np.float32(0.0)
            s2 = np.float32(0.0)
            s3 = np.float32(0.0)
            for d in range(dim):
                x = q[h, d]
                s0 += x * keys[at + d]
                s1 += x * keys[at + stride + d]
                s2 += x * keys[at + 2 * stride + d]
                s3 += x * keys[at + 3 * stride + d]
            scores[h, t + j] = s0 * scale
            scores[h, t + j + 1] = s1 * scale
            scores[h, t + j + 2] = s2 * scale
            scores[h, t + j + 3] = s3 * scale
        j += 4
    while j < n:
        at = head + j * stride
        _prefetch_row(values + _FLOAT_BYTES * at, dim)
        for h in range(group):
            s0 = np.float32(0.0)
            for d in range(dim):
                s0 += q[h, d] * keys[at + d]
            scores[h, t + j] = s0 * scale
        j += 1


@numba.njit(cache=True, nogil=True, inline="always")
def _row_address(parts, part, token, layer, g):  # pragma: no cover - compiled
    """The byte address of head ``g``'s key at ``token`` of ``part``, in ``layer``."""
    at = layer * parts[part, LAYER_STRIDE] + g * parts[part, HEAD_STRIDE]
    return parts[part, ADDRESS] + _FLOAT_BYTES * (at + token * parts[part, TOKEN_STRIDE])


@numba.njit(cache=True, nogil=True, inline="always", fastmath=_FAST)
def _weighted_sum(scores, values, head, stride, n, acc, t, dim, parts, ahead, layer):  # pragma: no cover
    """``acc[h]`` += the weights ``scores[h, t + j]`` times value ``j`` of a part. While it runs,
    one row of the next pair's keys is prefetched per value row: ``ahead`` is that stream's
    (part, token, last part + 1, head)."""
    group = acc.shape[0]
    for j in range(n):
        if ahead[0] < ahead[2]:
            _prefetch_row(_row_address(parts, ahead[0], ahead[1], layer, ahead[3]), dim)
            ahead[1] += 1
            if ahead[1] == parts[ahead[0], TOKENS]:
                ahead[0] += 1
                ahead[1] = 0
        at = head + j * stride
        for h in range(group):
            w = scores[h, t + j]
            for d in range(dim):
                acc[h, d] += w * values[at + d]


_TABLE = types.Array(types.int64, 1, "C")
# one signature, compiled (or loaded from numba's cache) at import: the step's tensors are passed as
# addresses and strides in the call record, so no layout or batch width compiles a variant
_ATTEND = (_TABLE, _TABLE, types.Array(types.int64, 2, "C"), _TABLE, types.int64, types.int64)


@numba.njit([types.void(*_ATTEND)], cache=True, nogil=True, fastmath=_FAST)
def _attend(call, rows, parts, first_part, begin, end):  # pragma: no cover - compiled
    """The pairs ``begin`` to ``end`` of the step's (sequence, KV head) pairs, in order: pair
    ``u`` is sequence ``u // kv_heads``'s KV head ``u % kv_heads``. For each, its new key and
    value (the step's, row ``rows[s]``) go into the last token of the sequence's last part, its
    own buffer; then its query heads' outputs are the softmax-weighted sums over the parts
    ``parts[first_part[s]:first_part[s + 1]]``."""
    layer = call[LAYER]
    scale = np.array([call[SCALE_BITS]], np.int64).astype(np.int32).view(np.float32)[0]
    query, key = _float_pointer(call[QUERY]), _float_pointer(call[KEY])
    value, out = _float_pointer(call[VALUE]), _float_pointer(call[OUT])
    kv_heads, dim = call[KV_HEADS], call[DIM]
    group = call[Q_HEADS] // kv_heads
    longest = 0
    for s in range(begin // kv_heads, (end + kv_heads - 1) // kv_heads):
        n = 0
        for p in range(first_part[s], first_part[s + 1]):
            n += parts[p, TOKENS]
        longest = max(longest, n)
    scores = np.empty((group, longest), np.float32)
    q = np.empty((group, dim), np.float32)
    acc = np.empty((group, dim), np.float32)
    powers = np.empty(longest, np.int32)
    ahead = np.zeros(4, np.int64)
    for u in range(begin, end):
        s, g = u // kv_heads, u % kv_heads
        row = rows[s]
        own = first_part[s + 1] - 1
        new = (parts[own, TOKENS] - 1) * parts[own, TOKEN_STRIDE] + g * parts[own, HEAD_STRIDE]
        base = layer * parts[own, LAYER_STRIDE]
        keys = _float_pointer(parts[own, ADDRESS] + _FLOAT_BYTES * base)
        values = _float_pointer(parts[own, ADDRESS] + _FLOAT_BYTES * (base + parts[own, VALUE_OFFSET]))
        for d in range(dim):
            keys[new + d] = key[g * call[KEY_HEAD] + row * call[KEY_ROW] + d]
            values[new + d] = value[g * call[VALUE_HEAD] + row * call[VALUE_ROW] + d]
        for h in range(group):
            at = (g * group + h) * call[QUERY_HEAD] + row * call[QUERY_ROW]
            for d in range(dim):
                q[h, d] = query[at + d]
        ahead[:] = 0  # the next pair's keys: prefetched while this pair's values are summed
        if u + 1 < end:
            following = (u + 1) // kv_heads
            ahead[0], ahead[2] = first_part[following], first_part[following + 1]
            ahead[3] = (u + 1) % kv_heads
        t = 0
        for p in range(first_part[s], first_part[s + 1]):
            base = parts[p, ADDRESS] + _FLOAT_BYTES * layer * parts[p, LAYER_STRIDE]
            keys = _float_pointer(base)
            values_at = base + _FLOAT_BYTES * parts[p, VALUE_OFFSET]
            head = g * parts[p, HEAD_STRIDE]
            _scores(q, keys, values_at, head, parts[p, TOKEN_STRIDE], parts[p, TOKENS], scores, t, scale, dim)
            t += parts[p, TOKENS]
        for h in range(group):
            _softmax(scores[h, :t], powers[:t])
        acc[:] = 0.0
        t = 0
        for p in range(first_part[s], first_part[s + 1]):
            values = _float_pointer(
                parts[p, ADDRESS] + _FLOAT_BYTES * (layer * parts[p, LAYER_STRIDE] + parts[p, VALUE_OFFSET])
            )
            stride, n = parts[p, TOKEN_STRIDE], parts[p, TOKENS]
            _weighted_sum(
                scores, values, g * parts[p, HEAD_STRIDE], stride, n, acc, t, dim, parts, ahead, layer
            )
            t += parts[p, TOKENS]
        for h in range(group):
            at = (g * group + h) * call[OUT_HEAD] + row * call[OUT_ROW]
            for d in range(dim):
                out[at + d] = acc[h, d]


@intrinsic
def _thread_number(typingctx):
    """``omp_get_thread_num()``: the calling thread's number in its OpenMP team. The symbol is
    resolved in the runtime that ``_openmp`` made visible to the JIT."""
    signature = types.int32()

    def codegen(context, builder, sig, args):
        declared = ir.FunctionType(ir.IntType(32), [])
        return builder.call(
            cgutils.get_or_insert_function(builder.module, declared, "omp_get_thread_num"), []
        )

    return signature, codegen


def _openmp() -> ctypes._CFuncPtr | None:
    """``GOMP_parallel`` of the GNU OpenMP runtime that torch loaded, or None. Only the runtime
    already in the process is taken: another one (or a second copy of this one) would keep a
    team of its own spinning beside torch's (``app/threads.py``)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libgomp" in line}
    except OSError:  # not Linux
        return None
    if len(paths) != 1:
        return None
    path = paths.pop()
    llvm.load_library_permanently(path)  # the same handle: its symbols become the JIT's
    parallel = ctypes.CDLL(path).GOMP_parallel  # (fn, data, num_threads, flags), GCC >= 4.9
    parallel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    parallel.restype = None
    return parallel


_PARALLEL = _openmp()
if _PARALLEL is not None:

    @numba.cfunc(types.void(types.voidptr), cache=True, nopython=True)
    def _team_member(data):  # pragma: no cover - compiled
        """One thread of an OpenMP team: the pairs of its share, ``BOUNDS`` in the call record."""
        address = _address_of(data)
        threads = numba.carray(_int_pointer(address), BOUNDS)[THREADS]
        call = numba.carray(_int_pointer(address), BOUNDS + threads + 1)
        sequences = call[SEQUENCES]
        rows = numba.carray(_int_pointer(call[ROWS]), sequences)
        parts = numba.carray(_int_pointer(call[PARTS]), (call[PART_COUNT], 6))
        first_part = numba.carray(_int_pointer(call[FIRST_PART]), sequences + 1)
        me = _thread_number()
        _attend(call, rows, parts, first_part, call[BOUNDS + me], call[BOUNDS + me + 1])


def supports(kv: torch.Tensor) -> bool:
    """Whether decodes over KV like ``kv`` can go to the kernel: float32 on a CPU."""
    return kv.device.type == "cpu" and kv.dtype == torch.float32


def shares(costs: np.ndarray, threads: int) -> np.ndarray:
    """Where each of ``threads`` shares of the pairs begins (and the last ends): contiguous runs of
    about equal total ``costs``, so that no thread waits long for another at the team's end."""
    total = np.concatenate([[0], np.cumsum(costs)])
    cuts = np.searchsorted(total, total[-1] * np.arange(1, threads) / threads)
    return np.concatenate([[0], cuts, [len(costs)]]).astype(np.int64)


# a pair's cost in its keys, plus a fixed part (its query, softmax and output)
_PAIR_OVERHEAD = 8
# the fewest keys (all the step's decodes together) worth a parallel region: under it the call
# takes a few microseconds a layer, and waking torch's workers (asleep while a one-row step's
# products ran on the calling thread alone) costs more. Split, against the one-thread kernel
# before (``benchmarks/decode_kernel_ab.py``, 2 cores): one decode over 100 keys 1.075x a step's
# time, 4 over 100 1.00x, 8 over 100 0.98x, one over 2,000 0.96x
PARALLEL_MIN_KEYS = 512


class DecodeTable:
    """The parts of a step's decodes, laid out for ``_attend``: made once per step, read by every
    layer. ``sequences``: each decode's row in the step's tokens and its KV parts in order (each
    ``(layers, 2, kv_heads, tokens, head_dim)``, up to and including the decode's own token).

    A layer's pairs are split over the calling thread's torch threads
    (``torch.get_num_threads()``, which the step loop sets before each step) as one
    parallel region of torch's own OpenMP team, whose threads are already awake between
    the step's operations. A pair's output is computed the same way on any thread, so the
    split changes no bits.
    """

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
        self.keys = int(self.parts[:, TOKENS].sum())
        self._call: np.ndarray | None = None
        self._layout: tuple | None = None  # what ``_call`` was made for

    def _record(self, tensors: tuple[torch.Tensor, ...], scale: float | None, threads: int) -> np.ndarray:
        """The call record's fields that hold for the whole step: the table, the shapes, the step
        tensors' strides and the scale, and the pairs' split over ``threads``."""
        query, key = tensors[0], tensors[1]
        for tensor in tensors:
            if tensor.stride(3) != 1 or tensor.dtype != torch.float32:
                raise ValueError("decode_attention takes float32 step tensors with a contiguous dim")
        call = np.zeros(BOUNDS + threads + 1, dtype=np.int64)
        call[ROWS], call[PARTS], call[FIRST_PART] = (
            a.ctypes.data for a in (self.rows, self.parts, self.first_part)
        )
        call[SEQUENCES], call[PART_COUNT], call[THREADS] = len(self.rows), len(self.parts), threads
        call[Q_HEADS], call[KV_HEADS], call[DIM] = query.shape[1], key.shape[1], query.shape[3]
        for field, tensor in zip((QUERY, KEY, VALUE, OUT), tensors, strict=True):
            call[field + 1], call[field + 2] = tensor.stride(1), tensor.stride(2)
        scale = query.shape[3] ** -0.5 if scale is None else scale
        call[SCALE_BITS] = np.array(scale, dtype=np.float32).view(np.int32)
        tokens = np.add.reduceat(self.parts[:, TOKENS], self.first_part[:-1])
        call[BOUNDS:] = shares(np.repeat(tokens + _PAIR_OVERHEAD, key.shape[1]), threads)
        return call

    def attend(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        scale: float | None, out: torch.Tensor,
    ) -> None:  # fmt: skip
        """The decodes' new keys and values (``key``, ``value``: (1, kv_heads, tokens, dim), the
        step's) into their buffers, then their outputs into ``out`` (1, q_heads, tokens, dim) for
        ``query`` (the same shape). Each of the four may have any strides but a contiguous dim;
        every layer of a step passes the same layouts and scale (checked, cheaply, by the strides)."""
        threads = torch.get_num_threads() if _PARALLEL is not None and self.keys >= PARALLEL_MIN_KEYS else 1
        threads = max(1, min(threads, len(self.rows) * key.shape[1]))
        tensors = (query, key, value, out)
        layout = (threads, scale, *(tensor.stride() for tensor in tensors))
        if layout != self._layout:
            self._call, self._layout = self._record(tensors, scale, threads), layout
        call = self._call
        call[LAYER] = layer
        call[QUERY], call[KEY], call[VALUE], call[OUT] = (tensor.data_ptr() for tensor in tensors)
        if threads == 1:
            _attend(call, self.rows, self.parts, self.first_part, 0, int(call[BOUNDS + 1]))
        else:
            _PARALLEL(_team_member.address, call.ctypes.data, threads, 0)
