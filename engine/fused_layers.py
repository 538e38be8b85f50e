"""The engine's own forward for Llama-family models: fused projections, packed once for oneDNN.

transformers' ``LlamaForCausalLM`` calls seven linear layers per decoder
layer, each through MKL (``F.linear``), and a dozen small modules around
them. For a step of a few rows (the decodes of a step) that costs twice:

- **MKL's few-row products are slow.** On the 2-core Zen 3 development
  machine, 30 layers' worth of the default model's four fused products take
  29.9 ms at one row and 58.6 ms at eight through MKL, against 21.4 and
  27.5 ms through oneDNN on weights reordered once into its blocked layout;
  the gate and up projections alone 15.8 and 30.9 ms against 9.5 and 12.2.
  From about 256 rows on the two are even, and at 512 (a prefill pass)
  oneDNN is 8% slower (``python -m benchmarks.projection_gemm``,
  ``benchmarks/results/projection_gemm_2cpu.json``).
- **Module plumbing**: each layer's norms, rotary embedding and projection
  calls are a few dozen tensor operations and Python calls.

``FusedLlama`` runs the same arithmetic with the query, key and value
projections fused into one product and the gate and up projections into
another, every product on an oneDNN-packed weight (``PackedWeight``), the
norms as ``F.rms_norm`` (bit-identical to transformers' float32 RMSNorm) and
the rotary embedding applied to queries and keys in one pass. Attention is
the engine's own (``engine.ragged``). ``ModelRunner.forward_ragged`` runs it
in place of ``model(...)``; the model itself is left as it was, so
transformers' own forward (``generate``, SDPA, the tests' stock reference)
and the weights' digest still see the plain weights.

A decode step on the same machine (``python -m benchmarks.step_bench --batch
1,8,16 --dtypes float32``, ``transformers forward`` against ``step``;
``benchmarks/results/step_fused_layers_2cpu.json``): 48.8 -> 37.3 ms for one
sequence, 94.5 -> 56.2 ms for 8, 110.9 -> 81.6 ms for 16. A 1,024-token
prefill in 512-token passes: 2.15 s, against 2.09 s for one plain SDPA
forward of transformers'.

The packed copies would be the decoder's projections once more (425 MB on the
default model). The gateway, which never runs transformers' forward, gives
the plain ones back once the weights' digest is taken
(``FusedLlama.release_plain_weights``: they become meta tensors, so a
forward or a digest that would still read them fails instead of computing
on nothing); tools and tests keep both.

bf16 weights (``engine.bf16_weights``) are packed the same way, in bf16, on a
CPU with native bf16: the products round their float32 input to bf16 and
return float32, as ``Bf16WeightLinear`` does. Where the model is
batch-invariant (``LoadedModel.batch_invariant``: AVX512-BF16 kernels), the
packed products are probed for it too (``FusedLlama.sums_rows_alike``)
before they are used; with oneDNN held to those kernels on the AMX machine
they gave the same logits as transformers' forward, bit for bit. A decode
step of 1 / 8 / 16 sequences there took 30.1 / 53.8 / 74.9 ms against 43.0
/ 66.7 / 89.4 through transformers' forward, and with AMX's own kernels
25.5 / 34.3 / 42.5 against 39.4 / 47.2 / 56.0 (``python -m
benchmarks.step_bench --batch 1,8,16 --dtypes bf16-weights``,
``step_fused_bf16_isa_avx512bf16.json``, ``step_fused_bf16_amx.json``).

The fused forward is made only where it pays and is tested to be
equivalent: a CPU with oneDNN, float32 or (with native bf16) bf16 weights,
for a model whose decoder layers are transformers' Llama classes with plain
``nn.Linear`` (or ``Bf16WeightLinear``) projections and SiLU. Anything else
(other architectures, a GPU, bf16 weights without native bf16) keeps
transformers' forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import SiLUActivation

from engine.bf16_weights import Bf16WeightLinear, bf16_product, native_bf16, sums_rows_alike

log = logging.getLogger(__name__)

# transformers' ``ACT2FN["silu"]``, and torch's own
_SILU = (SiLUActivation, nn.SiLU)

# oneDNN picks its blocked layout for this many rows: a decode step's batch (as engine.packed_linear)
PACK_FOR_ROWS = 8


class PackedWeight:
    """One or more linear layers' weights stacked along their outputs and reordered for oneDNN.

    The layers are float32 ``nn.Linear`` or, on a CPU with native bf16,
    ``Bf16WeightLinear`` (``engine.bf16_weights``): bf16 weights over float32
    activations, multiplied as that layer does (``engine.bf16_weights.bf16_product``),
    so a row gets the same bits at every row count where the CPU's kernels give
    them (``FusedLlama.sums_rows_alike``).
    """

    def __init__(self, *linears: nn.Module) -> None:
        weight = torch.cat([linear.weight.detach() for linear in linears])
        self.out_features, self.in_features = weight.shape
        self.bf16 = weight.dtype == torch.bfloat16
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_FOR_ROWS)
        biases = [linear.bias for linear in linears]
        if all(bias is None for bias in biases):
            self.bias = None
        else:
            self.bias = torch.cat(
                [
                    torch.zeros(linear.out_features, dtype=weight.dtype) if bias is None else bias.detach()
                    for linear, bias in zip(linears, biases)
                ]
            )

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The product of ``x``; bf16 weights return ``out_dtype`` (default: ``x``'s)."""
        if not self.bf16:
            return self._product(x)
        return bf16_product(x, lambda rows: self._product(rows.contiguous()), out_dtype)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class FusedLayer:
    """One Llama decoder layer: pre-norm attention and a SiLU-gated MLP, each with its residual."""

    def __init__(self, layer: nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.attention_module = attn  # what the attention function reads: layer_idx, scaling
        self.head_dim: int = attn.head_dim
        self.q_width = attn.q_proj.out_features
        self.qk_width = self.q_width + attn.k_proj.out_features
        self.intermediate = mlp.gate_proj.out_features
        self.qkv = PackedWeight(attn.q_proj, attn.k_proj, attn.v_proj)
        self.o = PackedWeight(attn.o_proj)
        self.gate_up = PackedWeight(mlp.gate_proj, mlp.up_proj)
        self.down = PackedWeight(mlp.down_proj)
        self.input_norm = (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
        self.post_norm = (
            layer.post_attention_layernorm.weight,
            layer.post_attention_layernorm.variance_epsilon,
        )
        # called with (tokens, q_heads * head_dim) queries before rotary, where set
        # (``ModelRunner.observe_queries``: the quality tools' query statistics)
        self.query_hook: Callable[[torch.Tensor], None] | None = None

    def __call__(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: Callable[..., tuple[torch.Tensor, None]],
        bf16_mlp: bool = False,
    ) -> torch.Tensor:
        """``hidden`` (1, tokens, hidden); ``cos``/``sin`` (1, tokens, head_dim, broadcast over heads).
        ``bf16_mlp`` (bf16 weights only): the gate and up products come back in bf16 and SiLU and
        their product run in bf16, which the down projection rounds its input to anyway."""
        tokens, dim = hidden.shape[1], self.head_dim
        weight, eps = self.input_norm
        x = self.qkv(F.rms_norm(hidden, weight.shape, weight, eps))
        if self.query_hook is not None:
            self.query_hook(x[0, :, : self.q_width])
        qk = x[..., : self.qk_width].view(1, tokens, -1, dim)
        half = dim // 2
        qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin
        q_heads = self.q_width // dim
        query = qk[:, :, :q_heads].transpose(1, 2)
        key = qk[:, :, q_heads:].transpose(1, 2)
        value = x[..., self.qk_width :].view(1, tokens, -1, dim).transpose(1, 2)
        module = self.attention_module
        attended, _ = attention(module, query, key, value, None, scaling=module.scaling)
        hidden = hidden + self.o(attended.reshape(1, tokens, -1))
        weight, eps = self.post_norm
        inner = torch.bfloat16 if bf16_mlp else None
        gate_up = self.gate_up(F.rms_norm(hidden, weight.shape, weight, eps), inner)
        mixed = F.silu(gate_up[..., : self.intermediate]) * gate_up[..., self.intermediate :]
        return hidden + self.down(mixed, hidden.dtype)


class FusedLlama:
    """A ``LlamaForCausalLM``'s forward over packed copies of its decoder's weights (see the module)."""

    def __init__(self, model: nn.Module, bf16_mlp: bool = False) -> None:
        base = model.model
        # the MLP's activations stay bf16 between its products (``FusedLayer``; bf16 weights only)
        self.bf16_mlp = bf16_mlp
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self.norm = base.norm
        self.head = model.get_output_embeddings()
        self.layers = [FusedLayer(layer) for layer in base.layers[: model.config.num_hidden_layers]]

    def _distinct_products(self) -> list[PackedWeight]:
        """Each distinct shape's first product."""
        products: dict[tuple[int, int], PackedWeight] = {}
        for layer in self.layers:
            for product in (layer.qkv, layer.o, layer.gate_up, layer.down):
                products.setdefault((product.out_features, product.in_features), product)
        return list(products.values())

    def sums_rows_alike(self) -> bool:
        """True if each of this forward's products gives a row the same bits at every row count
        (``engine.bf16_weights.sums_rows_alike``, on each distinct shape's first product)."""
        with torch.inference_mode():
            return all(sums_rows_alike(p, p.in_features) for p in self._distinct_products())

    def run_one_row(self) -> None:
        """Multiply one row through each distinct product (raises where a kernel is missing)."""
        with torch.inference_mode():
            for product in self._distinct_products():
                product(torch.zeros(1, product.in_features))

    def release_plain_weights(self, model: nn.Module) -> int:
        """Free ``model``'s own decoder projection weights, which this forward does not read, and a
        bf16 output projection's own weight where it multiplies on a packed copy
        (``engine.packed_linear``): each becomes a meta tensor of its shape. Returns the bytes
        given back. transformers' forward over ``model`` fails from then on, as does a digest of
        its parameters.

        transformers maps a safetensors file into memory and its parameters are views of that
        mapping, so a freed weight's pages would stay resident while any other parameter keeps
        the mapping open. The parameters left (the embedding, the norms) are therefore copied
        out of it, the mapping closes, and its pages leave the RSS (on the default model 1,666
        -> 1,231 MiB)."""
        freed = 0
        linears = [
            linear
            for layer in model.model.layers[: len(self.layers)]
            for linear in (*_projections(layer.self_attn, "qkvo"), *_projections(layer.mlp, _MLP))
        ]
        if isinstance(self.head, Bf16WeightLinear) and self.head.packed is not None:
            linears.append(self.head)
        for linear in linears:
            weight = linear.weight
            if weight.device.type == "meta":
                continue
            freed += weight.numel() * weight.element_size()
            linear.weight = nn.Parameter(torch.empty_like(weight, device="meta"), requires_grad=False)
        if freed:
            for param in model.parameters():  # tied ones once, and the same objects keep the ties
                if param.device.type != "meta":
                    param.data = param.data.clone()
        return freed

    def logits(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        keep: torch.Tensor,
        attention: Callable[..., tuple[torch.Tensor, None]],
    ) -> torch.Tensor:
        """The logits of the rows ``keep`` of one ragged row of tokens: (len(keep), vocab)."""
        hidden = self.embed(input_ids)
        cos, sin = self.rotary(hidden, position_ids)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # over the heads of (1, tokens, heads, dim)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, attention, self.bf16_mlp)
        hidden = self.norm(hidden[0, keep])
        return self.head(hidden)


def fuse_llama(model: nn.Module, batch_invariant: bool = False, bf16_mlp: bool = False) -> FusedLlama | None:
    """The fused forward for ``model`` where it applies (see the module), else None.

    ``batch_invariant``: the model's own products give a row the same bits at every row count
    (``LoadedModel.batch_invariant``), so the fused ones must too: they are other shapes (the
    fused projections) on another kernel (packed), and are probed before they are used.
    ``bf16_mlp``: ``LoadedModel.bf16_mlp``."""
    reason = _unsupported(model)
    if reason is not None:
        log.info("transformers' forward kept: %s", reason)
        return None
    try:
        fused = FusedLlama(model, bf16_mlp)
        # each distinct product runs here once (the row probe, or one row), so that a torch whose
        # oneDNN lacks a kernel (bf16) fails at start-up, not in the first request
        if batch_invariant and not fused.sums_rows_alike():
            log.info("transformers' forward kept: the packed bf16 products are not row-invariant here")
            return None
        fused.run_one_row()
    except (RuntimeError, AttributeError) as exc:  # a torch built without these oneDNN ops
        log.warning("transformers' forward kept: %s", exc)
        return None
    return fused


def _unsupported(model: nn.Module) -> str | None:
    from transformers.models.llama import modeling_llama as llama

    if type(model) is not llama.LlamaForCausalLM:
        return f"{type(model).__name__} is not LlamaForCausalLM"
    if not torch.backends.mkldnn.is_available():
        return "torch has no oneDNN"
    expected = {
        "self_attn": llama.LlamaAttention,
        "mlp": llama.LlamaMLP,
        "input_layernorm": llama.LlamaRMSNorm,
        "post_attention_layernorm": llama.LlamaRMSNorm,
    }
    kinds = set()
    for layer in model.model.layers:
        if type(layer) is not llama.LlamaDecoderLayer:
            return f"a decoder layer is {type(layer).__name__}"
        for name, cls in expected.items():
            if type(getattr(layer, name)) is not cls:
                return f"{name} is {type(getattr(layer, name)).__name__}"
        if not isinstance(layer.mlp.act_fn, _SILU):
            return f"the MLP's activation is {type(layer.mlp.act_fn).__name__}"
        for linear in (
            *_projections(layer.self_attn, "qkvo"),
            *_projections(layer.mlp, _MLP),
        ):
            kind = (type(linear), linear.weight.dtype, linear.weight.device.type)
            if kind not in _PACKABLE:
                return f"a projection is {kind[0].__name__} with {kind[1]} weights on {kind[2]}"
            kinds.add(kind)
    if len(kinds) > 1:
        return "the projections mix float32 and bf16 weights"
    if kinds and next(iter(kinds))[1] == torch.bfloat16 and not native_bf16():
        return "bf16 weights on a CPU without native bf16"
    return None


# the projections the fused forward packs: float32 ``nn.Linear``, bf16 ``Bf16WeightLinear``; on a CPU
_PACKABLE = {(nn.Linear, torch.float32, "cpu"), (Bf16WeightLinear, torch.bfloat16, "cpu")}
_MLP = ("gate", "up", "down")


def _projections(module: nn.Module, names) -> list[nn.Module]:
    return [getattr(module, f"{name}_proj") for name in names]
