"""Next-token selection: greedy, temperature and nucleus (top-p) sampling, after penalties and biases.

Penalties follow OpenAI's definitions, as vLLM does: ``presence_penalty`` is
subtracted once from every token that has been generated, and
``frequency_penalty`` once per time it has been generated; vLLM's
``repetition_penalty`` divides the positive logits (multiplies the negative
ones) of every token seen in the prompt or the output. ``logit_bias`` is
added last. Logprobs reported to clients are the model's own, before any of
these.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )


class TokenHistory:
    """What the penalties need: how often each token was generated, and which tokens were seen."""

    def __init__(self, vocab: int, prompt_ids: list[int], device: torch.device) -> None:
        self.counts = torch.zeros(vocab, device=device)
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        ids = torch.tensor(prompt_ids, dtype=torch.long, device=device)
        self.seen[ids[ids < vocab]] = True

    def add(self, token: int) -> None:
        self.counts[token] += 1
        self.seen[token] = True


def adjust_logits(logits: torch.Tensor, params: SamplingParams, history: TokenHistory | None) -> torch.Tensor:
    """The logits to sample from: penalties, then biases (a new tensor; ``logits`` is kept)."""
    out = logits.clone()
    if history is not None:
        if params.repetition_penalty != 1.0:
            seen = out[history.seen]
            out[history.seen] = torch.where(
                seen > 0, seen / params.repetition_penalty, seen * params.repetition_penalty
            )
        if params.frequency_penalty:
            out -= params.frequency_penalty * history.counts
        if params.presence_penalty:
            out -= params.presence_penalty * (history.counts > 0)
    for token, bias in params.logit_bias:
        out[token] += bias
    return out


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest set whose mass reaches top_p (always at least one token)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p
        sorted_probs = sorted_probs * keep
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))
