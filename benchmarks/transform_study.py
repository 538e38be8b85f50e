"""Issue 18's first question, measured: how far does transform coding take this model's KV?

A study, not the codec: it quantizes in floating point and estimates the size
from the symbols' entropy, to find which transform and allocation are worth
building into a format 5. Everything runs on the default model (135M
parameters; small models break sooner than the 7B-class models the
literature reports on).

- **Calibration** (the level calibration's texts, ``app.calibrate``): per
  layer and K/V, the mean and a PCA basis of the KV vectors over every KV head
  and channel (``kv_heads x head_dim`` values a token), in a weighted space:
  keys are scaled per channel by the RMS of the queries that read them
  (``engine.quality.query_channel_rms``: a key error moves a logit by
  ``q . dk``), values by their head's RMS, the units of the codec's steps.
- **Coding** (held-out texts, ``benchmarks.codec_quality``'s): the prefix's
  coefficients are quantized with one uniform step per (layer, K/V), the
  codec's per-layer steps (from the level table's measured sensitivity,
  ``app.calibrate.layer_steps``) times a global scale that is swept. One
  step for every component of a group is the rate-distortion optimum for
  entropy-coded scalar quantization at high rate: components smaller than
  the step get no bits, the others the same distortion (reverse
  water-filling), the allocation KVTC solves with dynamic programming. The
  first ``--sink-tokens`` tokens (attention sinks) stay exact.
- **Size**: what the codec's own entropy coder would spend: per 256-token
  chunk and component, a centre and the table of the rANS bank
  (``codec/entropy_model.py``) under which its residuals cost the fewest
  bits, escapes included, plus 24 bits of side info; the sinks at 16 bits.
  Bits per KV value, as the levels count.
- **Quality**: the continuation's perplexity change and top-1 agreement on
  top of the decoded prefix, against the exact prefix
  (``engine.quality.continuation_quality``).

Variants: ``pca`` (one basis over the heads, keys after RoPE),
``pca-prerope`` (keys rotated back to before RoPE first, and rotated again
after decoding), ``pca-prerope-perhead`` (the same with one basis per KV
head), ``channels`` (the same quantizer and size count on the raw channels:
what the transform adds), and the codec's own levels, real bytes, in the
same run. Prints the rate-distortion table and,
for issue 18's targets, the fewest bits that meet each; writes JSON.

    python -m benchmarks.transform_study
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
CHUNK_TOKENS = 256
SIDE_BITS = 24  # per component and chunk: a table index (u8) and a centre (i16), as scheme 2's side info
# issue 18's targets: (name, most bits per value, worst dPPL, least top-1)
TARGETS = (
    ("high: dPPL <= 0.5%, top-1 >= 0.98", 3.0, 0.005, 0.98),
    ("medium: dPPL <= 1.5%, top-1 >= 0.93", 1.3, 0.015, 0.93),
    ("low: dPPL <= 6%", 0.8, 0.06, 0.0),
)


class Transform:
    """Per (layer, K/V): the mean, the weights and the PCA basis of the weighted KV vectors."""

    def __init__(
        self,
        kv: torch.Tensor,
        key_weight: torch.Tensor,
        sinks: int,
        pca: bool,
        rope=None,
        per_head: bool = False,
    ) -> None:
        layers, _, heads, _, dim = kv.shape
        self.shape = (heads, dim)
        self.rope = rope  # (cos, sin) of every position: keys are then coded before rotary embedding
        self.sinks = sinks
        x = self._vectors(kv[:, :, :, sinks:])  # (layers, 2, tokens, heads * dim)
        # keys in units of logit error (as the codec's key steps), values in units of their head's RMS
        self.weight = torch.ones(layers, 2, heads * dim, dtype=torch.float64)
        self.weight[:, 0] = key_weight.reshape(layers, heads * dim)
        values = kv[:, 1, :, sinks:].double()  # (layers, heads, tokens, dim)
        head_rms = values.square().mean(dim=(2, 3)).sqrt()  # (layers, heads)
        self.weight[:, 1] = (
            (1.0 / head_rms)[:, :, None].expand(layers, heads, dim).reshape(layers, heads * dim)
        )
        self.mean = x.mean(dim=2)
        y = (x - self.mean[:, :, None]) * self.weight[:, :, None]
        if pca and per_head:  # one basis per KV head: block-diagonal over the heads
            self.basis = torch.zeros(layers, 2, heads * dim, heads * dim, dtype=torch.float64)
            for h in range(heads):
                part = y[..., h * dim : (h + 1) * dim]
                _, vectors = torch.linalg.eigh(part.transpose(2, 3) @ part / part.shape[2])
                self.basis[..., h * dim : (h + 1) * dim, h * dim : (h + 1) * dim] = vectors.flip(-1)
        elif pca:
            cov = y.transpose(2, 3) @ y / y.shape[2]
            _, vectors = torch.linalg.eigh(cov)  # ascending
            self.basis = vectors.flip(-1)
        else:
            self.basis = torch.eye(heads * dim, dtype=torch.float64).expand(layers, 2, -1, -1)

    def forward(self, kv: torch.Tensor) -> torch.Tensor:
        """(layers, 2, tokens, components) coefficients of the tokens after the sinks of ``kv``."""
        return ((self._vectors(kv) - self.mean[:, :, None]) * self.weight[:, :, None]) @ self.basis

    def inverse(self, coefficients: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        x = (coefficients @ self.basis.transpose(2, 3)) / self.weight[:, :, None] + self.mean[:, :, None]
        layers, _, tokens, _ = x.shape
        heads, dim = self.shape
        out = x.reshape(layers, 2, tokens, heads, dim).transpose(2, 3)
        if self.rope is not None:
            out[:, 0] = _rotate(out[:, 0], *self._angles(tokens), inverse=False)
        return out.to(like.dtype)

    def _angles(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rope
        return cos[self.sinks : self.sinks + tokens], sin[self.sinks : self.sinks + tokens]

    def _vectors(self, kv: torch.Tensor) -> torch.Tensor:
        """(layers, 2, heads, tokens, dim) -> (layers, 2, tokens, heads * dim), float64; keys
        rotated back to before rotary embedding when coded there."""
        layers, _, heads, tokens, dim = kv.shape
        x = kv.double()
        if self.rope is not None:
            x = x.clone()
            x[:, 0] = _rotate(x[:, 0], *self._angles(tokens), inverse=True)
        return x.transpose(2, 3).reshape(layers, 2, tokens, heads * dim)


def _rotate(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """Rotary embedding of ``keys`` (..., tokens, dim) at angles (tokens, dim), or its inverse."""
    half = keys.shape[-1] // 2
    rotated = torch.cat([-keys[..., half:], keys[..., :half]], dim=-1)
    return keys * cos + rotated * (-sin if inverse else sin)


def coded_bits(symbols: torch.Tensor) -> float:
    """Bits to code ``symbols`` (tokens, components) as the codec's scheme 2 codes a chunk's
    channels: per component a centre and the table of the rANS bank under which its residuals
    cost the fewest bits (escapes included), plus ``SIDE_BITS`` of side info."""
    from codec.entropy_model import bank
    from codec.rans import ALPHABET, BIAS

    cost = torch.from_numpy(bank().cost)  # (tables, ALPHABET + 1): the last column is an escape
    s = symbols.to(torch.int64)
    residual = s - s.median(dim=0).values
    index = torch.where(residual.abs() <= BIAS, residual + BIAS, ALPHABET)
    columns = s.shape[1]
    counts = torch.bincount(
        (index + torch.arange(columns) * (ALPHABET + 1)).flatten(), minlength=columns * (ALPHABET + 1)
    )
    per_table = counts.reshape(columns, ALPHABET + 1).double() @ cost.T  # (components, tables)
    return float(per_table.min(dim=1).values.sum()) + SIDE_BITS * columns


def code(transform: Transform, kv: torch.Tensor, steps: torch.Tensor, sinks: int):
    """The prefix KV after quantization with ``steps`` (layers, 2), and its size in bits per value."""
    coefficients = transform.forward(kv[:, :, :, sinks:])
    steps = steps.double()[:, :, None, None]
    symbols = torch.round(coefficients / steps)
    bits = 16.0 * kv[:, :, :, :sinks].numel()
    for start in range(0, symbols.shape[2], CHUNK_TOKENS):
        chunk = symbols[:, :, start : start + CHUNK_TOKENS]
        for layer in range(chunk.shape[0]):
            for kind in range(2):
                bits += coded_bits(chunk[layer, kind])
    out = kv.clone()
    out[:, :, :, sinks:] = transform.inverse(symbols * steps, kv)
    return out, bits / kv.numel()


def rotary_angles(runner, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's rotary (cos, sin) at positions 0..tokens-1: (tokens, head_dim) each, float64."""
    probe = torch.zeros(1, tokens, runner.head_dim)
    cos, sin = runner.model.model.rotary_emb(probe, torch.arange(tokens)[None])
    return cos[0].double(), sin[0].double()


def meets(row: dict, target: tuple) -> bool:
    """Whether ``row`` has the quality ``target`` asks for (its bits are compared apart)."""
    _, _, ppl, top1 = target
    return row["ppl_change"] <= ppl and row["top1"] >= top1


def target_table(results: list[dict]) -> dict:
    """Per target and method family: the fewest bits among the swept points with its quality."""
    print("\nissue 18's targets: the fewest bits with each target's quality, per method")
    print(f"  {'target':<50} {'method':<12} {'bits':>6} {'limit':>6}  point")
    best = {}
    for target in TARGETS:
        for family in ("level", "pca", "pca-prerope", "pca-prerope-perhead", "channels"):
            fits = [r for r in results if r["method"].split(" ")[0] == family and meets(r, target)]
            pick = min(fits, key=lambda r: r["bits"]) if fits else None
            best[f"{target[0]} / {family}"] = pick
            bits = f"{pick['bits']:.2f}" if pick else "-"
            point = (
                f"{pick['method']} (dPPL {pick['ppl_change']:+.2%}, top-1 {pick['top1']:.3f})"
                if pick
                else "none swept"
            )
            print(f"  {target[0]:<50} {family:<12} {bits:>6} {target[1]:>6}  {point}")
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calibration-tokens", type=int, default=4096)
    p.add_argument("--prefix-tokens", type=int, default=2048)
    p.add_argument("--continuation-tokens", type=int, default=256)
    p.add_argument("--texts", type=int, default=2, help="held-out texts, averaged")
    p.add_argument("--sink-tokens", type=int, default=4)
    p.add_argument("--scales", default="0.1,0.2,0.35,0.5,0.8,1.2,1.8,2.5", help="global scales swept")
    p.add_argument("--variants", help="a comma-separated subset of the transforms (default: all)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "transform_study.json")
    args = p.parse_args()

    from app.calibrate import calibration_tokens, default_texts, layer_steps
    from benchmarks.codec_quality import benchmark_texts, level_method
    from codec import DEFAULT_LEVELS
    from codec.levels import default_level_table
    from engine import ModelRunner, load_model
    from engine.quality import continuation_quality, query_channel_rms, reference_continuation

    torch.manual_seed(0)
    runner = ModelRunner(load_model("smollm2", dtype="float32"))
    calib = calibration_tokens(runner, default_texts(), args.calibration_tokens)
    calib_kv = runner.compute_kv(calib)
    key_weight = torch.from_numpy(query_channel_rms(runner, calib))
    # the level table's per-layer sensitivity sets each (layer, K/V)'s step at scale 1, as the codec's
    sensitivity = np.array(default_level_table()["calibration"]["sensitivity_kl"])
    base_steps = torch.from_numpy(np.stack(layer_steps(sensitivity), axis=1))
    rope = rotary_angles(runner, max(len(calib), args.prefix_tokens))
    transforms = {
        "pca": Transform(calib_kv, key_weight, args.sink_tokens, pca=True),
        "pca-prerope": Transform(calib_kv, key_weight, args.sink_tokens, pca=True, rope=rope),
        "pca-prerope-perhead": Transform(
            calib_kv, key_weight, args.sink_tokens, pca=True, rope=rope, per_head=True
        ),
        "channels": Transform(calib_kv, key_weight, args.sink_tokens, pca=False),
    }
    if args.variants:
        transforms = {name: transforms[name] for name in args.variants.split(",")}
    need = args.prefix_tokens + args.continuation_tokens
    refs = []
    for text in benchmark_texts().values():
        ids = runner.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= need:
            refs.append(reference_continuation(runner, ids[:need], args.prefix_tokens))
        if len(refs) == args.texts:
            break

    def score(method: str, fn) -> dict:
        rows = []
        for ref in refs:
            kv, bits = fn(ref.prefix_kv)
            q = continuation_quality(runner, ref, kv)
            rows.append({"bits": bits, "ppl_change": q.ppl_change, "top1": q.top1})
        row = {"method": method, **{k: float(np.mean([r[k] for r in rows])) for k in rows[0]}}
        print(
            f"{method:<28} {row['bits']:>6.2f} bits  dPPL {row['ppl_change']:+7.2%}  top-1 {row['top1']:.3f}"
        )
        return row

    results = [score(f"level {lv.name}", level_method(lv)) for lv in DEFAULT_LEVELS if not lv.lossless]
    for name, transform in transforms.items():
        for scale in (float(s) for s in args.scales.split(",")):
            steps = base_steps * scale
            row = score(
                f"{name} scale {scale:g}", lambda kv, t=transform, s=steps: code(t, kv, s, args.sink_tokens)
            )
            results.append({**row, "variant": name, "scale": scale})

    best = target_table(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "when": datetime.now().isoformat(timespec="seconds"),
                "model": runner.loaded.name,
                "args": {k: str(v) for k, v in vars(args).items()},
                "texts": len(refs),
                "results": results,
                "targets": best,
            },
            indent=2,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
