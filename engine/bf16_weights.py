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
and the KV stay float32 (except that where these products are not
batch-invariant, AMX, prompts attend in bf16 and the MLP's activations stay
bf16 between its products: ``LoadedModel.bf16_attention``, ``bf16_mlp``).
The inputs of each projection are rounded to bf16 and its outputs come back as
float32 (oneDNN accumulates in float32). Measured
on the default model with ``benchmarks/step_bench.py`` in one run: a decode
step of 8 sequences 78 -> 54 ms, of 16 sequences 124 -> 73 ms, a 1,024-token
prefill 1.67 -> 0.81 s; one sequence is unchanged (40 -> 38 ms).

This changes the KV a model computes, so the precision is part of every key
(``LoadedModel.precision``, ``engine.identity``).

Batch invariance: with the engine's fixed-order attention
(``engine.tiled_attention``) a request gets the same bits alone or batched
only if each projection gives a row the same bits at every row count. That is
the CPU's kernel's property, not ours, so it is measured
(``sums_rows_alike``) rather than assumed:

- AVX512-BF16 kernels (AMD EPYC, or oneDNN held below AMX): the same bits at
  every row count but one. oneDNN sums a one-row product in another order, so
  a one-row input is doubled here and the first row kept.
- AMX (Intel Xeon): a product of more than 32 rows sums some rows in another
  order than one of fewer (2-8% of the rows of a 33-512-row product of the
  default model's projections differ in their last bit), with or without
  prepacked weights, on one thread or two. Holding oneDNN to AVX512-BF16
  there makes it invariant but slower than float32 (1,024-token prefill 2.30
  against 1.56 s, one sequence's decode step 51 against 32 ms).

``CACHEGEN_DTYPE=auto`` takes bf16 weights only where the probe finds them
invariant (``engine.loading``); asked for explicitly, they run anywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

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
        # a copy of ``weight`` in oneDNN's blocked layout, which the products then run on (``pack``)
        self.packed: torch.Tensor | None = None

    def pack(self, rows: int) -> None:
        """Multiply from now on with a copy of the weight reordered once into oneDNN's blocked layout
        for ``rows`` rows (``engine.packed_linear``: the output projection). The weight stays."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed
        if packed is None:
            return bf16_product(x, lambda rows: F.linear(rows, self.weight, self.bias))
        bias = None if self.bias is None else self.bias.detach()
        return bf16_product(
            x, lambda rows: torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
        )

    def extra_repr(self) -> str:
        packed = ", packed=oneDNN" if self.packed is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, weight=bfloat16{packed}"


def bf16_product(
    x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor], out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``product`` (a bf16 matmul) of ``x`` rounded to bf16, returned in ``out_dtype`` (default:
    ``x``'s). oneDNN's one-row path sums in another order than its many-row one, so a one-row
    input is doubled and the first row of the two-row product kept: a row then gets the same
    bits at every row count where the kernels allow it (``sums_rows_alike``)."""
    out_dtype = out_dtype or x.dtype
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 1:
        doubled = rows.to(torch.bfloat16).expand(2, -1)
        return product(doubled)[:1].to(out_dtype).reshape(*x.shape[:-1], -1)
    return product(x.to(torch.bfloat16)).to(out_dtype)


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


# Row counts the probe compares against one product of PROBE_REFERENCE_ROWS rows: one row (the
# doubled path), a few decodes, and the 33-128 rows where AMX's kernels change their sums
PROBE_ROWS = (1, 2, 3, 8, 17, 33, 77)
PROBE_REFERENCE_ROWS = 128


def sums_rows_alike(product: Callable[[torch.Tensor], torch.Tensor], in_features: int, seed: int = 0) -> bool:
    """True if ``product`` gives each row of a random input the same bits whatever the row count.

    ``product`` maps (rows, in_features) float32 to (rows, out); every row of each
    ``PROBE_ROWS`` product is compared with the same row of one ``PROBE_REFERENCE_ROWS`` product.
    On AMX, the default model's MLP and output projections fail it."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(PROBE_REFERENCE_ROWS, in_features, generator=generator)
    reference = product(x)
    return all(torch.equal(product(x[:rows]), reference[:rows]) for rows in PROBE_ROWS)


@cache
def bf16_rows_invariant(shapes: frozenset[tuple[int, int]]) -> bool:
    """True if ``Bf16WeightLinear`` gives a row the same bits at every row count for each (out,
    in) shape, on this CPU (random weights; 0.05-0.6 s for the default model's shapes)."""
    generator = torch.Generator().manual_seed(0)
    for out_features, in_features in sorted(shapes):
        linear = nn.Linear(in_features, out_features, bias=False)
        distinct = torch.randn(min(out_features, 1024), in_features, generator=generator)  # randn of
        with torch.no_grad():  # a vocabulary's rows would take most of the probe's time
            linear.weight.copy_(distinct.repeat(-(-out_features // len(distinct)), 1)[:out_features])
        layer = Bf16WeightLinear(linear)
        with torch.inference_mode():
            if not sums_rows_alike(layer, in_features):
                return False
    return True


def linear_shapes(model: nn.Module) -> frozenset[tuple[int, int]]:
    """The (out, in) shapes of ``model``'s ``nn.Linear`` layers."""
    return frozenset((m.out_features, m.in_features) for m in model.modules() if type(m) is nn.Linear)


def bf16_weights_invariant(model: nn.Module) -> bool:
    """True where this CPU has native bf16 and bf16 weights would keep ``model`` batch-invariant."""
    return native_bf16() and bf16_rows_invariant(linear_shapes(model))
