"""The model's own quality at each precision, against float32, on the codec benchmark's texts.

Per text (``benchmarks.codec_quality``'s held-out prose, the first
``--tokens`` tokens): perplexity, and how often the most likely next token
is float32's. What ``CACHEGEN_DTYPE=auto`` gives on a CPU with native bf16
(``bf16-weights``) is measured beside the whole model in bf16 (what vLLM's
bf16 runs), in one run.

    python -m benchmarks.precision_quality --dtypes float32,bf16-weights,bfloat16
"""

from __future__ import annotations

import argparse
import json
import math
from datetime import datetime
from pathlib import Path

import torch

from benchmarks.codec_quality import benchmark_texts

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def measure(
    dtype: str, texts: dict[str, str], tokens: int
) -> tuple[str, dict[str, tuple[float, torch.Tensor]]]:
    """The precision ``dtype`` loads as here (``LoadedModel.precision``: AMX adds bf16 attention
    and MLP activations to bf16 weights), and per text: (perplexity, each position's most likely
    next token)."""
    from engine import ModelRunner, load_model

    runner = ModelRunner(load_model(dtype=dtype))
    out = {}
    for name, text in texts.items():
        ids = runner.tokenizer(text)["input_ids"][:tokens]
        logits = runner.prefill(ids, want_prompt_logits=True).prompt_logits
        assert logits is not None
        logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
        nll = -logprobs.gather(1, torch.tensor(ids[1:])[:, None]).mean().item()
        out[name] = (math.exp(nll), logits.argmax(-1))
    return runner.loaded.precision, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="float32,bf16-weights,bfloat16", help="the first is the reference")
    p.add_argument("--tokens", type=int, default=2304, help="tokens of each text")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    texts = benchmark_texts()
    dtypes = args.dtypes.split(",")
    precisions, measured = {}, {}
    for dtype in dtypes:
        precisions[dtype], measured[dtype] = measure(dtype, texts, args.tokens)
    reference = measured[dtypes[0]]
    rows = []
    for dtype in dtypes[1:]:
        for name in texts:
            ppl, top = measured[dtype][name]
            base_ppl, base_top = reference[name]
            rows.append(
                {
                    "dtype": dtype,
                    "text": name,
                    "perplexity": round(ppl, 4),
                    "reference_perplexity": round(base_ppl, 4),
                    "perplexity_change_pct": round((ppl / base_ppl - 1) * 100, 3),
                    "top1_agreement": round((top == base_top).float().mean().item(), 4),
                }
            )
    out = args.out or RESULTS_DIR / f"precision_quality_{datetime.now():%Y%m%d_%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"reference": dtypes[0], "precisions": precisions, "tokens": args.tokens, "rows": rows}, indent=2
        )
    )
    print(f"\n| precision | text | perplexity | {dtypes[0]} | change | top-1 agreement |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['dtype']} | {r['text']} | {r['perplexity']:.3f} | {r['reference_perplexity']:.3f} | "
            f"{r['perplexity_change_pct']:+.2f}% | {r['top1_agreement']:.3f} |"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
