"""The model's one forward path, and what is built on it: prefill into KV buffers, and decoding.

KV tensors cross this boundary in one layout, shared with the codec:
``(layers, 2, kv_heads, tokens, head_dim)``, keys at index 0 of axis 1, on the
model's device and in its dtype. Keys are stored after rotary embedding, so a
prefix cache is only valid at the positions it was computed at (position 0 on).

Every pass runs ``forward_ragged`` (``engine.ragged``): serving's step loop,
and here, for the cost profile, calibration and the quality tools, ``prefill``
and ``decode`` over one sequence. So what the planner's profile times and what
the quality figures measure is the path that serves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from engine.fused_layers import fuse_llama
from engine.kv_pool import BLOCK_TOKENS, KVPool
from engine.loading import LoadedModel
from engine.packed_linear import pack_output_projection
from engine.ragged import ATTENTION_NAME, Segment, active, check_supported, ragged_attention
from engine.sampling import SamplingParams, make_generator, sample_next

# The most tokens ``prefill`` puts in one pass: what the step loop prefills at most in a step
# (scheduler.step_loop.IDLE_PREFILL_TOKENS), so that a profile of it times serving's passes.
PREFILL_PASS_TOKENS = 512


@dataclass
class PrefillResult:
    kv: torch.Tensor  # a buffer from ``new_kv``: its first ``length`` tokens hold the KV
    length: int
    last_logits: torch.Tensor  # (vocab,) float32, the distribution of the next token
    prompt_logits: torch.Tensor | None  # (new_tokens, vocab) when asked for

    @property
    def prefix(self) -> torch.Tensor:
        """The KV computed so far (a view of ``kv``)."""
        return self.kv[:, :, :, : self.length]


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
        # the output projection on a weight packed for oneDNN where it applies: engine.packed_linear
        self.packed_output = pack_output_projection(self.model, loaded.batch_invariant)
        # the engine's own forward over fused, packed projections where it applies (Llama on a CPU,
        # float32 or bf16 weights: engine.fused_layers); otherwise, and for anyone who calls the
        # model, transformers'
        self.fused = fuse_llama(self.model, batch_invariant=loaded.batch_invariant, bf16_mlp=loaded.bf16_mlp)
        if self.fused is None and loaded.bf16_mlp:  # transformers' MLP computes in float32: say so in
            loaded.bf16_mlp = False  # the precision, which the keys hold, before any key is made
        self.transformers_released = False  # release_transformers_weights
        self.kv_pool: KVPool | None = None  # where ``new_kv`` takes buffers from (``use_kv_pool``)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.loaded.dtype.itemsize

    @property
    def device(self) -> torch.device:
        return self.loaded.device

    # -- KV buffers -------------------------------------------------------------------------------

    def kv_bytes(self, tokens: int) -> int:
        """The KV memory a buffer of ``tokens`` tokens takes: whole blocks of the pool's."""
        return -(-tokens // BLOCK_TOKENS) * BLOCK_TOKENS * self.kv_bytes_per_token

    def use_kv_pool(self, nbytes: int, prefault: bool = True) -> KVPool | None:
        """Take KV buffers from a pool of ``nbytes`` (``engine.kv_pool``) from now on; on a CPU only,
        where a fresh buffer's pages are faulted in as it is first written (a GPU's caching
        allocator reuses its memory already)."""
        if self.device.type == "cpu":
            self.kv_pool = KVPool(nbytes, BLOCK_TOKENS * self.kv_bytes_per_token, prefault)
        return self.kv_pool

    def new_kv(self, tokens: int) -> torch.Tensor:
        """An empty (layers, 2, heads, tokens, head_dim) buffer on the model's device, in its dtype.

        A request's prefix is decoded or prefilled straight into it, and its
        passes keep writing into it: size it for the whole request, prompt and
        generated tokens.
        """
        shape = (self.num_layers, 2, self.num_kv_heads, tokens, self.head_dim)
        if self.kv_pool is not None:
            kv = self.kv_pool.tensor(shape, self.loaded.dtype)
            if kv is not None:
                return kv
        return torch.empty(shape, device=self.device, dtype=self.loaded.dtype)

    # -- model passes -----------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: list[int],
        prefix_kv: torch.Tensor | None = None,
        *,
        prefix_tokens: int | None = None,
        want_prompt_logits: bool = False,
        room: int = 0,
    ) -> PrefillResult:
        """Run the model over ``token_ids`` after the first ``prefix_tokens`` (default: all) of
        ``prefix_kv``, in passes of at most ``PREFILL_PASS_TOKENS``.

        ``token_ids`` are the tokens *after* the prefix and must not be empty: the last one
        produces the next-token distribution. When ``prefix_kv`` is a buffer from ``new_kv`` with
        room for them, they are written into it in place; otherwise the prefix is copied into a
        new buffer with ``room`` tokens to spare (for ``decode``).
        """
        if not token_ids:
            raise ValueError("prefill needs at least one token after the cached prefix")
        past = 0 if prefix_kv is None else (prefix_kv.shape[3] if prefix_tokens is None else prefix_tokens)
        end = past + len(token_ids)
        kv = prefix_kv
        if kv is None or not self._holds(kv, end + room):
            kv = self.new_kv(end + room)
            if past:
                assert prefix_kv is not None
                kv[:, :, :, :past].copy_(prefix_kv[:, :, :, :past])
        rows: list[torch.Tensor] = []
        last: torch.Tensor | None = None
        for at in range(0, len(token_ids), PREFILL_PASS_TOKENS):
            piece = token_ids[at : at + PREFILL_PASS_TOKENS]
            final = at + len(piece) == len(token_ids)
            want = "all" if want_prompt_logits else ("last" if final else "none")
            (logits,) = self.forward_ragged([Segment(kv, past + at, piece, want)])
            if want_prompt_logits:
                assert logits is not None
                rows.append(logits)
            elif final:
                last = logits
        prompt_logits = torch.cat(rows) if want_prompt_logits else None
        if prompt_logits is not None:
            last = prompt_logits[-1]
        assert last is not None
        return PrefillResult(kv=kv, length=end, last_logits=last, prompt_logits=prompt_logits)

    def _holds(self, kv: torch.Tensor, tokens: int) -> bool:
        """Whether ``kv`` can take the KV of ``tokens`` tokens in place."""
        return kv.device == self.device and kv.dtype == self.loaded.dtype and kv.shape[3] >= tokens

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
        input_ids = torch.tensor([ids], device=self.device)
        position_ids = torch.tensor([positions], device=self.device)
        rows = torch.tensor(keep, device=self.device)
        with active(segments, tiled=self.loaded.batch_invariant, bf16_prompts=self.loaded.bf16_attention):
            if self.fused is not None:
                logits = self.fused.logits(input_ids, position_ids, rows, ragged_attention).float()
            else:
                out = self.model(
                    input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=rows
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

    def release_transformers_weights(self) -> int:
        """Give back the model's own decoder projection weights where the fused forward has packed
        copies of them (``engine.fused_layers``); returns the bytes freed. For a process that only
        serves: transformers' forward and a digest of the parameters fail from then on, so take
        the weights' digest first."""
        if self.fused is None:
            return 0
        self.transformers_released = True
        return self.fused.release_plain_weights(self.model)

    @contextmanager
    def transformers_forward(self) -> Iterator[None]:
        """Run transformers' own forward (``self.model``'s modules) in the passes meanwhile, not the
        fused one: for tools that hook or replace the model's modules, and to compare the two."""
        if self.transformers_released:
            raise RuntimeError(
                "the model's own projection weights were released: only the fused forward runs"
            )
        fused, self.fused = self.fused, None
        try:
            yield
        finally:
            self.fused = fused

    @contextmanager
    def observe_queries(self, record: Callable[[int, torch.Tensor], None]) -> Iterator[None]:
        """Call ``record(layer, queries)`` with each layer's queries before rotary, (tokens,
        q_heads * head_dim), for every pass run meanwhile: the quality tools' query statistics."""
        if self.fused is not None:
            for index, layer in enumerate(self.fused.layers):
                layer.query_hook = lambda q, index=index: record(index, q)
            try:
                yield
            finally:
                for layer in self.fused.layers:
                    layer.query_hook = None
            return

        def hook(index: int):
            return lambda _module, _inputs, output: record(index, output[0])

        layers = self.model.model.layers
        handles = [layer.self_attn.q_proj.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def warm_up(self) -> None:
        """One small step of two one-token sequences, so that the one-time costs of the decode path
        are paid at start-up rather than by a first request's second token. The decode kernel
        itself compiles (or loads from numba's cache, 0.3 s here) when its module is imported,
        with its one pinned signature (``engine.decode_attention._ATTEND``)."""
        kvs = [self.new_kv(2) for _ in range(2)]
        self.forward_ragged([Segment(kv, 0, [0], logits="none") for kv in kvs])

    def compute_kv(self, token_ids: list[int]) -> torch.Tensor:
        """Prefill a whole context from scratch and return its KV."""
        return self.prefill(token_ids).kv

    @torch.inference_mode()
    def decode(
        self,
        state: PrefillResult,
        params: SamplingParams,
        max_new_tokens: int,
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield ``(token, logits it was sampled from)`` until EOS (not yielded) or ``max_new_tokens``;
        each token's KV goes into ``state.kv`` (moved to a larger buffer when it is full).

        The caller stops early by closing the generator (stop strings, a
        client that went away).
        """
        generator = make_generator(params.seed, self.device)
        logits = state.last_logits
        for step in range(max_new_tokens):
            token = sample_next(logits, params, generator)
            if token in self.eos_token_ids and not params.ignore_eos:
                return
            yield token, logits
            if step + 1 == max_new_tokens:
                return
            if not self._holds(state.kv, state.length + 1):
                grown = self.new_kv(state.length + max_new_tokens - step)
                grown[:, :, :, : state.length].copy_(state.prefix)
                state.kv = grown
            (out,) = self.forward_ragged([Segment(state.kv, state.length, [token], decode=True)])
            assert out is not None
            state.length += 1
            logits = out


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
