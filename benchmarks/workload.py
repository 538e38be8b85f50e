"""The gateway's benchmark workload: long contexts of real prose, questions about them, and their
pre-encode (``POST /v1/contexts``), shared by ``benchmarks/prefix_dataset.py`` (datasets for
guidellm and aiperf) and ``benchmarks/batching_bench.py``."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import httpx

QUESTIONS = (
    "What does the text say about {}?",
    "Explain the role of {} in the text.",
    "Summarize what the text tells us about {}.",
    "Give one detail the text mentions about {}.",
    "How is {} used, according to the text?",
    "Quote the sentence that mentions {}.",
)
SHORT_PROMPTS = (
    "Write one sentence about {}.",
    "Give a short definition of {}.",
    "Name three facts about {}.",
    "Describe {} to a child.",
)
TOPICS = (
    "rivers", "volcanoes", "bees", "the moon", "bridges", "tea", "glaciers", "owls", "compilers",
    "bicycles", "lighthouses", "coral reefs", "chess", "bread", "comets", "violins", "deserts",
    "maps", "clocks", "whales", "windmills", "paper", "salt", "thunderstorms",
)  # fmt: skip


@dataclass
class RequestSpec:
    index: int
    messages: list[dict[str, str]]
    context: int | None


def load_tokenizer(name: str) -> Any:
    """A tokenizer to size the contexts: the built-in model's, a HF one, or ~4 characters a token."""
    if name == "chars":
        return CharTokenizer()
    try:
        from transformers import AutoTokenizer

        if name == "default":
            from engine.loading import convert_default_model, default_cache_dir

            return AutoTokenizer.from_pretrained(convert_default_model(default_cache_dir()))
        return AutoTokenizer.from_pretrained(name)
    except Exception as exc:  # noqa: BLE001 - sizing is approximate anyway; say so and go on
        print(f"note: tokenizer {name!r} unavailable ({exc}); sizing contexts at ~4 characters a token")
        return CharTokenizer()


class CharTokenizer:
    """Duck-types the two tokenizer calls ``real_text`` makes, at 4 characters a token."""

    def __call__(self, text: str) -> dict[str, list[str]]:
        return {"input_ids": [text[i : i + 4] for i in range(0, len(text), 4)]}

    def decode(self, ids: list[str]) -> str:
        return "".join(ids)


def build_contexts(tokenizer: Any, count: int, tokens: int) -> list[str]:
    """``count`` distinct contexts of ``tokens`` tokens each: slices of one real-prose corpus.

    The corpus holds about 20K tokens; slices wrap around it, and each context
    opens with its own title so no two share a stored leading chunk.
    """
    from benchmarks.gateway_bench import real_text

    corpus = tokenizer(real_text(tokenizer, min(count * tokens, 20_000)))["input_ids"]
    contexts = []
    for k in range(count):
        start = (k * tokens) % len(corpus)
        ids = [corpus[(start + i) % len(corpus)] for i in range(tokens)]
        contexts.append(f"Document {k + 1} of {count}.\n\n{tokenizer.decode(ids)}")
    return contexts


def keywords(text: str, limit: int = 64) -> list[str]:
    """Distinct long words of a context, in order: what the questions ask about."""
    seen: dict[str, None] = {}
    for word in text.split():
        word = word.strip(".,;:()[]{}'\"`*")
        if len(word) >= 7 and word.isalpha():
            seen.setdefault(word.lower(), None)
        if len(seen) >= limit:
            break
    return list(seen) or list(TOPICS)


def build_requests(contexts: list[str], count: int, seed: int) -> list[RequestSpec]:
    """Round-robin over the contexts; each request asks a different question (or a short prompt)."""
    rng = random.Random(seed)
    specs = []
    words = [keywords(c) for c in contexts]
    for i in range(count):
        if not contexts:
            prompt = SHORT_PROMPTS[i % len(SHORT_PROMPTS)].format(rng.choice(TOPICS))
            specs.append(RequestSpec(i, [{"role": "user", "content": f"{prompt} (#{i})"}], None))
            continue
        k = i % len(contexts)
        question = QUESTIONS[rng.randrange(len(QUESTIONS))].format(rng.choice(words[k]))
        messages = [{"role": "system", "content": contexts[k]}, {"role": "user", "content": question}]
        specs.append(RequestSpec(i, messages, k))
    return specs


def served_model(client: httpx.Client) -> str:
    response = client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def metric(url: str, name: str) -> float | None:
    """The value of the unlabelled metric ``name`` on the gateway at ``url`` (None: not exported)."""
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return None


def pre_encode(client: httpx.Client, contexts: list[str], levels: list[str] | None) -> list[dict[str, Any]]:
    """``POST /v1/contexts`` for each context as a system message, so chats that open with it
    (a question after it) find its KV stored."""
    created = []
    for k, text in enumerate(contexts):
        body: dict[str, Any] = {"messages": [{"role": "system", "content": text}]}
        if levels:
            body["levels"] = levels
        response = client.post("/v1/contexts", json=body)
        if response.status_code != 200:
            raise SystemExit(
                f"POST /v1/contexts failed ({response.status_code}): {response.text[:300]}\n"
                "(only this gateway has /v1/contexts)"
            )
        info = response.json()
        keys = ("id", "tokens", "cached_tokens", "chunks", "bytes", "encode_seconds")
        created.append({"context": k, **{key: info.get(key) for key in keys}})
        print(
            f"pre-encoded context {k}: {info.get('tokens')} tokens in {info.get('encode_seconds', 0):.2f} s"
        )
    return created


def zipf_draws(n_contexts: int, count: int, s: float, seed: int) -> list[int]:
    """Which of ``n_contexts`` each of ``count`` requests asks about, Zipf-like with exponent ``s``:
    the sequence ``benchmarks/scaleout.py`` sends and ``benchmarks/scaleout_sim.py`` replays."""
    weights = [1.0 / (k + 1) ** s for k in range(n_contexts)]
    return random.Random(seed).choices(range(n_contexts), weights=weights, k=count)
