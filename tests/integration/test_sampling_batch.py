"""The batched sampler against the per-row sampler it replaced (``per_row_sample``, the benchmark's
baseline), on a real model's logits."""

from __future__ import annotations

import pytest
import torch

from benchmarks.sampler_bench import per_row_sample
from engine import ModelRunner
from engine.loading import load_model
from engine.sampling import NUCLEUS_FIRST, SamplingParams, make_generator, sample_batch, sample_next

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def runner(model_dir) -> ModelRunner:
    # float32: with bf16 weights the logits are bf16 values, and their exact ties may sort in
    # another order in the per-row sampler's full sort than in the batched top-k (both valid)
    return ModelRunner(load_model(str(model_dir), dtype="float32"))


@pytest.fixture(scope="module")
def model_logits(runner) -> torch.Tensor:
    """Next-token logits of a real model at 24 positions of a real text: (24, vocab)."""
    ids = runner.tokenizer("The licence grants every person who obtains a copy of the software the right")[
        "input_ids"
    ]
    out = runner.prefill(ids, None, want_prompt_logits=True)
    assert out.prompt_logits is not None
    rows = out.prompt_logits[-12:]
    # flatter rows too, so that the nucleus of top_p = 0.95 holds more than NUCLEUS_FIRST tokens
    return torch.cat([rows, rows / 4.0])


MIXES = [
    SamplingParams(temperature=0.0, seed=1),
    SamplingParams(temperature=1.0, seed=2),
    SamplingParams(temperature=0.7, top_p=0.9, seed=3),
    SamplingParams(temperature=1.3, top_p=0.95, seed=4),
    SamplingParams(temperature=0.7, top_p=0.5, seed=5),
]


def test_seeded_rows_get_the_tokens_the_per_row_sampler_gave(model_logits):
    rows = model_logits.shape[0]
    params = [MIXES[i % len(MIXES)] for i in range(rows)]
    seeds = [1000 + i for i in range(rows)]
    params = [SamplingParams(temperature=p.temperature, top_p=p.top_p, seed=s) for p, s in zip(params, seeds)]
    before = [make_generator(s, CPU) for s in seeds]
    after = [make_generator(s, CPU) for s in seeds]
    for _ in range(5):  # several steps: each generator advances as it did before
        expected = [per_row_sample(model_logits[i], params[i], before[i]) for i in range(rows)]
        assert sample_batch(model_logits, params, after) == expected
    # the flat rows needed a nucleus wider than the first topk, so widening was exercised
    probs = torch.softmax(model_logits[-1] / 1.3, dim=-1)
    assert int((torch.cumsum(probs.sort(descending=True).values, 0) < 0.95).sum()) > NUCLEUS_FIRST


def test_a_row_gets_the_same_token_alone_and_in_any_batch(model_logits):
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=7), SamplingParams(temperature=0.0)]
    alone = sample_batch(model_logits[:1], params[:1], [make_generator(7, CPU)])
    mixed = sample_batch(model_logits[:2], params, [make_generator(7, CPU), make_generator(None, CPU)])
    assert mixed[0] == alone[0]
    assert mixed[1] == int(model_logits[1].argmax())
    assert sample_next(model_logits[0], params[0], make_generator(7, CPU)) == alone[0]


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_unseeded_rows_sample_the_model_distribution(top_p):
    probs = torch.tensor([0.45, 0.25, 0.15, 0.1, 0.05])
    logits = probs.log()
    kept = probs.clone()
    if top_p < 1.0:  # the nucleus of 0.8: the first three (0.45 + 0.25 < 0.8 <= 0.85)
        kept[3:] = 0.0
    kept = kept / kept.sum()
    draws = 4000
    params = [SamplingParams(temperature=1.0, top_p=top_p)] * draws
    generators = [make_generator(None, CPU) for _ in range(draws)]
    tokens = torch.tensor(sample_batch(logits.expand(draws, -1), params, generators))
    freq = torch.bincount(tokens, minlength=5).float() / draws
    # 4 standard errors of a frequency of 0.45 over 4,000 draws is 0.031
    assert torch.allclose(freq, kept, atol=0.035), freq
    if top_p < 1.0:
        assert int((tokens >= 3).sum()) == 0


def test_temperature_and_top_p_groups_do_not_mix():
    logits = torch.tensor([[5.0, 4.9, 0.0], [5.0, 4.9, 0.0]])
    params = [SamplingParams(temperature=1.0, top_p=0.1, seed=0), SamplingParams(temperature=0.0)]
    for seed in range(20):
        tokens = sample_batch(logits, params, [make_generator(seed, CPU), make_generator(seed, CPU)])
        assert tokens == [0, 0]  # top_p 0.1 keeps the most likely token only; greedy takes it too
