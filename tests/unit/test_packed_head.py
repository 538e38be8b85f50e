"""The bf16 output projection packed for oneDNN (``engine.packed_linear._pack_bf16``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import packed_linear
from engine.bf16_weights import Bf16WeightLinear, native_bf16


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = Bf16WeightLinear(nn.Linear(64, 300, bias=False))

    def get_output_embeddings(self) -> nn.Module:
        return self.head


needs_bf16 = pytest.mark.skipif(
    not native_bf16(), reason="no native bf16 on this CPU: the head stays unpacked"
)


@needs_bf16
def test_a_bf16_head_is_packed_and_gives_what_it_gave_unpacked():
    model = _Model()
    x = torch.randn(5, 64)
    with torch.inference_mode():
        want = [model.head(x[:rows]) for rows in (1, 2, 5)]
    assert packed_linear.pack_output_projection(model) and model.head.packed is not None
    with torch.inference_mode():
        got = [model.head(x[:rows]) for rows in (1, 2, 5)]
    for a, b in zip(got, want):
        assert a.dtype == torch.float32 and torch.allclose(a, b, atol=1e-4)
    assert packed_linear.pack_output_projection(model)  # a second runner over the same model


@needs_bf16
def test_a_batch_invariant_model_keeps_its_head_unpacked_where_packing_would_break_that(monkeypatch):
    model = _Model()
    monkeypatch.setattr(packed_linear, "sums_rows_alike", lambda product, in_features: False)
    assert packed_linear.pack_output_projection(model, batch_invariant=False)  # not asked to keep it
    model.head.packed = None
    assert not packed_linear.pack_output_projection(model, batch_invariant=True)
    assert model.head.packed is None


def test_without_native_bf16_the_head_stays_as_it_was(monkeypatch):
    monkeypatch.setattr(packed_linear, "native_bf16", lambda: False)
    model = _Model()
    assert not packed_linear.pack_output_projection(model) and model.head.packed is None
