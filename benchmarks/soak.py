"""Soak test: a mixed workload against a gateway on SeaweedFS, with faults on a schedule; checks at the end.

The gateway reaches S3 through the link proxy, with write-back on, a store cap
and the garbage collector running. Clients pick, at random:

- a question on one of the live pre-encoded contexts (streamed or not, lossless
  reuse): its greedy answer must equal a full prefill's, taken at the start;
- a short chat with no context;
- a streamed question that disconnects after its first event;
- a pre-encode of a new context that is then deleted;
- a pre-encode with a 5 s TTL, left to expire and be collected.

Every ``--fault-every`` seconds the next fault of the cycle is injected:
SeaweedFS killed (SIGKILL) and restarted, a chunk of a live context
overwritten with garbage, a chunk of a live context deleted, the link to S3
stalled for 5 s.

Checks at the end: no wrong answer; no 5xx but the documented
``kv_store_unavailable`` 503s; no request past its timeout (a hung stream);
RSS flat after warm-up; the store within its cap; every live context whole
and fully reused again (write-back repairs the full chunks the faults broke;
a tail that was hit needs the re-POST that follows, which encodes only what
is missing; the report shows both); every deleted or expired context gone,
manifest and chunks.

    python -m benchmarks.soak --duration 1800 --out benchmarks/results/soak.json --plot benchmarks/results/soak.png

``tests/integration/test_soak.py`` runs two minutes of it.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.link_proxy import LinkProxy
from scheduler.layout import chunk_dir, manifest_key
from tests.gateway_process import GatewayProcess
from tests.support.seaweed import SeaweedServer

MODEL = "SmolLM2-135M-Instruct"
TEXT = (Path(__file__).resolve().parents[1] / "tests" / "data" / "python_history.txt").read_text()
QUESTIONS = ["Who created Python?", "What is this text about?", "Name one version of Python."]
ANSWER_TOKENS = 8
DOCUMENTED_5XX = {"503:kv_store_unavailable"}
TIMEOUT_S = 120.0
FAULTS = ("seaweed_restart", "chunk_corrupt", "chunk_delete", "s3_stall")
CAP_BYTES = 512 * 1024 * 1024
RSS_SLOPE_MIB_PER_MIN = 30.0  # "about zero" over a long run: allocator noise stays under this
PREFIX = "soak"


def document(tag: str, chars: int = 2400) -> str:
    """A context of about 600 tokens whose first chunk, and so every key, is its own."""
    return f"Document {tag}.\n{TEXT[:chars]}"


def messages(context: str, question: str) -> list[dict]:
    return [{"role": "system", "content": context}, {"role": "user", "content": question}]


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: Counter = field(default_factory=Counter)  # by kind
    errors: Counter = field(default_factory=Counter)  # "status:code"
    wrong: list = field(default_factory=list)
    hangs: int = 0
    faults: Counter = field(default_factory=Counter)
    rss: list = field(default_factory=list)  # (seconds since start, MiB)
    deleted: list = field(default_factory=list)  # context ids
    expiring: list = field(default_factory=list)  # context ids with a TTL

    def count(self, kind: str, response: httpx.Response | None = None) -> None:
        with self.lock:
            self.requests[kind] += 1
            if response is not None and response.status_code >= 400:
                try:
                    code = response.json()["error"]["code"]
                except (ValueError, KeyError, TypeError):
                    code = "none"
                self.errors[f"{response.status_code}:{code}"] += 1


class Soak:
    def __init__(
        self,
        duration_s: float,
        clients: int,
        fault_every_s: float,
        workdir: Path,
        seed: int = 0,
        rss_slope_limit: float = RSS_SLOPE_MIB_PER_MIN,
    ):
        self.rss_slope_limit = rss_slope_limit  # MiB per minute over the run's second half
        self.duration_s = duration_s
        self.clients = clients
        self.fault_every_s = fault_every_s
        self.workdir = workdir
        self.rng = random.Random(seed)
        self.tally = Tally()
        self.live: dict[str, str] = {}  # context id -> its text
        self.live_cached: dict[str, int] = {}  # context id -> tokens its pre-encode stored
        self.chunk_keys: dict[str, list[str]] = {}  # deleted or expiring context id -> its chunk keys
        self.references: dict[tuple[str, str], str] = {}  # (context id, question) -> full prefill's answer
        self._stop = threading.Event()
        self._checked = threading.Event()
        self._serial = 0
        self._serial_lock = threading.Lock()

    # -- the run -----------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        with SeaweedServer(self.workdir / "seaweed") as weed:
            self.weed = weed
            self.bucket = weed.create_bucket()
            host, port = weed.endpoint_url.removeprefix("http://").split(":")
            with LinkProxy(target=(host, int(port)), rate_bps="10gbit") as link:
                self.link = link
                env = {
                    **weed.env(),
                    "AWS_ENDPOINT_URL": link.url,
                    "CACHEGEN_STORE": f"s3://{self.bucket}/{PREFIX}",
                    "CACHEGEN_STORE_CACHE_BYTES": "0",  # every read goes to S3, where the faults are
                    "CACHEGEN_PREFIX_CACHE": "false",
                    "CACHEGEN_WRITE_BACK": "true",
                    "CACHEGEN_STORE_MAX_BYTES": str(CAP_BYTES),
                    "CACHEGEN_GC_INTERVAL_S": "5",
                    "CACHEGEN_GC_GRACE_S": "5",
                }
                with GatewayProcess(env, self.workdir / "gateway.log") as gateway:
                    self.url = gateway.url
                    self.pid = gateway.proc.pid if gateway.proc else 0
                    self._set_up()
                    started = time.monotonic()
                    threads = [threading.Thread(target=self._client, args=(i,)) for i in range(self.clients)]
                    threads.append(threading.Thread(target=self._sample_rss))
                    faults = threading.Thread(target=self._faults)
                    for thread in [*threads, faults]:
                        thread.start()
                    self._stop.wait(self.duration_s)
                    self._stop.set()
                    for thread in threads:
                        thread.join(TIMEOUT_S + 30)
                    elapsed = time.monotonic() - started
                    try:
                        checks = self._final_checks()
                    finally:
                        self._checked.set()
                        faults.join()
        return self._report(elapsed, checks)

    def _set_up(self) -> None:
        with httpx.Client(base_url=self.url, timeout=600) as client:
            for n in range(3):
                text = document(f"live-{n}")
                r = client.post("/contexts", json={"messages": [{"role": "system", "content": text}]})
                r.raise_for_status()
                self.live[r.json()["id"]] = text
                self.live_cached[r.json()["id"]] = r.json()["cached_tokens"]
            for context_id, text in self.live.items():
                for question in QUESTIONS:
                    full = self._answer(client, text, question, {"kv_cache": False})
                    reused = self._answer(client, text, question, {"kv_quality": "lossless"})
                    if full == reused:  # a near-tie that flips between the two is not a fair check
                        self.references[(context_id, question)] = full

    def _answer(self, client: httpx.Client, text: str, question: str, extra: dict) -> str:
        body = {"model": MODEL, "messages": messages(text, question), "max_tokens": ANSWER_TOKENS,
                "temperature": 0, **extra}  # fmt: skip
        r = client.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        return r.json()["choices"][0]["message"]["content"]

    # -- clients -----------------------------------------------------------------------------------

    def _client(self, index: int) -> None:
        rng = random.Random(index)
        actions = [
            (self._stored_chat, 5),
            (self._short_chat, 2),
            (self._disconnect, 1),
            (self._encode_and_delete, 1),
            (self._encode_with_ttl, 1),
        ]
        with httpx.Client(base_url=self.url, timeout=TIMEOUT_S) as client:
            while not self._stop.is_set():
                action = rng.choices([a for a, _ in actions], weights=[w for _, w in actions])[0]
                try:
                    action(client, rng)
                except httpx.TimeoutException:
                    with self.tally.lock:
                        self.tally.hangs += 1
                except httpx.TransportError:
                    self.tally.count("transport_error")

    def _stored_chat(self, client: httpx.Client, rng: random.Random) -> None:
        (context_id, question), want = rng.choice(sorted(self.references.items()))
        body = {"model": MODEL, "messages": messages(self.live[context_id], question),
                "max_tokens": ANSWER_TOKENS, "temperature": 0, "kv_quality": "lossless"}  # fmt: skip
        if rng.random() < 0.5:
            r = client.post("/v1/chat/completions", json=body)
            self.tally.count("stored_chat", r)
            got = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else None
        else:
            got, r = self._stream(client, {**body, "stream": True})
            self.tally.count("stored_chat_stream", r)
        if got is not None and got != want:
            with self.tally.lock:
                self.tally.wrong.append(
                    {"context": context_id, "question": question, "got": got, "want": want}
                )

    def _stream(self, client: httpx.Client, body: dict) -> tuple[str | None, httpx.Response]:
        parts: list[str] = []
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return None, r
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    parts.append(delta.get("content") or "")
        return "".join(parts), r

    def _short_chat(self, client: httpx.Client, rng: random.Random) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Say a word about {rng.random():.6f}."}],
                "max_tokens": 6}  # fmt: skip
        self.tally.count("short_chat", client.post("/v1/chat/completions", json=body))

    def _disconnect(self, client: httpx.Client, rng: random.Random) -> None:
        context_id = rng.choice(sorted(self.live))
        body = {"model": MODEL, "messages": messages(self.live[context_id], rng.choice(QUESTIONS)),
                "max_tokens": 64, "stream": True}  # fmt: skip
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            for _ in r.iter_lines():
                break  # the client goes away after the first event
        self.tally.count("disconnect")

    def _new_context(self, client: httpx.Client, kind: str, ttl: int | None) -> str | None:
        with self._serial_lock:
            self._serial += 1
            tag = f"{kind}-{self._serial}"
        body: dict[str, Any] = {"text": document(tag, chars=1600)}
        if ttl is not None:
            body["ttl_seconds"] = ttl
        r = client.post("/contexts", json=body, timeout=600)
        self.tally.count(kind, r)
        if r.status_code != 200:
            return None
        context_id = r.json()["id"]
        try:  # straight from SeaweedFS, to check at the end that its chunks went with it
            manifest = self._manifest(self.weed.client(), context_id)
        except Exception:  # noqa: BLE001 - SeaweedFS may be down just now: then it is not checked
            manifest = None
        if manifest is not None:
            with self.tally.lock:
                self.chunk_keys[context_id] = list(manifest.get("chunk_keys", []))
        return context_id

    def _encode_and_delete(self, client: httpx.Client, rng: random.Random) -> None:
        context_id = self._new_context(client, "encode_delete", None)
        if context_id is None:
            return
        for _ in range(10):  # the store may be down just now: a delete must win in the end
            r = client.delete(f"/contexts/{context_id}")
            self.tally.count("delete", r)
            if r.status_code == 200:
                with self.tally.lock:
                    self.tally.deleted.append(context_id)
                return
            time.sleep(2)

    def _encode_with_ttl(self, client: httpx.Client, rng: random.Random) -> None:
        context_id = self._new_context(client, "encode_ttl", 5)
        if context_id is not None:
            with self.tally.lock:
                self.tally.expiring.append(context_id)

    # -- faults and samples --------------------------------------------------------------------------

    def _faults(self) -> None:
        """Injects the faults; then lives until the checks are done, because the SeaweedFS it
        restarted is its child, and the kernel kills it with this thread (``PR_SET_PDEATHSIG``)."""
        s3 = self.weed.client()
        for n in range(10**9):
            if self._stop.wait(self.fault_every_s):
                self._checked.wait()
                return
            fault = FAULTS[n % len(FAULTS)]
            try:
                self._inject(fault, s3)
            except Exception as exc:  # noqa: BLE001 - a fault that could not be injected is not counted
                print(f"fault {fault} not injected: {exc}", flush=True)
                continue
            with self.tally.lock:
                self.tally.faults[fault] += 1

    def _inject(self, fault: str, s3) -> None:
        if fault == "seaweed_restart":
            self.weed.kill()
            time.sleep(3)
            self.weed.start()
        elif fault == "s3_stall":
            self.link.set_rate("1kbit")
            time.sleep(5)
            self.link.set_rate("10gbit")
        else:
            objects = self._live_chunk_objects(s3)
            if not objects:
                raise RuntimeError("no lossless chunk of a live context found")
            key = self.rng.choice(objects)
            if fault == "chunk_corrupt":
                s3.put_object(Bucket=self.bucket, Key=key, Body=self.rng.randbytes(4096))
            else:
                s3.delete_object(Bucket=self.bucket, Key=key)

    def _live_chunk_objects(self, s3) -> list[str]:
        """The lossless objects of the live contexts: what the checks' lossless requests read, and
        what write-back repairs."""
        keys = []
        for context_id in self.live:
            manifest = self._manifest(s3, context_id)
            for chunk_key in (manifest or {}).get("chunk_keys", []):
                listing = s3.list_objects_v2(Bucket=self.bucket, Prefix=f"{PREFIX}/{chunk_dir(chunk_key)}")
                keys += [o["Key"] for o in listing.get("Contents", []) if "/lossless." in o["Key"]]
        return keys

    def _manifest(self, s3, context_id: str) -> dict | None:
        try:
            body = s3.get_object(Bucket=self.bucket, Key=f"{PREFIX}/{manifest_key(context_id)}")[
                "Body"
            ].read()
        except s3.exceptions.NoSuchKey:
            return None
        return json.loads(body)

    def _sample_rss(self) -> None:
        started = time.monotonic()
        while not self._stop.wait(1.0):
            try:
                status = Path(f"/proc/{self.pid}/status").read_text()
            except OSError:
                return
            kib = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))
            with self.tally.lock:
                self.tally.rss.append((round(time.monotonic() - started, 1), round(kib / 1024, 1)))

    # -- checks ------------------------------------------------------------------------------------

    def _final_checks(self) -> dict[str, Any]:
        s3 = self.weed.client()
        time.sleep(12)  # past the last TTL and two collections
        checks: dict[str, Any] = {}
        with httpx.Client(base_url=self.url, timeout=600) as client:
            reused = {}
            for context_id, text in self.live.items():
                body = {"model": MODEL, "messages": messages(text, QUESTIONS[0]), "max_tokens": 1,
                        "temperature": 0, "kv_quality": "lossless"}  # fmt: skip
                client.post("/v1/chat/completions", json=body)  # what a fault broke, write-back repairs
                time.sleep(3)
                after_write_back = self._cached(client, body)
                # a tail that a fault hit is not a full chunk of any prompt: write-back cannot store
                # it; a re-POST of the context encodes what is missing, and only that
                repost = client.post("/contexts", json={"messages": [{"role": "system", "content": text}]})
                reused[context_id] = {
                    "stored_at_start": self.live_cached[context_id],
                    "after_write_back": after_write_back,
                    "re_post_encoded": repost.json().get("encoded") if repost.status_code == 200 else None,
                    "cached_tokens": self._cached(client, body),
                }
            checks["live_contexts_reused"] = reused
            gone = self.tally.deleted + self.tally.expiring
            checks["gone_but_listed"] = [c for c in gone if client.get(f"/contexts/{c}").status_code != 404]
        left = [c for c in gone if self._manifest(s3, c) is not None]
        for context_id in gone:
            for chunk_key in self.chunk_keys.get(context_id, []):
                listing = s3.list_objects_v2(Bucket=self.bucket, Prefix=f"{PREFIX}/{chunk_dir(chunk_key)}")
                if listing.get("KeyCount", 0):
                    left.append(f"{context_id}: chunk {chunk_key[:12]}")
        checks["gone_but_stored"] = left
        checks["gone_checked"] = len(gone)
        total = 0
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=f"{PREFIX}/"):
            total += sum(o["Size"] for o in page.get("Contents", []))
        checks["store_bytes"] = total
        return checks

    def _cached(self, client: httpx.Client, body: dict) -> int:
        r = client.post("/v1/chat/completions", json=body)
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] if r.status_code == 200 else 0

    def _report(self, elapsed: float, checks: dict[str, Any]) -> dict[str, Any]:
        t = self.tally
        undocumented = {k: v for k, v in t.errors.items() if k.startswith("5") and k not in DOCUMENTED_5XX}
        rss = np.array(t.rss, dtype=float).reshape(-1, 2)
        half = rss[len(rss) // 2 :]
        slope = float(np.polyfit(half[:, 0], half[:, 1], 1)[0] * 60) if len(half) >= 10 else 0.0
        whole = all(
            r["cached_tokens"] >= r["stored_at_start"] > 0 for r in checks["live_contexts_reused"].values()
        )
        passed = {
            "no_wrong_answers": not t.wrong,
            "no_undocumented_5xx": not undocumented,
            "no_hung_requests": t.hangs == 0,
            "rss_flat": abs(slope) <= self.rss_slope_limit,
            "store_within_cap": checks["store_bytes"] <= CAP_BYTES,
            "live_contexts_whole_and_reused": whole,
            "deleted_and_expired_gone": not checks["gone_but_listed"] and not checks["gone_but_stored"],
        }
        return {
            "duration_s": round(elapsed, 1),
            "clients": self.clients,
            "requests": dict(t.requests),
            "requests_total": sum(t.requests.values()),
            "faults": dict(t.faults),
            "errors": dict(t.errors),
            "undocumented_5xx": undocumented,
            "wrong_answers": t.wrong,
            "hung_requests": t.hangs,
            "checked_pairs": len(self.references),
            "rss_mib": t.rss,
            "rss_slope_mib_per_min": round(slope, 2),
            "checks": checks,
            "passed": passed,
            "ok": all(passed.values()),
        }


def plot(report: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    seconds, mib = zip(*report["rss_mib"], strict=True) if report["rss_mib"] else ((), ())
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(seconds, mib)
    ax.set_xlabel("seconds")
    ax.set_ylabel("gateway RSS (MiB)")
    ax.set_title(f"soak: {report['requests_total']} requests, {sum(report['faults'].values())} faults")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of load")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--fault-every", type=float, default=30.0, help="seconds between faults")
    p.add_argument("--workdir", type=Path, help="default: a temporary directory")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/soak.json"))
    p.add_argument("--plot", type=Path, default=Path("benchmarks/results/soak.png"))
    args = p.parse_args()
    import tempfile

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="soak-"))
    report = Soak(args.duration, args.clients, args.fault_every, workdir).run()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    plotted = plot(report, args.plot)
    print(f"{report['requests_total']} requests in {report['duration_s']} s, faults {report['faults']}")
    print(f"errors {report['errors']}, RSS slope {report['rss_slope_mib_per_min']} MiB/min")
    print("| check | passed |\n|---|---|")
    for name, ok in report["passed"].items():
        print(f"| {name} | {ok} |")
    print(f"wrote {args.out}" + (f" and {args.plot}" if plotted else " (no matplotlib: no plot)"))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
