"""Linear layers with bfloat16 weights over float32 activations: the CPU's native bf16 matmul.

On a CPU with AMX or AVX512-BF16 (``torch.ops.mkldnn._is_mkldnn_bf16_supported``),
a bf16 matmul of a few rows costs what one row does, where an fp32 one grows
with the rows: on the 2-core development machine a (1536 x 576) projection
takes 94 us at 8 rows in bf16 against 144-197 us in fp32, and the vocabulary
projection 4.4 ms against 16-19 ms. Running the whole model in bf16 is slower
there instead (1 sequence: 85 against 55 ms a step), because the norms,
rotary embeddings and attention then run in bf16 too, which the CPU has no
fast path for.

So only the linear layers' weights are bf16; the activations, the attention
and the KV stay float32. The inputs of each projection are rounded to bf16
and its outputs come back as float32 (oneDNN accumulates in float32). Measured
on the default model with ``benchmarks/step_bench.py`` in one run: a decode
step of 8 sequences 78 -> 54 ms, of 16 sequences 124 -> 73 ms, a 1,024-token
prefill 1.67 -> 0.81 s; one sequence is unchanged (40 -> 38 ms).

This changes the KV a model computes, so the precision is part of every key
(``LoadedModel.precision``, ``engine.identity``). It is the default on a CPU
with native bf16 (``CACHEGEN_DTYPE=auto``). A row's product is the same bits
at any row count but one: oneDNN sums a one-row product in another order, so
a one-row input is doubled and the first row kept. With the engine's
batch-invariant attention (``engine.tiled_attention``) a request then gets the
same tokens alone or batched (docs/serving.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PRECISION_SUFFIX = "+bf16-weights"


def native_bf16() -> bool:
    """True where bf16 matmuls have a hardware path on the CPU (AMX or AVX512-BF16)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class Bf16WeightLinear(nn.Module):
    """``nn.Linear`` with its weight and bias in bf16; takes and returns its input's dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach().to(torch.bfloat16), requires_grad=False)
        bias = linear.bias
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] == 1:  # oneDNN's one-row path sums in another order: take a two-row product's first
            doubled = rows.to(torch.bfloat16).expand(2, -1)
            return F.linear(doubled, self.weight, self.bias)[:1].to(x.dtype).reshape(*x.shape[:-1], -1)
        return F.linear(x.to(torch.bfloat16), self.weight, self.bias).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight=bfloat16"


def use_bf16_weights(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` (the output projection included) in place.

    A tied output projection gets its own bf16 copy; the embedding stays as it
    was. Returns how many layers were replaced.
    """
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    for parent, name, child in targets:
        setattr(parent, name, Bf16WeightLinear(child))
    return len(targets)
