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

from collections.abc import Sequence
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
    """One token from one row of logits (see ``sample_batch``)."""
    return sample_batch(logits[None], [params], [generator])[0]


def sample_batch(
    scores: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> list[int]:
    """A token for every row of ``scores`` (rows, vocab), each by its own parameters and generator,
    with one host sync for the batch.

    - Greedy rows take the argmax.
    - The other rows share one softmax per temperature and top-p, and the
      nucleus (the smallest set of the most likely tokens whose mass reaches
      ``top_p``) comes from ``topk``, widened until it holds the whole set:
      the same tokens a full sort of the vocabulary keeps, for a fraction of
      its cost.
    - A seeded row draws exactly as ``torch.multinomial(probs, 1)`` does: the
      argmax of ``probs / noise``, with Exp(1) noise over the whole
      vocabulary from the row's generator. A seed therefore gives the tokens
      it gave before sampling was batched.
    - An unseeded row needs no reproducible draw, so it takes one uniform
      number from its generator and inverts the cumulative distribution: the
      same distribution, without drawing noise for every token of the
      vocabulary (about 1.4 ms a row on a CPU).
    """
    rows, vocab = scores.shape
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if len(greedy) == rows:
        return scores.argmax(dim=-1).tolist()
    tokens = torch.zeros(rows, dtype=torch.long, device=scores.device)
    if greedy:
        tokens[greedy] = scores[greedy].argmax(dim=-1)
    groups: dict[tuple[float, float], list[int]] = {}
    for i, p in enumerate(params):
        if not p.greedy:
            groups.setdefault((p.temperature, p.top_p), []).append(i)
    for (temperature, top_p), members in groups.items():
        probs = torch.softmax(scores[members] / temperature, dim=-1)
        order: torch.Tensor | None = None
        if top_p < 1.0:
            probs, order = _nucleus(probs, top_p)
        width = probs.shape[1]
        seeded = [j for j, i in enumerate(members) if params[i].seed is not None]
        unseeded = [j for j, i in enumerate(members) if params[i].seed is None]
        choice = torch.zeros(len(members), dtype=torch.long, device=scores.device)
        if seeded:
            noise = torch.stack(
                [
                    torch.empty(vocab, device=scores.device).exponential_(
                        1, generator=generators[members[j]]
                    )[:width]
                    for j in seeded
                ]
            )
            choice[seeded] = (probs[seeded] / noise).argmax(dim=-1)
        if unseeded:
            draws = torch.cat(
                [torch.rand(1, device=scores.device, generator=generators[members[j]]) for j in unseeded]
            )
            cdf = torch.cumsum(probs[unseeded], dim=-1)
            at = torch.searchsorted(cdf, (draws * cdf[:, -1])[:, None], right=True)[:, 0]
            choice[unseeded] = at.clamp_(max=width - 1)
        if order is not None:
            choice = order.gather(1, choice[:, None])[:, 0]
        tokens[members] = choice
    return tokens.tolist()


# the nucleus search starts with this many tokens and widens by NUCLEUS_WIDEN until the set fits
NUCLEUS_FIRST = 64
NUCLEUS_WIDEN = 8


def _nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The most likely tokens of each row, most likely first, with the probabilities of those outside
    the nucleus set to 0: ``(probs, token ids)``, both (rows, width), ``width`` the same for every row.

    On a GPU a full sort costs little and keeps the step free of host syncs;
    on a CPU the sort of the whole vocabulary is most of the cost, so
    ``topk`` widens until the last token it returns is outside every row's
    nucleus.
    """
    vocab = probs.shape[1]
    width = vocab if probs.is_cuda else min(vocab, NUCLEUS_FIRST)
    while True:
        if width == vocab:
            values, order = torch.sort(probs, dim=-1, descending=True)
        else:
            values, order = torch.topk(probs, width, dim=-1)
        # keep the smallest set whose mass reaches top_p (always at least one token)
        keep = torch.cumsum(values, dim=-1) - values < top_p
        if width == vocab or not bool(keep[:, -1].any()):
            return values * keep, order
        width = min(vocab, width * NUCLEUS_WIDEN)
