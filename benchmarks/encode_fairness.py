"""Does one tenant's burst of pre-encodes slow another tenant's chat? (issue 19, finding 3)

Starts a gateway with two API keys on a fresh local store, twice: with the
per-tenant limit (the defaults: 2 pre-encodes a tenant, 2 encode threads) and
without it (8 and 8, which admits the whole burst, as before the limit). In
each, tenant B's short chat is timed idle, then while tenant A keeps
``--encodes`` pre-encodes of ``--tokens`` tokens in flight (a client that
retries after ``Retry-After`` when refused, as an OpenAI client does), for
``--duration`` seconds. Writes JSON (``--out``) and prints a table.

    python -m benchmarks.encode_fairness --out benchmarks/results/encode_fairness.json
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from tests.gateway_process import GatewayProcess

MODEL = "SmolLM2-135M-Instruct"
KEY_A, KEY_B = "fairness-tenant-a", "fairness-tenant-b"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8}
CONFIGS = {
    "limited": {},
    "unlimited": {"CACHEGEN_MAX_ENCODES_PER_TENANT": "8", "CACHEGEN_ENCODE_THREADS": "8"},
}


def chat_seconds(url: str) -> float:
    started = time.perf_counter()
    r = httpx.post(
        f"{url}/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {KEY_B}"}, timeout=300
    )
    r.raise_for_status()
    return time.perf_counter() - started


class Encoder(threading.Thread):
    """Tenant A's client: pre-encodes fresh contexts until told to stop, honouring 429s."""

    def __init__(self, url: str, tokens: int, seed: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.url, self.tokens, self.rng, self.stop = url, tokens, random.Random(seed), stop
        self.encoded = self.refused = 0

    def run(self) -> None:
        while not self.stop.is_set():
            ids = [self.rng.randrange(100, 49000) for _ in range(self.tokens)]
            r = httpx.post(
                f"{self.url}/contexts",
                json={"prompt_token_ids": ids},
                headers={"Authorization": f"Bearer {KEY_A}"},
                timeout=600,
            )
            if r.status_code == 429:
                self.refused += 1
                self.stop.wait(float(r.headers.get("Retry-After", "1")))
            else:
                r.raise_for_status()
                self.encoded += 1


def measure(name: str, env_extra: dict[str, str], args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = {"CACHEGEN_STORE": f"file://{tmp}/store", "CACHEGEN_API_KEY": f"{KEY_A},{KEY_B}", **env_extra}
        with GatewayProcess(env, Path(tmp) / "gateway.log") as gw:
            for _ in range(3):
                chat_seconds(gw.url)  # warm up
            idle = [chat_seconds(gw.url) for _ in range(args.idle_trials)]
            stop = threading.Event()
            encoders = [Encoder(gw.url, args.tokens, seed, stop) for seed in range(args.encodes)]
            for e in encoders:
                e.start()
            time.sleep(2.0)  # the burst is in flight
            loaded: list[float] = []
            deadline = time.monotonic() + args.duration
            while time.monotonic() < deadline:
                loaded.append(chat_seconds(gw.url))
            stop.set()
            for e in encoders:
                e.join()
    idle_median = float(np.median(idle))
    return {
        "config": name,
        "env": env_extra,
        "idle_s": idle,
        "loaded_s": loaded,
        "idle_median_s": idle_median,
        "loaded_median_s": float(np.median(loaded)),
        "loaded_p90_s": float(np.percentile(loaded, 90)),
        "loaded_max_s": float(np.max(loaded)),
        "median_ratio": float(np.median(loaded)) / idle_median,
        "p90_ratio": float(np.percentile(loaded, 90)) / idle_median,
        "encoded": sum(e.encoded for e in encoders),
        "refused": sum(e.refused for e in encoders),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--encodes", type=int, default=8, help="tenant A's pre-encodes kept in flight")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of each pre-encoded context")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load per configuration")
    parser.add_argument("--idle-trials", type=int, default=10)
    parser.add_argument("--config", choices=sorted(CONFIGS), action="append", help="default: both")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/encode_fairness.json"))
    args = parser.parse_args()
    rows = [measure(name, CONFIGS[name], args) for name in args.config or CONFIGS]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": rows}, indent=2)
    )
    print(
        f"tenant B's short chat while tenant A keeps {args.encodes} pre-encodes of {args.tokens} tokens in flight"
    )
    print(
        f"{'config':<10} {'idle med':>9} {'load med':>9} {'load p90':>9} {'load max':>9} {'med/idle':>9} "
        f"{'p90/idle':>9} {'encoded':>8} {'429s':>6}"
    )
    for r in rows:
        print(
            f"{r['config']:<10} {r['idle_median_s']:>9.2f} {r['loaded_median_s']:>9.2f} {r['loaded_p90_s']:>9.2f} "
            f"{r['loaded_max_s']:>9.2f} {r['median_ratio']:>9.2f} {r['p90_ratio']:>9.2f} {r['encoded']:>8} "
            f"{r['refused']:>6}"
        )


if __name__ == "__main__":
    main()
