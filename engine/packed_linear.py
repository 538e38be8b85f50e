"""The output projection with its weight laid out once for oneDNN's matmul, as vLLM's CPU backend does.

A float32 matmul of a few rows through MKL (``F.linear``) is slow for the
vocabulary projection (49,152 x 576 on the default model): on the 2-core
development machine 17 ms at 8 rows against 4.5 ms at one. oneDNN, with the
weight reordered once into its blocked layout, takes 6.2 ms at 8 rows and the
same 4.5 ms at one. A whole decode step of 8 sequences went from 77.5 to
68.9 ms (``python -m benchmarks.step_bench --batch 1,2,4,8,16,32 --dtypes
float32 --prefill 0``, ``plain head`` against ``batched``, one process;
``benchmarks/results/step_packed_head_2cpu.json``).

This module packs the output projection in place, on the model itself. The
decoder's projections are packed too, fused, by the engine's own forward
(``engine.fused_layers``), which leaves the model's modules as they are.

The packed copy is extra memory (113 MB on the default model): the weight
itself stays, because the embedding shares it and the model's weights digest
(``engine.identity``) reads it. So the copy is made only on a CPU, in float32,
for a plain ``nn.Linear``; it is a snapshot, made after the weights are final.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.bf16_weights import Bf16WeightLinear, native_bf16, sums_rows_alike

log = logging.getLogger(__name__)

# oneDNN picks its blocked layout for this many rows; a decode step's batch
PACK_FOR_ROWS = 8


class PackedLinear(nn.Module):
    """``nn.Linear`` whose product runs on a oneDNN-packed copy of its weight (CPU, float32)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same parameter: ties and the weights digest see no change
        self.bias = linear.bias
        self._packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_FOR_ROWS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def pack_output_projection(model: nn.Module, batch_invariant: bool = False) -> bool:
    """Pack ``model``'s output projection where that applies; True if it is packed.

    A float32 ``nn.Linear`` is replaced by a ``PackedLinear``. A bf16 one (``Bf16WeightLinear``)
    packs its own bf16 weight (``_pack_bf16``); where the model is ``batch_invariant``, only if
    the packed product keeps that."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, PackedLinear) or getattr(head, "packed", None) is not None:  # a second runner
        return True
    if isinstance(head, Bf16WeightLinear):
        return _pack_bf16(head, batch_invariant)
    weight = getattr(head, "weight", None)
    if type(head) is not nn.Linear or weight is None:
        return False
    if (
        weight.device.type != "cpu"
        or weight.dtype != torch.float32
        or not torch.backends.mkldnn.is_available()
    ):
        return False
    try:
        packed = PackedLinear(head)
    except (RuntimeError, AttributeError) as exc:  # a torch built without these oneDNN ops
        log.warning("output projection left unpacked: %s", exc)
        return False
    model.set_output_embeddings(packed)
    return True


def _pack_bf16(head: Bf16WeightLinear, batch_invariant: bool) -> bool:
    """``head.pack`` on a CPU with native bf16: on an AMD EPYC (Zen 4, 2 cores) the vocabulary
    projection took 2.1 ms at 2 rows and 3.3 ms at 16 packed, against 3.7 and 5.7 ms through
    ``F.linear`` (the same bits). A batch-invariant model keeps it only if a row still gets the
    same bits at every row count (``sums_rows_alike``, on the real weight: about
    0.2 s)."""
    if head.weight.device.type != "cpu" or not native_bf16():
        return False
    try:
        head.pack(PACK_FOR_ROWS)
        with torch.inference_mode():
            if batch_invariant and not sums_rows_alike(head, head.in_features):
                head.packed = None
                log.info("bf16 output projection left unpacked: its packed product is not row-invariant")
                return False
    except (RuntimeError, AttributeError) as exc:  # a torch built without these oneDNN ops
        head.packed = None
        log.warning("bf16 output projection left unpacked: %s", exc)
        return False
    return True
