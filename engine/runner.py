"""Prefill on top of explicit KV tensors, and token-by-token decoding.

KV tensors cross this boundary in one layout, shared with the codec:
``(layers, 2, kv_heads, tokens, head_dim)``, keys at index 0 of axis 1, on the
model's device and in its dtype. Keys are stored after rotary embedding, so a
prefix cache is only valid at the positions it was computed at (position 0 on).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from engine.kv_buffer import BufferLayer
from engine.loading import LoadedModel
from engine.ragged import ATTENTION_NAME, Segment, active, check_supported
from engine.sampling import SamplingParams, make_generator, sample_next


@dataclass
class PrefillResult:
    cache: DynamicCache
    last_logits: torch.Tensor  # (vocab,) float32, the distribution of the next token
    prompt_logits: torch.Tensor | None  # (new_tokens, vocab) when asked for


class ModelRunner:
    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        config = self.model.config
        self.num_layers: int = config.num_hidden_layers
        self.num_kv_heads: int = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim: int = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.max_context: int = int(getattr(config, "max_position_embeddings", 2048))
        self.eos_token_ids: frozenset[int] = _eos_ids(loaded)
        check_supported(config)
        self.model.set_attn_implementation(ATTENTION_NAME)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.loaded.dtype.itemsize

    @property
    def device(self) -> torch.device:
        return self.loaded.device

    # -- KV tensors <-> transformers cache ---------------------------------------------------

    def new_kv(self, tokens: int) -> torch.Tensor:
        """An empty (layers, 2, heads, tokens, head_dim) buffer on the model's device, in its dtype.

        A request's prefix is decoded or prefilled straight into it, and the cache
        built over it (``cache_from_kv``) keeps writing into it: size it for the
        whole request, prompt and generated tokens.
        """
        shape = (self.num_layers, 2, self.num_kv_heads, tokens, self.head_dim)
        return torch.empty(shape, device=self.device, dtype=self.loaded.dtype)

    def cache_from_kv(self, kv: torch.Tensor | None, length: int | None = None) -> DynamicCache:
        """A cache whose first ``length`` tokens (default: all) are ``kv``'s, without a copy.

        When ``kv`` is a buffer from ``new_kv`` on the model's device and dtype,
        the cache's layers are views of it and new tokens are written into it in
        place (``BufferLayer``); anything else is copied into a fresh cache.
        """
        cache = DynamicCache(config=self.model.config)
        if kv is None:
            return cache
        length = kv.shape[3] if length is None else length
        in_place = kv.device == self.device and kv.dtype == self.loaded.dtype
        if not in_place:
            kv = kv[:, :, :, :length].to(device=self.device, dtype=self.loaded.dtype)
        for index in range(self.num_layers):
            keys, values = kv[index, 0].unsqueeze(0), kv[index, 1].unsqueeze(0)
            if type(cache.layers[index]) is DynamicLayer:
                cache.layers[index] = BufferLayer(keys, values, length)
            elif length:
                cache.layers[index].update(keys[:, :, :length], values[:, :, :length])
        return cache

    def kv_from_cache(self, cache: DynamicCache, start: int = 0, end: int | None = None) -> torch.Tensor:
        """The cached tokens ``[start, end)`` as one (layers, 2, heads, tokens, head_dim) tensor."""
        parts = [
            torch.stack((layer.keys[0, :, start:end], layer.values[0, :, start:end]))
            for layer in cache.layers
        ]
        return torch.stack(parts)

    # -- model passes -----------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: list[int],
        prefix_kv: torch.Tensor | None = None,
        *,
        prefix_tokens: int | None = None,
        want_prompt_logits: bool = False,
    ) -> PrefillResult:
        """Run the model over ``token_ids`` after the first ``prefix_tokens`` of ``prefix_kv``.

        ``token_ids`` are the tokens *after* the prefix and must not be empty:
        the last one produces the next-token distribution. ``prefix_kv`` may be
        a buffer from ``new_kv`` with room for the rest of the request: the
        cache then grows inside it.
        """
        if not token_ids:
            raise ValueError("prefill needs at least one token after the cached prefix")
        cache = self.cache_from_kv(prefix_kv, prefix_tokens)
        past = cache.get_seq_length()
        input_ids = torch.tensor([token_ids], device=self.device)
        positions = torch.arange(past, past + len(token_ids), device=self.device).unsqueeze(0)
        out = self.model(
            input_ids=input_ids,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=0 if want_prompt_logits else 1,
        )
        logits = out.logits[0].float()
        return PrefillResult(
            cache=cache,
            last_logits=logits[-1],
            prompt_logits=logits if want_prompt_logits else None,
        )

    @torch.inference_mode()
    def forward_ragged(self, segments: list[Segment]) -> list[torch.Tensor | None]:
        """One forward pass over every segment's tokens (see ``engine.ragged``).

        Each segment's KV lands in its own buffer. Returns per segment the
        float32 logits it asked for: (vocab,) for ``last``, (tokens, vocab) for
        ``all``, None for ``none``.
        """
        ids: list[int] = []
        positions: list[int] = []
        keep: list[int] = []
        for segment in segments:
            if not segment.token_ids:
                raise ValueError("a ragged segment needs at least one token")
            at = len(ids)
            ids.extend(segment.token_ids)
            positions.extend(range(segment.start, segment.end))
            if segment.logits == "all":
                keep.extend(range(at, len(ids)))
            elif segment.logits == "last":
                keep.append(len(ids) - 1)
        if not keep:
            keep.append(len(ids) - 1)  # transformers computes at least one row
        with active(segments):
            out = self.model(
                input_ids=torch.tensor([ids], device=self.device),
                position_ids=torch.tensor([positions], device=self.device),
                use_cache=False,
                logits_to_keep=torch.tensor(keep, device=self.device),
            )
        logits = out.logits[0].float()
        results: list[torch.Tensor | None] = []
        row = 0
        for segment in segments:
            if segment.logits == "all":
                n = len(segment.token_ids)
                results.append(logits[row : row + n])
                row += n
            elif segment.logits == "last":
                results.append(logits[row])
                row += 1
            else:
                results.append(None)
        return results

    def compute_kv(self, token_ids: list[int]) -> torch.Tensor:
        """Prefill a whole context from scratch and return its KV."""
        return self.kv_from_cache(self.prefill(token_ids).cache)

    @torch.inference_mode()
    def decode(
        self,
        state: PrefillResult,
        params: SamplingParams,
        max_new_tokens: int,
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield ``(token, logits it was sampled from)`` until EOS (not yielded) or ``max_new_tokens``.

        The caller stops early by closing the generator (stop strings, a
        client that went away).
        """
        generator = make_generator(params.seed, self.device)
        cache, logits = state.cache, state.last_logits
        for step in range(max_new_tokens):
            token = sample_next(logits, params, generator)
            if token in self.eos_token_ids and not params.ignore_eos:
                return
            yield token, logits
            if step + 1 == max_new_tokens:
                return
            pos = cache.get_seq_length()
            out = self.model(
                input_ids=torch.tensor([[token]], device=self.device),
                position_ids=torch.tensor([[pos]], device=self.device),
                cache=cache,
                use_cache=True,
            )
            logits = out.logits[0, -1].float()


def _eos_ids(loaded: LoadedModel) -> frozenset[int]:
    ids: set[int] = set()
    eos = loaded.model.generation_config.eos_token_id if loaded.model.generation_config else None
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(eos)
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(loaded.tokenizer.eos_token_id)
    return frozenset(ids)
