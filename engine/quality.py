"""Model-side measurements for the codec: continuation quality over a KV prefix, pass-key retrieval,
and the query statistics that set key step sizes.

Used by the calibration command and the quality benchmark; the codec itself
never imports the model.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.runner import ModelRunner
from engine.sampling import SamplingParams

KVTransform = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ContinuationQuality:
    ppl: float  # perplexity of the continuation given the (transformed) prefix
    ppl_change: float  # relative to the reference: +0.03 is 3% worse
    top1: float  # fraction of positions whose argmax matches the reference
    kl: float  # mean KL(reference || transformed), nats per token


@dataclass(frozen=True)
class Continuation:
    """A prefix KV, the tokens after it, and the reference logits over them."""

    prefix_kv: torch.Tensor
    token_ids: list[int]
    logits: torch.Tensor  # (tokens, vocab) float32
    nll: float


def _nll(logits: torch.Tensor, token_ids: list[int]) -> float:
    # logits[i] predicts token i + 1; the first continuation token is predicted by the prefix.
    target = torch.tensor(token_ids[1:], device=logits.device)
    return float(torch.nn.functional.cross_entropy(logits[:-1].float(), target))


def reference_continuation(runner: ModelRunner, token_ids: list[int], prefix_tokens: int) -> Continuation:
    prefix_kv = runner.compute_kv(token_ids[:prefix_tokens])
    rest = token_ids[prefix_tokens:]
    logits = runner.prefill(rest, prefix_kv, want_prompt_logits=True).prompt_logits
    assert logits is not None
    return Continuation(prefix_kv=prefix_kv, token_ids=rest, logits=logits, nll=_nll(logits, rest))


def continuation_quality(
    runner: ModelRunner, ref: Continuation, prefix_kv: torch.Tensor
) -> ContinuationQuality:
    logits = runner.prefill(ref.token_ids, prefix_kv, want_prompt_logits=True).prompt_logits
    assert logits is not None
    nll = _nll(logits, ref.token_ids)
    top1 = float((logits.argmax(-1) == ref.logits.argmax(-1)).float().mean())
    logp_ref = torch.log_softmax(ref.logits.float(), -1)
    logp = torch.log_softmax(logits.float(), -1)
    kl = float((logp_ref.exp() * (logp_ref - logp)).sum(-1).mean())
    return ContinuationQuality(ppl=math.exp(nll), ppl_change=math.exp(nll - ref.nll) - 1.0, top1=top1, kl=kl)


# -- pass-key retrieval -----------------------------------------------------------------------------

_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


@dataclass(frozen=True)
class PassKeyTask:
    context_ids: list[int]  # the document: its KV is what gets compressed
    question_ids: list[int]  # prefilled on top of the context KV
    answer: str


def passkey_task(runner: ModelRunner, target_tokens: int, seed: int) -> PassKeyTask:
    """A pass key hidden at a random depth in ~``target_tokens`` of filler (the classic long-context probe)."""
    rng = random.Random(seed)
    key = str(rng.randint(10000, 99999))
    filler_tokens = len(runner.tokenizer(_FILLER)["input_ids"])
    repeats = max(2, target_tokens // filler_tokens)
    depth = rng.randint(1, repeats - 1)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    document = _FILLER * depth + needle + _FILLER * (repeats - depth)
    # Plain text, no chat template: inside an assistant turn the model describes pass keys in general
    # instead of answering (measured at 4.8K tokens).
    head = (
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the important information there.\n\n"
    )
    question = "\n\nWhat is the pass key? The pass key is"
    tok = runner.tokenizer
    return PassKeyTask(
        context_ids=tok(head + document, add_special_tokens=False)["input_ids"],
        question_ids=tok(question, add_special_tokens=False)["input_ids"],
        answer=key,
    )


def passkey_answer(
    runner: ModelRunner, task: PassKeyTask, context_kv: torch.Tensor, max_new_tokens: int = 8
) -> bool:
    state = runner.prefill(task.question_ids, context_kv, room=max_new_tokens)
    tokens = [
        item[0] if isinstance(item, tuple) else item  # decode may yield (token, logits)
        for item in runner.decode(state, SamplingParams(temperature=0.0), max_new_tokens)
    ]
    return bool(tokens) and task.answer in runner.tokenizer.decode(tokens)


def passkey_answer_nll(runner: ModelRunner, task: PassKeyTask, context_kv: torch.Tensor) -> float:
    """The answer's negative log-likelihood, nats, teacher-forced after the question: a continuous
    reading of the same trial, where ``passkey_answer`` is pass or fail."""
    answer = runner.tokenizer(" " + task.answer, add_special_tokens=False)["input_ids"]
    logits = runner.prefill(task.question_ids + answer, context_kv, want_prompt_logits=True).prompt_logits
    assert logits is not None
    # the logits at the question's last token predict the answer's first
    logp = torch.log_softmax(logits[-len(answer) - 1 : -1].float(), -1)
    return float(-logp[torch.arange(len(answer)), torch.tensor(answer, device=logp.device)].sum())


# -- statistics for the codec's step sizes ---------------------------------------------------------------


@torch.inference_mode()
def query_channel_rms(runner: ModelRunner, token_ids: list[int]) -> np.ndarray:
    """RMS of the queries that read each key channel: (layers, kv_heads, head_dim).

    A key error ``dk`` moves an attention logit by ``q . dk``, so the query
    energy per channel is the key channel's sensitivity. Summed over the query
    heads that share a KV head (GQA). Taken before rotary embedding and
    averaged over each rotated pair (channels c and c + head_dim/2), which is
    what the post-rotary statistic is over many positions.
    """
    model = runner.model
    config = model.config
    heads = config.num_attention_heads
    kv_heads, dim = runner.num_kv_heads, runner.head_dim
    # per layer: the queries' squared values summed over tokens, and how many tokens (the prefill
    # runs in passes, each a call of the hook)
    sums: list[torch.Tensor | None] = [None] * runner.num_layers
    counts = [0] * runner.num_layers

    def record(index: int, queries: torch.Tensor) -> None:
        q = queries.float().reshape(-1, heads, dim)
        total = q.square().sum(0)
        sums[index] = total if sums[index] is None else sums[index] + total
        counts[index] += q.shape[0]

    with runner.observe_queries(record):
        runner.prefill(token_ids)
    energy = []
    half = dim // 2
    for total, count in zip(sums, counts, strict=True):
        assert total is not None, "a layer's queries were not seen"
        e = (total / count).reshape(kv_heads, heads // kv_heads, dim).sum(1)
        pair = 0.5 * (e[:, :half] + e[:, half:])
        energy.append(torch.cat([pair, pair], dim=1).cpu())
    return torch.stack(energy).sqrt().numpy().astype(np.float64)
