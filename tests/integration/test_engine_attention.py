"""The engine's forward path against stock transformers, on the real default model.

A ragged step mixes a long prefill, a short one and several decodes
(``engine.ragged``). Every sequence's logits must match a plain transformers
SDPA forward of that sequence alone, and with bf16 weights be the same bits
alone as in any step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import ModelRunner, decode_attention, fused_layers, load_model, ragged
from engine.bf16_weights import (
    Bf16WeightLinear,
    bf16_rows_invariant,
    linear_shapes,
    native_bf16,
    use_bf16_weights,
)
from engine.identity import parameters_digest
from engine.packed_linear import PackedLinear
from engine.ragged import Segment
from engine.tiled_attention import TiledPrefill

pytestmark = pytest.mark.slow

TEXT = "The history of the Python language begins in the late 1980s at CWI in the Netherlands. " * 30


@pytest.fixture(scope="module")
def runner(model_dir) -> ModelRunner:
    return ModelRunner(load_model(str(model_dir), dtype="float32"))


@pytest.fixture(scope="module")
def ids(runner) -> list[int]:
    return list(runner.tokenizer(TEXT)["input_ids"])


def stock_last_logits(runner: ModelRunner, token_ids: list[int]) -> torch.Tensor:
    """One SDPA forward of the whole sequence, without the engine's attention."""
    model = runner.model
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([token_ids]), use_cache=False, logits_to_keep=1)
    finally:
        model.set_attn_implementation(ragged.ATTENTION_NAME)
    return out.logits[0, -1].float()


def mixed_step(runner: ModelRunner, ids: list[int]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """A step of two prefills (301 and 7 tokens) and three decodes (after 20, 50 and 133 tokens);
    returns each sequence's tokens and the step's last-token logits."""
    decode_lengths = [50, 133, 20]
    buffers = [runner.new_kv(n + 1) for n in decode_lengths]
    for kv, n in zip(buffers, decode_lengths):
        runner.forward_ragged([Segment(kv, 0, ids[:n], "none")])
    decodes = [(kv, n, ids[n + 7]) for kv, n in zip(buffers, decode_lengths)]  # a token that is not ids[n]
    segments = [
        Segment(runner.new_kv(301), 0, ids[:301]),
        *(Segment(kv, n, [token], decode=True) for kv, n, token in decodes),
        Segment(runner.new_kv(7), 0, ids[40:47]),
    ]
    sequences = [ids[:301], *(ids[:n] + [token] for _, n, token in decodes), ids[40:47]]
    return sequences, runner.forward_ragged(segments)


def count_decode_batches(monkeypatch) -> list[int]:
    """How many decodes each call that attends decodes together (``DecodeTable.attend``, the
    compiled kernel, or ``_DecodeBatch.attend``, a padded batch) attended."""
    calls: list[int] = []
    for cls, size in (
        (decode_attention.DecodeTable, lambda t: len(t.rows)),
        (ragged._DecodeBatch, lambda b: len(b.segments)),
    ):
        attend = cls.attend
        monkeypatch.setattr(
            cls,
            "attend",
            lambda self, *a, attend=attend, size=size: calls.append(size(self)) or attend(self, *a),
        )
    return calls


def test_a_mixed_step_matches_stock_transformers(runner, ids, monkeypatch):
    together = count_decode_batches(monkeypatch)
    sequences, logits = mixed_step(runner, ids)
    assert together == [3] * runner.num_layers, "float32: the step's 3 decodes are attended in one call"
    for tokens, got in zip(sequences, logits):
        want = stock_last_logits(runner, tokens)
        assert got is not None
        assert torch.allclose(got, want, atol=2e-3), f"{len(tokens)} tokens: {(got - want).abs().max()}"
        assert int(got.argmax()) == int(want.argmax())


def test_prompts_in_fixed_tiles_match_stock_transformers(runner, ids, monkeypatch):
    """The batch-invariant path (``LoadedModel.batch_invariant``: prompt chunks in fixed tiles), run
    here on float32 weights, so that every CPU tests it: a mixed step, and a prompt in two chunks."""
    tiled = ModelRunner(dataclasses.replace(runner.loaded, batch_invariant=True))
    calls = []
    attend = TiledPrefill.attend
    monkeypatch.setattr(TiledPrefill, "attend", lambda self, *a: calls.append(1) or attend(self, *a))
    together = count_decode_batches(monkeypatch)
    sequences, logits = mixed_step(tiled, ids)
    # the kernel attends each decode by itself: a batch-invariant model's decodes share its call
    assert together == [3] * runner.num_layers, "the step's 3 decodes are attended in one call"
    kv = tiled.new_kv(301)
    tiled.forward_ragged([Segment(kv, 0, ids[:77], "none")])
    sequences.append(ids[:301])
    logits += tiled.forward_ragged([Segment(kv, 77, ids[77:301])])
    assert len(calls) == 7 * runner.num_layers  # mixed_step: 3 prompts, then 2 in its step; then 2 chunks
    for tokens, got in zip(sequences, logits):
        want = stock_last_logits(runner, tokens)
        assert got is not None
        assert torch.allclose(got, want, atol=2e-3), f"{len(tokens)} tokens: {(got - want).abs().max()}"


def test_buffers_from_the_kv_pool_serve_the_same_and_fall_back_when_it_is_full(runner, ids):
    pool = runner.use_kv_pool(runner.kv_bytes(600), prefault=False)
    assert pool is not None
    try:
        sequences, logits = mixed_step(runner, ids)  # 51, 134, 21, 301 and 7 tokens: 35 of 38 blocks
        assert pool.misses == 0
        assert pool.used_bytes == 0, "the step's buffers are gone, and their blocks with them"
        assert runner.kv_bytes(7) == runner.kv_bytes(16) == 16 * runner.kv_bytes_per_token
        for tokens, got in zip(sequences, logits):
            want = stock_last_logits(runner, tokens)
            assert got is not None and torch.allclose(got, want, atol=2e-3)
        held = runner.new_kv(400)
        assert pool.used_bytes == runner.kv_bytes(400)
        outside = runner.new_kv(400)  # 25 blocks, 13 left
        assert pool.misses == 1 and outside.shape == held.shape
    finally:
        runner.kv_pool = None


@pytest.fixture(scope="module")
def bf16_runner(model_dir) -> ModelRunner:
    return ModelRunner(load_model(str(model_dir), dtype="bf16-weights"))


def test_with_bf16_weights_a_sequence_gets_the_same_bits_alone_as_in_any_step(
    bf16_runner, ids, bf16_invariant, monkeypatch
):
    """Batch invariance: a prompt prefilled in one pass and decoded alone, against the same prompt
    cut into other chunks beside other prefills and decoded beside other decodes. bf16 weights round
    every projection's input, so any difference in the sums would show here, grown over 30 layers.
    The decodes go to the kernel: alone on one thread, batched split over the OpenMP team."""
    if not bf16_invariant:
        pytest.skip("this CPU's bf16 products sum rows by the row count (AMX): auto is float32 here")
    runner = bf16_runner
    together = count_decode_batches(monkeypatch)
    prompt, follow = ids[:300], ids[300:304]
    kv = runner.new_kv(310)
    alone = runner.forward_ragged([Segment(kv, 0, prompt)])
    for i, token in enumerate(follow):
        alone += runner.forward_ragged([Segment(kv, 300 + i, [token], decode=True)])

    kv = runner.new_kv(310)
    others = [runner.new_kv(200) for _ in range(3)]
    runner.forward_ragged(
        [
            Segment(others[0], 0, ids[310:460], "none"),
            Segment(kv, 0, prompt[:77], "none"),
            Segment(others[1], 0, ids[20:40], "none"),
        ]
    )
    step = [
        Segment(others[1], 20, [5], decode=True),
        Segment(kv, 77, prompt[77:]),
        Segment(others[2], 0, ids[50:80]),
    ]
    batched = [runner.forward_ragged(step)[1]]
    monkeypatch.setattr(decode_attention, "PARALLEL_MIN_KEYS", 0)  # any step's decodes on every thread
    for i, token in enumerate(follow):
        step = [
            Segment(others[0], 150 + i, [6], decode=True),
            Segment(kv, 300 + i, [token], decode=True),
            Segment(others[2], 30 + i, [7], decode=True),
        ]
        batched.append(runner.forward_ragged(step)[1])
    layers = runner.num_layers
    assert together == [1] * len(follow) * layers + [1] * layers + [3] * len(follow) * layers
    for position, (a, b) in enumerate(zip(alone, batched)):
        assert a is not None and b is not None
        assert torch.equal(a, b), f"logits {position}: {(a - b).abs().max()}"


def test_sequences_that_read_shared_kv_match_stock_transformers_and_never_write_it(runner, ids):
    """Sequences whose first tokens are another buffer's (the prefix cache's shared hits): prefill
    chunks and decodes, over one or two shared parts."""
    base = runner.new_kv(301)
    runner.forward_ragged([Segment(base, 0, ids[:300], "none")])  # the "cached" run: 300 tokens
    middle = runner.new_kv(40)  # a run built on its first 160 tokens
    runner.forward_ragged([Segment(middle, 160, ids[160:192], "none", (base[:, :, :, :160],))])
    frozen = base[:, :, :, :300].clone()

    def step() -> tuple[list[list[int]], list[torch.Tensor]]:
        one = (base[:, :, :, :288],)
        two = (base[:, :, :, :160], middle[:, :, :, :32])
        decode_kv = runner.new_kv(8)
        runner.forward_ragged([Segment(decode_kv, 288, ids[288:291], "none", one)])
        segments = [
            Segment(runner.new_kv(20), 288, ids[288:299], "last", one),  # the rest of the prompt
            Segment(runner.new_kv(20), 192, ids[400:405], "last", two),  # another question
            Segment(decode_kv, 291, [ids[500]], "last", one, decode=True),  # a decode after 291 tokens
            Segment(runner.new_kv(4), 192, [ids[501]], "last", two),  # a one-token prompt chunk
        ]
        sequences = [
            ids[:299],
            ids[:192] + ids[400:405],
            ids[:291] + [ids[500]],
            ids[:192] + [ids[501]],
        ]
        return sequences, runner.forward_ragged(segments)

    sequences, logits = step()
    for tokens, got in zip(sequences, logits):
        want = stock_last_logits(runner, tokens)
        assert torch.allclose(got, want, atol=2e-3), f"{len(tokens)} tokens: {(got - want).abs().max()}"
        assert int(got.argmax()) == int(want.argmax())
    assert torch.equal(base[:, :, :, :300], frozen)  # the shared tokens are only read


def stock_logits_and_greedy(runner: ModelRunner, token_ids: list[int], new_tokens: int):
    """Stock transformers, SDPA and its own cache: every prompt position's logits, and the greedy
    continuation."""
    model = runner.model
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([token_ids]), use_cache=False).logits[0].float()
            out = model.generate(
                torch.tensor([token_ids]),
                max_new_tokens=new_tokens,
                do_sample=False,
                min_new_tokens=new_tokens,
            )
    finally:
        model.set_attn_implementation(ragged.ATTENTION_NAME)
    return logits, out[0, len(token_ids) :].tolist()


def test_prefill_and_decode_run_the_serving_path_and_match_stock_transformers(runner, ids, monkeypatch):
    """What the cost profile, calibration and the quality tools run: passes of at most
    PREFILL_PASS_TOKENS through forward_ragged, also on top of a prefix and with every
    position's logits, then greedy decoding in the same buffer."""
    from engine import runner as runner_module
    from engine.sampling import SamplingParams

    calls: list[int] = []
    forward = ModelRunner.forward_ragged

    def counting(self, segments):
        calls.append(sum(len(s.token_ids) for s in segments))
        return forward(self, segments)

    monkeypatch.setattr(ModelRunner, "forward_ragged", counting)
    monkeypatch.setattr(runner_module, "PREFILL_PASS_TOKENS", 128)
    prompt = ids[:300]  # 3 passes of at most 128, and not a multiple of a block
    want, greedy = stock_logits_and_greedy(runner, prompt, 6)

    whole = runner.prefill(prompt)
    assert calls == [128, 128, 44] and whole.length == 300 and whole.kv.shape[3] == 300
    assert torch.allclose(whole.last_logits, want[-1], atol=2e-3)

    on_prefix = runner.prefill(prompt[100:], whole.kv, prefix_tokens=100, want_prompt_logits=True)
    assert on_prefix.kv is whole.kv  # the buffer had room: written in place
    assert on_prefix.prompt_logits is not None and on_prefix.prompt_logits.shape[0] == 200
    assert torch.allclose(on_prefix.prompt_logits, want[100:], atol=2e-3)

    calls.clear()
    state = runner.prefill(prompt, room=2)  # room for 2 of the 5 decode steps: then it grows
    tokens = [t for t, _ in runner.decode(state, SamplingParams(temperature=0.0, ignore_eos=True), 6)]
    assert tokens == greedy
    assert calls == [128, 128, 44] + [1] * 5 and state.length == 305
    assert torch.allclose(
        state.prefix[:, :, :, :300], whole.prefix, atol=1e-4
    )  # whole.kv was rewritten from 100 on


def test_bf16_weights_replace_every_linear_and_keep_the_answers(model_dir, runner, ids):
    loaded = load_model(str(model_dir), dtype="bf16-weights")
    assert loaded.bf16_weights and loaded.dtype == torch.float32
    # prompts attend in bf16 too where the bf16 products are not batch-invariant anyway (AMX),
    # and the precision, which every key holds, says so
    assert loaded.bf16_attention == (native_bf16() and not loaded.batch_invariant)
    assert loaded.bf16_mlp == loaded.bf16_attention  # the same CPUs keep the MLP's activations bf16
    assert loaded.precision == "torch.float32+bf16-weights" + (
        "+bf16-attention+bf16-mlp" if loaded.bf16_attention else ""
    )
    linears = [m for m in loaded.model.modules() if isinstance(m, torch.nn.Linear)]
    replaced = [m for m in loaded.model.modules() if isinstance(m, Bf16WeightLinear)]
    assert not linears and len(replaced) == 7 * runner.num_layers + 1  # and the output projection
    assert all(m.weight.dtype == torch.bfloat16 for m in replaced)
    assert loaded.model.model.embed_tokens.weight.dtype == torch.float32

    mixed = ModelRunner(loaded)
    head = loaded.model.get_output_embeddings()
    # its bf16 output projection multiplies on a oneDNN-packed copy of its own weight, where the
    # CPU has native bf16 (and, batch-invariant, only if the packed product keeps that)
    assert isinstance(head, Bf16WeightLinear) and mixed.packed_output == (head.packed is not None)
    if native_bf16():
        assert mixed.packed_output or not loaded.batch_invariant
    kv = mixed.new_kv(len(ids))
    got = mixed.forward_ragged([Segment(kv, 0, ids, "all")])[0]
    if head.packed is not None:
        packed, head.packed = head.packed, None
        try:
            unpacked = mixed.forward_ragged([Segment(mixed.new_kv(len(ids)), 0, ids, "all")])[0]
        finally:
            head.packed = packed
        assert got is not None and unpacked is not None and torch.allclose(got, unpacked, atol=1e-3)
    assert kv.dtype == torch.float32
    want = runner.forward_ragged([Segment(runner.new_kv(len(ids)), 0, ids, "all")])[0]
    agreement = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agreement > 0.95, agreement  # bf16 rounding of the weights flips only near-ties
    assert not torch.allclose(got, want, atol=1e-4)  # and the weights really are bf16


def test_auto_takes_bf16_weights_where_they_are_fast_and_batch_invariant(model_dir, runner):
    invariant = native_bf16() and bf16_rows_invariant(linear_shapes(runner.model))
    assert load_model(str(model_dir)).bf16_weights == invariant
    assert not load_model(str(model_dir), dtype="float32").bf16_weights


def test_use_bf16_weights_counts_what_it_replaced():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2, bias=False))
    x = torch.randn(3, 4)
    want = model(x)
    assert use_bf16_weights(model) == 2
    got = model(x)
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=5e-2)


def test_the_output_projection_is_packed_without_changing_the_weights_or_their_digest(model_dir, runner, ids):
    model = runner.model
    head = model.get_output_embeddings()
    assert runner.packed_output and isinstance(head, PackedLinear)
    assert head.weight is model.get_input_embeddings().weight  # still tied: no second plain copy

    rows = torch.randn(8, head.in_features)
    assert torch.allclose(head(rows), torch.nn.functional.linear(rows, head.weight), atol=1e-4)

    plain = load_model(str(model_dir), dtype="float32").model  # never packed
    assert type(plain.get_output_embeddings()) is torch.nn.Linear
    assert parameters_digest(model.named_parameters()) == parameters_digest(plain.named_parameters())

    with torch.inference_mode():  # the engine's logits against the unpacked model's own
        want = plain(input_ids=torch.tensor([ids[:40]]), use_cache=False).logits[0].float()
    got = runner.forward_ragged([Segment(runner.new_kv(40), 0, ids[:40], "all")])[0]
    assert got is not None and torch.allclose(got, want, atol=2e-3)


def test_warm_up_compiles_the_decode_kernel_for_the_models_layouts(runner, monkeypatch):
    together = count_decode_batches(monkeypatch)
    runner.warm_up()
    assert together == [2] * runner.num_layers, "the warm-up's two sequences go through the kernel"
    # the model's query, key and value are strided views, passed as addresses and strides: the
    # kernel keeps the one signature it was compiled for at import
    assert len(decode_attention._attend.signatures) == 1


def test_bf16_prompt_attention_rounds_prompt_chunks_and_leaves_decodes_alone(runner, ids, monkeypatch):
    """``LoadedModel.bf16_attention``: an untiled prompt chunk's attention runs on bf16 queries,
    keys and values (the first chunk's causal call and a later chunk's parts); its output, the KV
    buffer and a decode's attention stay float32."""
    seen: list[tuple[str, torch.dtype]] = []
    for name in ("_attend_parts", "_causal", "_one_query"):
        original = getattr(ragged, name)

        def spy(query, *args, _original=original, _name=name, **kwargs):
            seen.append((_name, query.dtype))
            return _original(query, *args, **kwargs)

        monkeypatch.setattr(ragged, name, spy)

    def prompt(kv: torch.Tensor) -> torch.Tensor:
        first = runner.forward_ragged([Segment(kv, 0, ids[:64], "all")])[0]
        rest = runner.forward_ragged([Segment(kv, 64, ids[64:], "all")])[0]
        return torch.cat([first, rest])

    def decode(kv: torch.Tensor, token: int) -> torch.Tensor:
        return runner.forward_ragged([Segment(kv.clone(), len(ids), [token], decode=True)])[0]

    plain_kv = runner.new_kv(len(ids) + 1)
    plain = prompt(plain_kv)
    assert {dtype for _, dtype in seen} == {torch.float32}
    seen.clear()
    monkeypatch.setattr(runner.loaded, "bf16_attention", True)
    rounded_kv = runner.new_kv(len(ids) + 1)
    rounded = prompt(rounded_kv)
    layers = runner.num_layers
    assert seen == [("_causal", torch.bfloat16)] * layers + [("_attend_parts", torch.bfloat16)] * layers
    assert rounded.dtype == rounded_kv.dtype == torch.float32
    agreement = (rounded.argmax(-1) == plain.argmax(-1)).float().mean().item()
    assert agreement > 0.95, agreement
    assert not torch.allclose(rounded, plain, atol=1e-4)  # the chunks really were attended in bf16

    token = int(rounded[-1].argmax())
    # the decode attended by itself, where the cast would reach it (not in the batched kernel)
    monkeypatch.setattr(decode_attention, "supports", lambda kv: False)
    monkeypatch.setattr(ragged, "BATCH_MAX_KEYS", 0)
    seen.clear()
    on = decode(rounded_kv, token)
    assert seen == [("_one_query", torch.float32)] * layers
    monkeypatch.setattr(runner.loaded, "bf16_attention", False)
    off = decode(rounded_kv, token)
    assert torch.equal(on, off)  # a decode reads the same float32 KV the same way either way


@pytest.mark.skipif(not native_bf16(), reason="the fused forward packs bf16 weights only with native bf16")
def test_bf16_mlp_keeps_the_mlp_activations_bf16_between_its_products(model_dir, ids, monkeypatch):
    """``LoadedModel.bf16_mlp``: the gate and up products return bf16, SiLU and their product run
    in bf16 and the down projection returns float32; the residual stream, the KV and the logits
    stay float32, for a prompt and for a one-row decode alike."""
    loaded = load_model(str(model_dir), dtype="bf16-weights")
    mixed = ModelRunner(loaded)
    assert mixed.fused is not None
    seen: list[tuple[tuple[int, int], torch.dtype, torch.dtype]] = []
    original = fused_layers.PackedWeight.__call__

    def spy(self, x, out_dtype=None):
        out = original(self, x, out_dtype)
        seen.append(((self.out_features, self.in_features), x.dtype, out.dtype))
        return out

    monkeypatch.setattr(fused_layers.PackedWeight, "__call__", spy)
    layer = mixed.fused.layers[0]
    width = {
        name: (p.out_features, p.in_features)
        for name, p in (("gate_up", layer.gate_up), ("down", layer.down))
    }

    def run(bf16_mlp: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
        monkeypatch.setattr(mixed.fused, "bf16_mlp", bf16_mlp)
        seen.clear()
        kv = mixed.new_kv(len(ids) + 1)
        prompt = mixed.forward_ragged([Segment(kv, 0, ids, "all")])[0]
        dtypes = {name: {(x, out) for w, x, out in seen if w == width[name]} for name in width}
        decode = mixed.forward_ragged([Segment(kv, len(ids), [int(prompt[-1].argmax())], decode=True)])[0]
        assert kv.dtype == prompt.dtype == decode.dtype == torch.float32
        return prompt, decode, dtypes

    plain_prompt, plain_decode, plain = run(False)
    assert plain == {"gate_up": {(torch.float32, torch.float32)}, "down": {(torch.float32, torch.float32)}}
    prompt, decode, rounded = run(True)
    assert rounded == {
        "gate_up": {(torch.float32, torch.bfloat16)},
        "down": {(torch.bfloat16, torch.float32)},
    }
    agreement = (prompt.argmax(-1) == plain_prompt.argmax(-1)).float().mean().item()
    assert agreement > 0.95, agreement  # the extra rounding flips only near-ties
    assert not torch.allclose(prompt, plain_prompt, atol=1e-4)  # and the MLP really ran in bf16
    assert not torch.equal(decode, plain_decode)  # the one-row product (doubled) took it too


def test_bf16_mlp_is_cleared_where_the_fused_forward_does_not_apply(model_dir, monkeypatch):
    """transformers' forward computes the MLP in float32, so a runner without the fused forward
    must not let the precision (and with it every key) claim bf16 MLP activations."""
    loaded = load_model(str(model_dir), dtype="bf16-weights")
    loaded.bf16_mlp = True
    monkeypatch.setattr("engine.runner.fuse_llama", lambda *args, **kwargs: None)
    ModelRunner(loaded)
    assert not loaded.bf16_mlp and not loaded.precision.endswith("+bf16-mlp")
