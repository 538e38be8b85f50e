"""Ragged batches: many sequences of different lengths in one forward pass, each with its own KV buffer.

A step of the serving loop mixes decodes (one token each) with prefill chunks
(many tokens each), every sequence at its own position. The tokens of all
segments are laid end to end in one row, so the model's linear layers see one
matrix of ``sum(tokens)`` rows: that is where batching pays on a CPU. Rotary
embeddings follow each token's own position.

Attention reads each sequence's own buffer, one sequence at a time, so that a
sequence's numbers never depend on what shares its step (batch invariance):

- a prompt's chunk goes, where the model is batch-invariant
  (``active(..., tiled=True)``: bf16 weights on a CPU whose bf16 products are
  row-invariant, ``LoadedModel.batch_invariant``), to
  ``engine.tiled_attention``: keys in fixed 256-token tiles at absolute
  positions, so a query's output is the same bits however the prompt was cut
  into chunks (the step loop cuts it by what else runs) and whichever buffers
  its keys sit in. Elsewhere (float32, whose MKL products are not
  row-invariant anyway) it goes to SDPA's fused causal kernel (a first chunk)
  or ``_attend_parts`` (a later one): 13% less time for a 3.6K-token prompt
  in float32 (``benchmarks/results/invariance_cost_amx.json``);
- the step's decodes (one token each) are attended together in one batched
  call per layer: on a CPU with float32 KV by ``engine.decode_attention``'s
  kernel, over each sequence's KV in place, however long. The kernel computes
  each (sequence, KV head) pair the same way whatever shares its call and
  however the call is split over threads, so a batch-invariant model's
  decodes (``Segment.decode``) go to it too. Elsewhere (a GPU, bf16 KV), where
  the model is not batch-invariant anyway, their keys and values are gathered
  into a padded batch (``_DecodeBatch``), which costs a copy of their KV but
  saves a dozen small tensor operations per sequence and layer. In the
  gateway that is what 16 clients' tokens/s rests on: attended one by one
  they got 0.68x of it in float32 (``python -m benchmarks.setting_ab
  --baseline 3408c48 --concurrency 16``) and 0.43x with batch-invariant bf16
  weights (``setting_ab_invariant_kernel.json``): the model thread's many
  small operations contend for the GIL with the event loop's; an in-process
  step alone showed no difference. A decode whose context is longer than
  ``BATCH_MAX_KEYS`` is not gathered into a padded batch: for long sequences
  the gather costs more than the loop it saves;
- off the kernel, where the model is batch-invariant, and for long decodes, a decode is two
  matmuls and a softmax over its own keys (``_one_query``), or over its parts (``_attend_parts``)
  when it reads shared KV: the same shapes alone or batched (a padded batch's sums depend on its
  longest member).

transformers lets a model name its attention function; the runner registers
``ragged_attention`` under ``ATTENTION_NAME`` and switches the model to it.
While ``active(segments)`` is set on the calling thread, each layer's
attention writes the segment's new keys and values straight into its buffer
(``(layers, 2, kv_heads, capacity, head_dim)``, the layout shared with the
codec) and attends to ``buffer[:start + tokens]``: there is no cache object
and no copy. A sequence may also read KV it does not own (``Segment.shared``): the
leading tokens of another request's buffer, attached from the in-memory
prefix cache instead of copied. Its own buffer then starts at the end of
those parts (``Segment.offset``), and its tokens attend to the shared parts
and to its own buffer, merged by their log-sum-exps (``_attend_parts``):
nothing is copied or concatenated, and the shared tokens are never written.

Off the CPU, a prompt's chunk always goes to SDPA's causal kernel or
``_attend_parts``, which are not chunk-invariant.

With ``active(..., bf16_prompts=True)`` (``LoadedModel.bf16_attention``: bf16
weights on a CPU whose bf16 products are not batch-invariant, AMX) an untiled
prompt chunk of more than one token has its queries, keys and values rounded
to bf16 for those calls, and its output comes back as float32; the KV buffers
stay float32, and decodes (and one-token chunks) are attended in float32. One causal SDPA call over 3,584 tokens took
74.3 ms in float32 and 24.6 ms in bf16 on the AMX Xeon, and a 3,584-token
prefill 4.14 s against 2.94 s with every prompt chunk attended so.

The attention function has no mask to follow, so models whose attention is
more than causal softmax (sliding windows, logit soft-capping) are refused
(``check_supported``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from engine import decode_attention
from engine.decode_attention import DecodeTable
from engine.tiled_attention import TiledPrefill

ATTENTION_NAME = "cachegen_ragged"


@dataclass
class Segment:
    """One sequence's tokens in a ragged step."""

    kv: torch.Tensor  # (layers, 2, kv_heads, capacity, head_dim): the sequence's own KV buffer
    start: int  # the position of the first token: the sequence's KV holds ``start`` tokens before it
    token_ids: Sequence[int]
    logits: str = "last"  # "last", "all" (every token's, for prompt logprobs) or "none"
    # read-only KV of the first tokens, in order, each (layers, 2, kv_heads, tokens, head_dim);
    # ``kv`` holds the tokens after them, from its index 0
    shared: tuple[torch.Tensor, ...] = ()
    # one sampled token (the decode kernel's, or ``_one_query`` / ``_attend_parts`` over shared KV),
    # not a prompt's (``engine.tiled_attention`` on a CPU): a one-token chunk of a prompt is a prompt's
    decode: bool = False

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @cached_property
    def offset(self) -> int:
        """The position of ``kv``'s first token: how many tokens the shared parts hold."""
        return sum(part.shape[3] for part in self.shared)

    def parts(self, layer: int) -> list[torch.Tensor]:
        """The layer's KV up to ``end``, in order: each (2, kv_heads, tokens, head_dim)."""
        own = self.kv[layer, :, :, : self.end - self.offset]
        return [part[layer] for part in self.shared] + [own]

    def kv_parts(self) -> list[torch.Tensor]:
        """Every layer's KV up to ``end``, in order: each (layers, 2, kv_heads, tokens, head_dim)."""
        return [*self.shared, self.kv[:, :, :, : self.end - self.offset]]


# decodes over longer contexts are not gathered into a padded batch (``_DecodeBatch``): its gather
# costs more than the loop it saves. The CPU kernel takes every length: on both cores it is as fast
# as torch's matmuls for one decode over 2,000-3,500 keys and faster for several (a step of 8
# decodes over 2,000 keys, 2 cores: 97 against 130 ms attended one by one)
BATCH_MAX_KEYS = 1024


class _DecodeBatch:
    """The decodes of one step that are attended together; the same for every layer.

    Their keys and values are gathered per layer into one ``(2, batch, kv_heads,
    longest, head_dim)`` tensor, zeroed once per step: every layer writes the
    same positions, so those past a sequence's end stay zero (they are also
    masked out of the scores).
    """

    def __init__(self, members: list[tuple[Segment, int]], device: torch.device) -> None:
        self.segments = [segment for segment, _ in members]
        self.rows = torch.tensor([row for _, row in members], device=device)
        ends = torch.tensor([segment.end for segment in self.segments], device=device)
        self.longest = max(segment.end for segment in self.segments)
        self.padding = (torch.arange(self.longest, device=device) >= ends[:, None])[:, None, None, :]
        self._gathered: torch.Tensor | None = None

    def attend(self, layer: int, query: torch.Tensor, scale: float | None, out: torch.Tensor) -> None:
        """This batch's outputs into ``out``; their new keys and values are in their buffers."""
        segments, rows = self.segments, self.rows
        kv_heads, dim = segments[0].kv.shape[2], query.shape[3]
        batch = len(segments)
        if self._gathered is None:
            shape = (2, batch, kv_heads, self.longest, dim)
            self._gathered = torch.zeros(shape, dtype=query.dtype, device=query.device)
        gathered = self._gathered
        into, sources = [], []
        for b, segment in enumerate(segments):
            at = 0
            for part in segment.parts(layer):
                into.append(gathered[:, b, :, at : at + part.shape[2]])
                sources.append(part)
                at += part.shape[2]
        torch._foreach_copy_(into, sources)
        grouped = query[0, :, rows].transpose(0, 1).reshape(batch, kv_heads, -1, dim)
        scores = torch.matmul(grouped, gathered[0].transpose(2, 3))
        scores.mul_(scale if scale is not None else dim**-0.5).masked_fill_(self.padding, float("-inf"))
        attended = torch.matmul(torch.softmax(scores, dim=-1), gathered[1])  # (batch, kv_heads, group, dim)
        out[0, :, rows] = attended.reshape(batch, -1, dim).transpose(0, 1)


_state = threading.local()


@contextmanager
def active(segments: Sequence[Segment], tiled: bool = False, bf16_prompts: bool = False) -> Iterator[None]:
    """Route this thread's attention calls to ``segments`` for the duration. ``tiled`` (the model
    is batch-invariant): prompt chunks on a CPU go to ``engine.tiled_attention`` (the same bits
    however a prompt is cut). The one-token segments are attended together by
    ``engine.decode_attention`` (float32 on a CPU, any length; with ``tiled``, decodes only) or,
    untiled and of at most ``BATCH_MAX_KEYS`` keys, as a padded batch (``_DecodeBatch``); the
    others each by itself.
    ``bf16_prompts``: untiled prompt chunks attend in bf16 (the module docstring)."""
    kernel = decode_attention.supports(segments[0].kv)
    work, ones, at = [], [], 0
    for segment in segments:
        tiles = tiled and not segment.decode and segment.kv.device.type == "cpu"
        work.append((segment, at, TiledPrefill(segment) if tiles else None))
        # the kernel attends each sequence by itself, so a batch-invariant model's decodes go to it
        # too (a one-token chunk of a prompt stays in its tiles); a padded batch does not
        in_kernel = kernel and (segment.decode or not tiled)
        padded = not tiled and segment.end <= BATCH_MAX_KEYS
        if len(segment.token_ids) == 1 and (in_kernel or padded):
            ones.append((segment, at))
        at += len(segment.token_ids)
    decodes: DecodeTable | _DecodeBatch | None = None
    if ones and kernel:
        decodes = DecodeTable([(row, segment.kv_parts()) for segment, row in ones])
    elif len(ones) > 1:
        decodes = _DecodeBatch(ones, segments[0].kv.device)
    together = {id(segment) for segment, _ in ones} if decodes is not None else set()
    _state.batch = (work, decodes, together, bf16_prompts)
    try:
        yield
    finally:
        _state.batch = None


def ragged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``query`` (1, q_heads, tokens, dim), ``key``/``value``
    (1, kv_heads, tokens, dim) after rotary; returns (1, tokens, q_heads, dim)."""
    batch = getattr(_state, "batch", None)
    if batch is None:
        raise RuntimeError(
            "ragged attention runs only inside engine.ragged.active (ModelRunner.forward_ragged)"
        )
    work, decodes, together, bf16_prompts = batch
    layer = module.layer_idx
    writes = isinstance(decodes, DecodeTable)  # the kernel writes its decodes' KV itself
    into, new = [], []  # the other segments' new keys and values, written in one call
    for segment, q0, _ in work:
        if writes and id(segment) in together:
            continue
        buffer = segment.kv[layer]
        first, last = segment.start - segment.offset, segment.end - segment.offset
        into += [buffer[0, :, first:last], buffer[1, :, first:last]]
        q1 = q0 + len(segment.token_ids)
        new += [key[0, :, q0:q1], value[0, :, q0:q1]]
    if into:
        torch._foreach_copy_(into, new)
    out = torch.empty_like(query)
    if writes:
        decodes.attend(layer, query, key, value, scaling, out)
    elif decodes is not None:
        decodes.attend(layer, query, scaling, out)
    for segment, q0, tiled in work:
        if id(segment) in together:
            continue
        n = len(segment.token_ids)
        q1 = q0 + n
        if tiled is not None:
            out[0, :, q0:q1] = tiled.attend(layer, query[0, :, q0:q1], scaling)
            continue
        # a prompt's chunk in bf16 where asked; a decode, or any one query (whose scores and softmax
        # ``_one_query`` would compute in bf16, where SDPA's kernels accumulate in float32), stays float32
        cast = _to_bf16 if bf16_prompts and not segment.decode and n > 1 else _as_is
        if segment.shared or (n > 1 and segment.start > 0):
            parts = [cast(part) for part in _own_apart(segment.parts(layer), n)]
            out[0, :, q0:q1] = _attend_parts(cast(query[0, :, q0:q1]), parts, scaling)
        elif n == 1:
            own = cast(segment.kv[layer, :, :, : segment.end])
            out[0, :, q0] = _one_query(cast(query[0, :, q0]), own[0], own[1], scaling)
        else:  # a prompt's first chunk, untiled: SDPA's fused causal path
            own = cast(segment.kv[layer, :, :, : segment.end])
            out[0, :, q0:q1] = _causal(cast(query[:, :, q0:q1]), own[0][None], own[1][None], scaling)[
                0
            ].transpose(0, 1)
    return out.transpose(1, 2), None


def _to_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16)


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


def _own_apart(parts: list[torch.Tensor], n: int) -> list[torch.Tensor]:
    """``parts`` with the last ``n`` keys (the queries' own) split off the last part when it holds
    more: only they need the causal mask, and attending the tokens before them unmasked makes a
    512-token chunk after a 3K-token prefix 15-20% faster on 2 cores than one masked call over
    all of its keys (a 3.6K-token prefill in 512-token passes cost 1.28x one SDPA forward so)."""
    last = parts[-1]
    if last.shape[2] <= n:
        return parts
    return [*parts[:-1], last[:, :, :-n], last[:, :, -n:]]


def _one_query(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None):
    """One token's attention: ``query`` (q_heads, dim) against (kv_heads, tokens, dim).

    The query heads that share a KV head are laid out as that head's rows, so
    no key is repeated and no mask is needed. Two matmuls and a softmax: for a
    single query SDPA's fused kernels cost more in setup than they save (fp32,
    2 cores: 40 against 67 us at 300 keys, 155 against 389 us at 2,000).
    """
    kv_heads, dim = keys.shape[0], query.shape[-1]
    grouped = query.reshape(kv_heads, -1, dim)
    scores = torch.matmul(grouped, keys.transpose(1, 2)).mul_(scale if scale is not None else dim**-0.5)
    out = torch.matmul(torch.softmax(scores, dim=-1), values)
    return out.reshape(query.shape)


def _attend_parts(query: torch.Tensor, parts: list[torch.Tensor], scale: float | None) -> torch.Tensor:
    """Causal attention of ``query`` (q_heads, tokens, dim), the sequence's last tokens, over its
    KV in ``parts`` (each (2, kv_heads, tokens, dim), the last one ending with the query's own).

    Each part is attended on its own and the results are merged by their log-sum-exps, which
    gives the attention over the parts' concatenation without concatenating them. Query heads
    are grouped by their KV head, as in ``_one_query``, so no key is repeated; only the last part
    needs a mask (the earlier ones end before the first query). On a CPU each part goes to
    torch's fused flash kernel, which returns its log-sum-exp (2 cores, 32 queries over 3.6K
    shared keys: 2.6-3.0 ms a layer, against 3.1-3.7 ms for SDPA over one contiguous buffer and
    5.7-8.9 ms for one softmax over the parts' scores laid side by side); elsewhere the scores
    are laid side by side (``_attend_parts_matmul``).
    """
    if query.device.type != "cpu":
        return _attend_parts_matmul(query, parts, scale)
    heads, n, dim = query.shape
    kv_heads = parts[0].shape[1]
    grouped = query.reshape(1, kv_heads, -1, dim)  # a KV head's query rows: n per query head
    outs, lses = [], []
    for i, part in enumerate(parts):
        mask = None
        if i == len(parts) - 1 and n > 1:
            mask = _grouped_causal_mask(n, part.shape[2], heads // kv_heads, query.dtype, query.device)
        out, lse = _flash_cpu(grouped, part[0][None], part[1][None], attn_mask=mask, scale=scale)
        outs.append(out)
        lses.append(lse.unsqueeze(-1))
    top = torch.stack(lses).amax(dim=0)
    weights = [torch.exp(lse - top) for lse in lses]
    merged = sum(w * out for w, out in zip(weights, outs)) / sum(weights)
    return merged.reshape(heads, n, dim)


_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@lru_cache(maxsize=64)  # the same for every layer of a step: made once, only ever read
def _grouped_causal_mask(
    queries: int, keys: int, group: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The additive mask of ``queries`` last tokens over ``keys`` keys that end with theirs, for
    query rows grouped by KV head (``group`` heads of ``queries`` rows each)."""
    rows = torch.arange(queries, device=device).repeat(group) + (keys - queries)
    hidden = torch.arange(keys, device=device)[None, :] > rows[:, None]
    return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))


def _attend_parts_matmul(query: torch.Tensor, parts: list[torch.Tensor], scale: float | None) -> torch.Tensor:
    """``_attend_parts`` by plain matmuls: the parts' scores side by side, one softmax."""
    heads, n, dim = query.shape
    kv_heads = parts[0].shape[1]
    grouped = query.reshape(kv_heads, -1, dim)  # (kv_heads, group * n, dim), a head's n rows in a row
    scores = torch.cat([torch.matmul(grouped, part[0].transpose(1, 2)) for part in parts], dim=-1)
    scores.mul_(scale if scale is not None else dim**-0.5)
    if n > 1:
        keys = scores.shape[-1]
        rows = torch.arange(n, device=query.device) + (keys - n)  # each query's position
        hidden = torch.arange(keys, device=query.device)[None, :] > rows[:, None]  # (n, keys)
        scores.view(kv_heads, -1, n, keys).masked_fill_(hidden, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    out, at = None, 0
    for part in parts:
        length = part.shape[2]
        term = torch.matmul(weights[..., at : at + length], part[1])
        out = term if out is None else out.add_(term)
        at += length
    assert out is not None
    return out.reshape(heads, n, dim)


def _causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Causal attention of a sequence's first tokens over their own keys; returns (batch, tokens,
    heads, dim). GQA goes to SDPA as it is (``enable_gqa``): keys and values are never repeated."""
    assert query.shape[2] == key.shape[2], "a chunk after a prefix is attended by _attend_parts"
    gqa = query.shape[1] != key.shape[1]
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)


def check_supported(config) -> None:
    """Refuse models whose attention this function would compute wrongly."""
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise ValueError("models with sliding-window attention are not supported by the serving engine yet")
    if getattr(config, "attn_logit_softcapping", None):
        raise ValueError(
            "models with attention logit soft-capping are not supported by the serving engine yet"
        )


AttentionInterface.register(ATTENTION_NAME, ragged_attention)
