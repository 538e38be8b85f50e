"""The engine's fused Llama forward (``engine.fused_layers``) against transformers' own.

The fused forward must compute what transformers' forward computes through
the same attention, leave the model and its weights' digest as they were,
apply only where it is built for, and keep the quality tools' query
statistics the same.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from engine import ModelRunner, fused_layers, load_model
from engine.bf16_weights import Bf16WeightLinear, native_bf16, use_bf16_weights
from engine.fused_layers import FusedLlama, PackedWeight, fuse_llama
from engine.identity import parameters_digest
from engine.ragged import Segment

pytestmark = pytest.mark.slow

TEXT = "Paged memory, prefix caches and batched attention are what a serving engine is built on. " * 12


@pytest.fixture(scope="module")
def runner(model_dir) -> ModelRunner:
    return ModelRunner(load_model(str(model_dir), dtype="float32"))


@pytest.fixture(scope="module")
def ids(runner) -> list[int]:
    return list(runner.tokenizer(TEXT)["input_ids"])


def mixed_step(runner: ModelRunner, ids: list[int]):
    """A step of a 97-token prefill after 40 cached tokens, a 5-token first chunk and three decodes;
    returns every segment's logits. Run twice, the second time from the same buffers' state."""
    lengths = [21, 64, 130]
    decodes = [runner.new_kv(n + 1) for n in lengths]
    for kv, n in zip(decodes, lengths):
        runner.forward_ragged([Segment(kv, 0, ids[:n], "none")])
    later = runner.new_kv(137)
    runner.forward_ragged([Segment(later, 0, ids[:40], "none")])
    first = runner.new_kv(5)

    def step():
        segments = [Segment(later, 40, ids[40:137], "all"), Segment(first, 0, ids[:5], "all")]
        segments += [Segment(kv, n, [ids[n]], decode=True) for kv, n in zip(decodes, lengths)]
        return runner.forward_ragged(segments)

    return step


def test_the_default_model_runs_the_fused_forward_and_keeps_its_weights(model_dir, runner):
    assert runner.fused is not None and len(runner.fused.layers) == runner.num_layers
    model = runner.model
    attention = model.model.layers[0].self_attn
    assert type(attention.q_proj) is torch.nn.Linear  # the model's own modules are left alone
    plain = load_model(str(model_dir), dtype="float32").model  # never fused
    assert parameters_digest(model.named_parameters()) == parameters_digest(plain.named_parameters())
    layer = runner.fused.layers[0]
    assert layer.qkv.out_features == sum(getattr(attention, f"{n}_proj").out_features for n in "qkv")


def test_fused_logits_match_transformers_forward_in_a_mixed_step(runner, ids):
    step = mixed_step(runner, ids)
    with runner.transformers_forward():
        assert runner.fused is None
        want = step()
    got = step()  # the same positions again: every buffer's new KV is overwritten alike
    assert len(got) == len(want) == 5
    for g, w in zip(got, want):
        assert g is not None and w is not None and g.shape == w.shape
        assert torch.allclose(g, w, atol=1e-3), (g - w).abs().max()
        assert torch.equal(g.argmax(-1), w.argmax(-1))


def test_greedy_decoding_is_the_same_on_both_forwards(runner, ids):
    from engine.sampling import SamplingParams

    params = SamplingParams(temperature=0.0)

    def greedy() -> list[int]:
        state = runner.prefill(ids[:150], room=24)
        return [token for token, _ in runner.decode(state, params, 24)]

    with runner.transformers_forward():
        want = greedy()
    assert greedy() == want


def test_the_query_statistics_are_the_same_on_both_forwards(runner, ids):
    from engine.quality import query_channel_rms

    got = query_channel_rms(runner, ids[:120])
    with runner.transformers_forward():
        want = query_channel_rms(runner, ids[:120])
    assert got.shape == (runner.num_layers, runner.num_kv_heads, runner.head_dim)
    assert abs(got - want).max() <= 1e-4 * abs(want).max()


def test_a_serving_runner_gives_the_plain_weights_back_and_still_answers_the_same(model_dir, ids):
    serving = ModelRunner(load_model(str(model_dir), dtype="float32"))
    model = serving.model
    projections = [m for layer in model.model.layers for m in layer.modules() if type(m) is torch.nn.Linear]
    assert len(projections) == 7 * serving.num_layers
    expected = sum(m.weight.numel() * 4 for m in projections)
    want = serving.forward_ragged([Segment(serving.new_kv(40), 0, ids[:40], "all")])[0]

    assert serving.release_transformers_weights() == expected
    assert all(m.weight.device.type == "meta" for m in projections)
    got = serving.forward_ragged([Segment(serving.new_kv(40), 0, ids[:40], "all")])[0]
    assert got is not None and torch.equal(got, want)  # the fused forward never read them
    with pytest.raises(RuntimeError, match="released"), serving.transformers_forward():
        pass
    with pytest.raises(NotImplementedError):  # no digest of weights that are not there
        parameters_digest(model.named_parameters())
    assert serving.release_transformers_weights() == 0  # and nothing twice


def test_a_bf16_serving_runner_gives_back_its_packed_output_projections_weight_too(model_dir, ids):
    serving = ModelRunner(load_model(str(model_dir), dtype="bf16-weights"))
    head = serving.model.get_output_embeddings()
    if serving.fused is None or head.packed is None:
        pytest.skip("no fused forward or no packed bf16 output projection on this CPU")
    projections = [
        m for layer in serving.model.model.layers for m in layer.modules() if isinstance(m, Bf16WeightLinear)
    ]
    expected = sum(m.weight.numel() * 2 for m in (*projections, head))
    want = serving.forward_ragged([Segment(serving.new_kv(40), 0, ids[:40], "all")])[0]

    assert serving.release_transformers_weights() == expected
    assert head.weight.device.type == "meta" and head.packed is not None
    got = serving.forward_ragged([Segment(serving.new_kv(40), 0, ids[:40], "all")])[0]
    assert got is not None and torch.equal(got, want)


def test_the_fused_forward_is_left_out_where_it_does_not_apply():
    gelu = LlamaForCausalLM(_tiny_config(hidden_act="gelu"))
    assert fuse_llama(gelu) is None
    assert fuse_llama(LlamaForCausalLM(_tiny_config())) is not None


@pytest.mark.skipif(
    not native_bf16(), reason="no native bf16 on this CPU: bf16 weights keep transformers' forward"
)
def test_bf16_weights_run_the_fused_forward_and_answer_as_transformers_forward_does(model_dir, ids):
    """bf16 weights over float32 activations, fused and packed: the same logits as transformers'
    forward over the model's ``Bf16WeightLinear`` layers where the CPU's bf16 products sum rows
    alike (AVX512-BF16: the same bits in practice), within bf16's rounding elsewhere (AMX)."""
    loaded = load_model(str(model_dir), dtype="bf16-weights")
    runner = ModelRunner(loaded)
    if loaded.batch_invariant and runner.fused is None:
        pytest.skip("this CPU's packed bf16 products are not row-invariant: transformers' forward kept")
    assert runner.fused is not None
    assert all(
        p.bf16 for layer in runner.fused.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)
    )

    def logits() -> torch.Tensor:
        out = runner.forward_ragged([Segment(runner.new_kv(200), 0, ids[:200], "all")])[0]
        assert out is not None
        return out

    got = logits()
    with runner.transformers_forward():
        want = logits()
    agreement = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    if loaded.batch_invariant:
        assert torch.allclose(got, want, atol=1e-3), (got - want).abs().max()
    assert agreement > 0.95, agreement


@pytest.mark.skipif(not native_bf16(), reason="no native bf16 on this CPU")
def test_a_batch_invariant_model_keeps_transformers_forward_where_the_packed_products_are_not(monkeypatch):
    model = LlamaForCausalLM(_tiny_config()).eval()
    use_bf16_weights(model)
    assert isinstance(model.model.layers[0].mlp.up_proj, Bf16WeightLinear)
    assert fuse_llama(model) is not None  # not asked to stay invariant: no probe
    monkeypatch.setattr(fused_layers, "sums_rows_alike", lambda product, in_features: False)
    assert fuse_llama(model, batch_invariant=True) is None
    assert fuse_llama(model, batch_invariant=False) is not None


def test_bf16_weights_on_a_cpu_without_native_bf16_keep_transformers_forward(monkeypatch):
    model = LlamaForCausalLM(_tiny_config()).eval()
    use_bf16_weights(model)
    monkeypatch.setattr(fused_layers, "native_bf16", lambda: False)
    assert fuse_llama(model) is None


@pytest.mark.parametrize("bias", [False, True])
def test_a_tiny_llama_with_and_without_biases_matches_transformers(bias):
    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny_config(attention_bias=bias, mlp_bias=bias)).eval()
    if bias:  # random biases, so that a bias left out would show
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.data.normal_()
    model.set_attn_implementation("sdpa")
    fused = FusedLlama(model)
    tokens = torch.randint(0, model.config.vocab_size, (1, 23))
    positions = torch.arange(23)[None]
    with torch.inference_mode():
        want = model(input_ids=tokens, use_cache=False).logits[0]
        got = fused.logits(tokens, positions, torch.arange(23), sdpa_attention_forward)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("bf16", [False, True])
def test_a_packed_weight_multiplies_as_its_linears_side_by_side(bf16):
    if bf16 and not native_bf16():
        pytest.skip("no native bf16 on this CPU")
    torch.manual_seed(1)
    a, b = torch.nn.Linear(16, 8), torch.nn.Linear(16, 24, bias=False)
    if bf16:
        a, b = Bf16WeightLinear(a), Bf16WeightLinear(b)
    packed = PackedWeight(a, b)
    assert (packed.out_features, packed.in_features, packed.bf16) == (32, 16, bf16)
    for rows in (1, 3, 8, 40):
        x = torch.randn(rows, 16)
        with torch.inference_mode():
            want = torch.cat([a(x), b(x)], dim=-1)
            got = packed(x)
            assert got.dtype == torch.float32  # bf16 weights over float32 activations, as Bf16WeightLinear
            # bf16: the same rounded inputs, summed in float32 (in another order at most)
            assert torch.allclose(got, want, atol=1e-4 if bf16 else 1e-5), (got - want).abs().max()


def _tiny_config(**overrides) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **overrides,
    )
