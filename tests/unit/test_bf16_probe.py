"""The probe behind ``CACHEGEN_DTYPE=auto``: does a product give a row the same bits at every row count?"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.bf16_weights import (
    PROBE_REFERENCE_ROWS,
    Bf16WeightLinear,
    bf16_rows_invariant,
    linear_shapes,
    native_bf16,
    sums_rows_alike,
)

IN, OUT = 576, 192


@pytest.fixture(scope="module")
def weight() -> torch.Tensor:
    return torch.randn(IN, OUT, generator=torch.Generator().manual_seed(3))


def test_a_row_wise_product_sums_rows_alike(weight):
    # one matmul per row: no row can see how many others there are
    assert sums_rows_alike(lambda x: torch.cat([row[None] @ weight for row in x]), IN)


def test_a_product_that_splits_its_sums_by_row_count_is_caught(weight):
    """What AMX does: past 32 rows the sum over the inner dimension is cut in two and the halves
    added, so a row's last bits depend on how many rows came with it."""

    def blocked(x: torch.Tensor) -> torch.Tensor:
        if len(x) <= 32:
            return x @ weight
        half = IN // 2
        return x[:, :half] @ weight[:half] + x[:, half:] @ weight[half:]

    assert not sums_rows_alike(blocked, IN)


def test_a_product_that_only_the_reference_differs_in_is_caught(weight):
    # the probe's reference size must be checked too: a kernel may change only for many rows
    def big_differs(x: torch.Tensor) -> torch.Tensor:
        out = x @ weight
        return out + 1e-3 if len(x) == PROBE_REFERENCE_ROWS else out

    assert not sums_rows_alike(big_differs, IN)


def test_the_shapes_are_the_models_plain_linear_layers():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Linear(8, 16))
    model.append(Bf16WeightLinear(nn.Linear(4, 4)))  # already replaced: not probed again
    assert linear_shapes(model) == {(16, 8), (8, 16)}


@pytest.mark.skipif(not native_bf16(), reason="no native bf16 on this CPU")
def test_the_verdict_is_what_the_bf16_layer_does_on_this_cpu():
    """The probe's verdict for one shape, checked against the layer itself on another input: on
    this CPU's kernel, every row count from 1 to 128 against one product of 128 rows."""
    shape = (1536, 576)  # the default model's MLP projection: the one AMX changes most
    linear = nn.Linear(shape[1], shape[0], bias=False)
    layer = Bf16WeightLinear(linear)
    x = torch.randn(128, shape[1], generator=torch.Generator().manual_seed(11))
    with torch.inference_mode():
        reference = layer(x)
        alike = all(torch.equal(layer(x[:n]), reference[:n]) for n in range(1, 129))
    assert bf16_rows_invariant(frozenset({shape})) == alike
