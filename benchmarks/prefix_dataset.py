"""A load-test dataset for guidellm or aiperf whose questions share stored long contexts.

What those tools cannot do for this gateway is put its KV in the store first. This tool:

1. builds ``--num-contexts`` contexts of real prose, ``--context-tokens`` tokens each (or one per
   ``--context-file``);
2. pre-encodes each one into the gateway with ``POST /v1/contexts``, as a system message;
3. writes ``--questions`` questions per context, round-robin over the contexts, in the format the
   tool reads, each one a chat of the context (system) and a question (user), so that the chat's
   prefix is the stored context:

   * ``--format guidellm``: JSON lines ``{"prefix": context, "prompt": question,
     "output_tokens_count": N}``; guidellm sends ``prefix`` as the system message.
   * ``--format aiperf``: aiperf's ``multi_turn`` custom dataset, one conversation per question:
     ``{"session_id": ..., "turns": [{"role": "system", "text": context},
     {"role": "user", "text": question, "output_length": N}]}``; aiperf sends a leading system
     turn as each request's system message.

Next to the dataset it writes ``<out>.contexts.json`` (what was stored: ids, tokens, chunks, bytes,
encode time) and prints the tool's command. The load itself (arrivals, concurrency, TTFT, TPOT,
ITL, goodput under an SLO) is the tool's; commands in the README's Benchmarks section.

    python -m benchmarks.prefix_dataset --url http://localhost:8000 --format guidellm \\
        --num-contexts 4 --context-tokens 4096 --questions 16 --max-tokens 64 --out /tmp/prefix.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx

from benchmarks.workload import build_contexts, build_requests, load_tokenizer, pre_encode, served_model

FORMATS = ("guidellm", "aiperf")


def guidellm_row(context: str, question: str, max_tokens: int) -> dict[str, Any]:
    return {"prefix": context, "prompt": question, "output_tokens_count": max_tokens}


def aiperf_row(session: str, context: str, question: str, max_tokens: int) -> dict[str, Any]:
    return {
        "session_id": session,
        "turns": [
            {"role": "system", "text": context},
            {"role": "user", "text": question, "output_length": max_tokens},
        ],
    }


def dataset_rows(contexts: list[str], questions: int, max_tokens: int, fmt: str, seed: int) -> list[dict]:
    """``questions`` per context, round-robin over them (so concurrent requests spread over contexts)."""
    rows = []
    for spec in build_requests(contexts, questions * len(contexts), seed):
        context, question = (m["content"] for m in spec.messages)
        if fmt == "guidellm":
            rows.append(guidellm_row(context, question, max_tokens))
        else:
            rows.append(
                aiperf_row(f"context-{spec.context}-question-{spec.index}", context, question, max_tokens)
            )
    return rows


def tool_command(
    fmt: str, url: str, model: str, dataset: Path, tokenizer: str, count: int, concurrency: int = 4,
    report: str = "guidellm.json",
) -> str:  # fmt: skip
    """The tool's run on this dataset: ``concurrency`` streams, ``count`` requests, goodput under
    a TTFT <= 2 s and TPOT <= 200 ms SLO (the README has more options)."""
    if fmt == "guidellm":
        return (
            f"HF_HUB_OFFLINE=1 guidellm run --backend kind=openai_http,target={url},model={model} "
            f"--data kind=json_file,path={dataset} --tokenizer kind=huggingface_auto,model={tokenizer} "
            f"--profile kind=concurrent,streams={concurrency} --constraint kind=max_requests,count={count} "
            f"--metrics kind=generative,slo.ttft_ms=2000,slo.tpot_ms=200 --output kind=json,path={report}"
        )
    return (
        f"aiperf profile --model {model} --url {url} --endpoint-type chat --streaming "
        f"--tokenizer {tokenizer} --input-file {dataset} --custom-dataset-type multi_turn "
        f"--concurrency {concurrency} --request-count {count} "
        '--goodput "time_to_first_token:2000 inter_token_latency:200"'
    )


def default_tokenizer_dir() -> str:
    """The built-in model's converted directory: the tools read its tokenizer offline."""
    from engine.loading import convert_default_model, default_cache_dir

    return str(convert_default_model(default_cache_dir()))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="the gateway's base URL (no /v1)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    p.add_argument("--format", choices=FORMATS, required=True)
    p.add_argument("--out", type=Path, required=True, help="the dataset file (JSON lines)")
    p.add_argument("--num-contexts", type=int, default=4)
    p.add_argument("--context-tokens", type=int, default=2048)
    p.add_argument("--context-file", type=Path, action="append", help="a context per file (repeatable)")
    p.add_argument("--questions", type=int, default=8, help="questions per context")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens each question asks for")
    sizing = "sizes the contexts: 'default' (the built-in model), a HF id or directory, 'chars'"
    p.add_argument("--tokenizer", default="default", help=sizing)
    p.add_argument("--levels", help="comma-separated levels to pre-encode; default: the gateway's")
    p.add_argument("--seed", type=int, default=0, help="question choice")
    args = p.parse_args(argv)
    if min(args.num_contexts, args.context_tokens, args.questions, args.max_tokens) < 1:
        p.error("--num-contexts, --context-tokens, --questions and --max-tokens must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.context_file:
        contexts = [path.read_text(errors="replace") for path in args.context_file]
    else:
        contexts = build_contexts(load_tokenizer(args.tokenizer), args.num_contexts, args.context_tokens)
    levels = [s.strip() for s in args.levels.split(",")] if args.levels else None
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.url.rstrip("/")
    with httpx.Client(base_url=url, headers=headers, timeout=900.0) as client:
        model = served_model(client)
        stored = pre_encode(client, contexts, levels)
    rows = dataset_rows(contexts, args.questions, args.max_tokens, args.format, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    sidecar = args.out.with_name(args.out.name + ".contexts.json")
    sidecar.write_text(
        json.dumps({"url": url, "model": model, "format": args.format, "contexts": stored}, indent=2)
    )
    print(
        f"wrote {len(rows)} questions on {len(contexts)} stored contexts to {args.out} (and {sidecar.name})"
    )
    print("| context | tokens | chunks | MB stored (all levels) | encode s |\n|---:|---:|---:|---:|---:|")
    for c in stored:
        mb = sum((c["bytes"] or {}).values()) / 1e6
        print(f"| {c['context']} | {c['tokens']} | {c['chunks']} | {mb:.1f} | {c['encode_seconds']:.2f} |")
    tokenizer = default_tokenizer_dir() if args.tokenizer in ("default", "chars") else args.tokenizer
    print("then, for example:\n  " + tool_command(args.format, url, model, args.out, tokenizer, len(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
