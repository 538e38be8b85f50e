"""Which tokens deserve a finer step? Scheme 5's question, measured on the default model.

ZipCache and KVzip give tokens different importance; this study asks how
much that is worth on top of the transform levels, and which signal an
encoder that sees only the KV can use. Per layer, a fraction of the tokens
is quantized with the level's steps times ``fine`` and the rest times
``coarse``, chosen by one of these signals:

- ``oracle``: the attention the continuation's own queries give each prefix
  token (summed over heads and queries). No encoder knows it.
- ``prefix-attention``: the attention each token gets from every 8th query
  of the prefix after it, over the number of those queries (ZipCache's
  normalized score). An encoder that ran the prefill could know it.
- ``key-energy``: the sum of squares of the token's key coefficients in the
  transform's weighted units (keys in units of logit error). An encoder
  knows it from the KV alone; scheme 5 uses it.
- ``value-energy``: the same for values.
- ``uniform``: no token finer (the level itself, at ``scale``).

Tokens are picked per 256-token chunk (as the codec does) or over the whole
prefix (``@context``). Everything else is ``benchmarks.transform_study``'s:
coefficients quantized in floating point, the size estimated from the
symbols under the codec's rANS bank (it reads about 10% above the real
codec's bytes), the sinks exact, quality on held-out text against the exact
prefix. Methods are ``signal:scale:fraction:fine:coarse``.

    python -m benchmarks.salient_study --level low
"""

from __future__ import annotations

import argparse
import json
import math
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

from benchmarks.transform_study import CHUNK_TOKENS, coded_bits

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_METHODS = (
    "uniform:1:0:1:1,uniform:0.8:0:1:1,uniform:1.25:0:1:1,"
    "oracle:1:0.1:0.5:1.15,prefix-attention:1:0.1:0.5:1.15,key-energy:1:0.1:0.5:1.15,"
    "value-energy:1:0.1:0.5:1.15,key-energy@context:1:0.1:0.5:1.15,key-energy:1.1:0.05:0.4:1.1"
)
PROBE_EVERY = 8  # prefix-attention: every 8th query of the prefix


def attention_signals(runner, ids: list[int], prefix: int) -> dict[str, np.ndarray]:
    """(layers, prefix) attention received per prefix token: from the continuation's queries
    (``oracle``) and from every ``PROBE_EVERY``-th prefix query, normalized (``prefix-attention``)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    hf = runner.model
    cfg = hf.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    dim = cfg.hidden_size // heads
    captured: dict[tuple[str, int], list[torch.Tensor]] = {}

    def hook(name: tuple[str, int]):
        return lambda module, inputs, out: captured.setdefault(name, []).append(out.detach()[0])

    hooks = []
    for i, layer in enumerate(hf.model.layers):
        hooks.append(layer.self_attn.q_proj.register_forward_hook(hook(("q", i))))
        hooks.append(layer.self_attn.k_proj.register_forward_hook(hook(("k", i))))
    try:
        with runner.transformers_forward():  # the hooks are on the model's own modules
            runner.compute_kv(ids)
    finally:
        for h in hooks:
            h.remove()
    n = len(ids)
    cos, sin = hf.model.rotary_emb(torch.zeros(1, n, dim), torch.arange(n)[None])
    probes = torch.arange(PROBE_EVERY - 1, prefix, PROBE_EVERY)
    seen = (probes[None, :] >= torch.arange(prefix)[:, None]).sum(dim=1).clamp(min=1).double()
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    layers = len(hf.model.layers)
    out = {"oracle": np.zeros((layers, prefix)), "prefix-attention": np.zeros((layers, prefix))}
    for i in range(layers):
        q = torch.cat(captured[("q", i)]).view(n, heads, dim).transpose(0, 1)[None]
        k = torch.cat(captured[("k", i)]).view(n, kv_heads, dim).transpose(0, 1)[None]
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = k[0].repeat_interleave(heads // kv_heads, dim=0)
        w = torch.softmax((q[0] @ k.transpose(1, 2) / math.sqrt(dim)).masked_fill(~causal, -math.inf), -1)
        out["oracle"][i] = w[:, prefix:, :prefix].sum(dim=(0, 1)).numpy()
        out["prefix-attention"][i] = (w[:, probes, :prefix].sum(dim=(0, 1)).double() / seen).numpy()
    return out


def energy(transform, kv: torch.Tensor, side: int) -> np.ndarray:
    """(layers, tokens): each token's key (side 0) or value energy, as scheme 5's encoder reads it
    (``codec.transformed.coefficient_energy``), chunk by chunk."""
    from codec.transformed import coefficient_energy

    x = kv.numpy()
    out = np.zeros((x.shape[0], x.shape[3]))
    for c0 in range(0, x.shape[3], CHUNK_TOKENS):
        coefficients = transform.forward(x[:, :, :, c0 : c0 + CHUNK_TOKENS], c0)
        out[:, c0 : c0 + CHUNK_TOKENS] = coefficient_energy(coefficients, side)
    return out


def multipliers(
    signal: np.ndarray, fraction: float, fine: float, coarse: float, sinks: int, per_chunk: bool
) -> np.ndarray:
    """(layers, tokens) step multipliers: ``fine`` for the top ``fraction`` of ``signal`` per layer
    (per chunk, or over the prefix), ``coarse`` elsewhere; the sinks are not candidates."""
    m = np.full(signal.shape, coarse)
    spans = (
        [(max(c0, sinks), c0 + CHUNK_TOKENS) for c0 in range(0, signal.shape[1], CHUNK_TOKENS)]
        if per_chunk
        else [(sinks, signal.shape[1])]
    )
    for lo, hi in spans:
        part = signal[:, lo:hi]
        k = math.ceil(fraction * part.shape[1] - 1e-9)
        if k:
            np.put_along_axis(m, np.argsort(-part, axis=1)[:, :k] + lo, fine, axis=1)
    return m


def code(
    transform, base: np.ndarray, sinks: int, kv: torch.Tensor, scale: float, mult: np.ndarray | None
) -> tuple[torch.Tensor, float]:
    """The prefix KV quantized with ``base`` (layers, 2) steps x ``scale`` x per-token ``mult``;
    and its estimated bits per value."""
    x = kv.numpy()
    out = x.copy()
    bits = 16.0 * x[:, :, :, :sinks].size
    for c0 in range(0, x.shape[3], CHUNK_TOKENS):
        start, end = max(c0, sinks), min(c0 + CHUNK_TOKENS, x.shape[3])
        co = transform.forward(x[:, :, :, start:end], start)
        layers, _, heads, tokens, dim = co.shape
        rec = np.empty_like(co)
        for layer in range(layers):
            m = mult[layer, start:end][:, None] if mult is not None else 1.0
            for side in range(2):
                y = co[layer, side].transpose(1, 0, 2).reshape(tokens, heads * dim).astype(np.float64)
                step = base[layer, side] * scale * m
                q = np.rint(y / step)
                bits += coded_bits(torch.from_numpy(q))
                rec[layer, side] = (q * step).reshape(tokens, heads, dim).transpose(1, 0, 2)
        coefficients = torch.from_numpy(rec.astype(np.float32)).contiguous()
        transform.inverse_(coefficients, start, bf16=False)
        out[:, :, :, start:end] = coefficients.numpy()
    return torch.from_numpy(out), bits / x.size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--level", default="low", help="a transform level of the table: its steps are the base")
    p.add_argument("--levels-file", type=Path, help="default: the shipped table")
    p.add_argument("--texts", type=int, default=4)
    p.add_argument("--prefix-tokens", type=int, default=2048)
    p.add_argument("--continuation-tokens", type=int, default=256)
    p.add_argument(
        "--methods", default=DEFAULT_METHODS, help="signal:scale:fraction:fine:coarse, comma-separated"
    )
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "salient_study.json")
    args = p.parse_args()

    from benchmarks.codec_quality import benchmark_texts
    from codec import DEFAULT_LEVELS, load_level_table
    from codec.transformed import TransformParams, group_steps
    from engine import ModelRunner, load_model
    from engine.quality import continuation_quality, reference_continuation

    torch.manual_seed(0)
    levels = (
        load_level_table(json.loads(args.levels_file.read_text()), args.levels_file.parent)
        if args.levels_file
        else DEFAULT_LEVELS
    )
    params = next(lv.quant for lv in levels if lv.name == args.level)
    if not isinstance(params, TransformParams):
        p.error(f"level {args.level} is not a transform level")
    transform, sinks = params.transform, params.sink_tokens
    base = group_steps(params, transform.layers)
    runner = ModelRunner(load_model("smollm2", dtype="float32"))
    need = args.prefix_tokens + args.continuation_tokens
    cases = []
    for text in benchmark_texts().values():
        ids = runner.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= need:
            ref = reference_continuation(runner, ids[:need], args.prefix_tokens)
            signals = attention_signals(runner, ids[:need], args.prefix_tokens)
            signals["key-energy"] = energy(transform, ref.prefix_kv, 0)
            signals["value-energy"] = energy(transform, ref.prefix_kv, 1)
            cases.append((ref, signals))
        if len(cases) == args.texts:
            break

    rows = []
    columns = ("bits*", "dPPL", "top-1", "KL")
    print(f"{'method (signal:scale:fraction:fine:coarse)':<44} " + " ".join(f"{c:>7}" for c in columns))
    for method in args.methods.split(","):
        signal, scale, fraction, fine, coarse = method.split(":")
        name, _, scope = signal.partition("@")
        per = []
        for ref, signals in cases:
            mult = None
            if name != "uniform":
                chunked = scope != "context"
                mult = multipliers(signals[name], float(fraction), float(fine), float(coarse), sinks, chunked)
            kv, bits = code(transform, base, sinks, ref.prefix_kv, float(scale), mult)
            q = continuation_quality(runner, ref, kv)
            per.append({"bits": bits, "ppl_change": q.ppl_change, "top1": q.top1, "kl": q.kl})
        row = {"method": method, **{k: float(np.mean([r[k] for r in per])) for k in per[0]}}
        rows.append(row)
        print(
            f"{method:<44} {row['bits']:>7.3f} {row['ppl_change']:>+7.2%} {row['top1']:>7.3f} "
            f"{row['kl']:>7.4f}",
            flush=True,
        )
    print("* estimated from the symbols' cost under the rANS bank: about 10% above the codec's bytes")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "when": datetime.now().isoformat(timespec="seconds"),
                "model": runner.loaded.name,
                "level": args.level,
                "args": {k: str(v) for k, v in vars(args).items()},
                "texts": len(cases),
                "results": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
