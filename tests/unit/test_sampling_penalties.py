"""Penalties and biases, as OpenAI and vLLM define them, on hand-made logits."""

from __future__ import annotations

import torch

from engine.sampling import SamplingParams, TokenHistory, adjust_logits, make_generator, sample_next


def history(prompt: list[int], generated: list[int], vocab: int = 6) -> TokenHistory:
    h = TokenHistory(vocab, prompt, torch.device("cpu"))
    for token in generated:
        h.add(token)
    return h


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    logits = torch.zeros(6)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = adjust_logits(logits, params, history(prompt=[4], generated=[1, 1, 2]))
    assert out.tolist() == [0.0, -1.0, -0.75, 0.0, 0.0, 0.0]
    assert logits.tolist() == [0.0] * 6  # the model's logits are kept for logprobs


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([2.0, -2.0, 2.0, -2.0, 1.0, 1.0])
    out = adjust_logits(logits, SamplingParams(repetition_penalty=2.0), history(prompt=[0, 1], generated=[4]))
    assert out.tolist() == [1.0, -4.0, 2.0, -2.0, 0.5, 1.0]


def test_logit_bias_can_force_and_forbid_tokens():
    logits = torch.tensor([5.0, 0.0, 0.0])
    params = SamplingParams(temperature=0.0, logit_bias=((0, -100.0), (2, 10.0)))
    assert (
        sample_next(adjust_logits(logits, params, None), params, make_generator(0, torch.device("cpu"))) == 2
    )


def test_greedy_with_a_frequency_penalty_moves_off_a_repeated_token():
    logits = torch.tensor([1.0, 0.9])
    params = SamplingParams(temperature=0.0, frequency_penalty=0.2)
    h = history(prompt=[], generated=[0], vocab=2)
    assert sample_next(adjust_logits(logits, params, h), params, make_generator(0, torch.device("cpu"))) == 1
    assert not SamplingParams().adjusts_logits and params.adjusts_logits
