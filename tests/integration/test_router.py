"""Two gateways over one S3 store (SeaweedFS) behind vLLM's router, all real processes.

- Through the router, repeated questions on one context come from the store, and cache-aware
  routing keeps them on one replica (``kv_cache_info.replica`` says which).
- The router reads each worker's load from ``/get_load``.
- GC on A while B writes back keeps B's chunks (the grace period), and a grace of 0 would not.
- A replica SIGKILLed mid-stream costs only that stream: it ends at once, never hangs; the next
  requests through the router succeed; the stored context is intact.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import MODEL_NAME
from tests.gateway_process import REPO, GatewayProcess
from tests.support.router import RouterProcess, router_binary

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(router_binary() is None, reason="vllm-router not installed (pip install vllm-router)"),
]

TEXT = (Path(__file__).parent.parent / "data" / "python_history.txt").read_text()


def document(n: int, chars: int = 2600) -> str:
    return f"Router document {n}.\n{TEXT[:chars]}"


class Cluster:
    def __init__(self, a: GatewayProcess, b: GatewayProcess, router: RouterProcess, env: dict, bucket: str):
        self.a, self.b, self.router, self.env, self.bucket = a, b, router, env, bucket
        self.by_name = {"a": a, "b": b}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, seaweed) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("router")
    bucket = seaweed.create_bucket()
    common = {
        **seaweed.env(),
        "CACHEGEN_STORE": f"s3://{bucket}/shared",
        "CACHEGEN_STORE_CACHE_BYTES": "0",  # what one writes, the other reads from S3
        "CACHEGEN_TORCH_THREADS": "1",  # two replicas on a small machine: a core each (docs/scaleout.md)
    }
    # A sweeps the store every second; B stores the chunks of prompts it had to prefill
    a = GatewayProcess({**common, "CACHEGEN_REPLICA": "a", "CACHEGEN_GC_INTERVAL_S": "1"}, root / "a.log")
    b = GatewayProcess({**common, "CACHEGEN_REPLICA": "b", "CACHEGEN_WRITE_BACK": "true"}, root / "b.log")
    with a, b:
        with RouterProcess([a.url, b.url], "cache_aware", root / "router.log") as router:
            yield Cluster(a, b, router, common, bucket)
    seaweed.delete_bucket(bucket)


def complete(url: str, prompt: str, max_tokens: int = 4) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def post_context(url: str, text: str) -> dict:
    r = httpx.post(f"{url}/v1/contexts", json={"text": text}, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def test_repeated_questions_stay_on_one_replica_and_come_from_the_store(cluster):
    text = document(1)
    stored = post_context(cluster.router.url, text)
    assert stored["cached_tokens"] >= 512
    infos = [
        complete(cluster.router.url, f"{text}\nQuestion {i}: what happened in year {1990 + i}?\nAnswer:")[
            "kv_cache_info"
        ]
        for i in range(4)
    ]
    assert {info["replica"] for info in infos} <= {"a", "b"}
    assert len({info["replica"] for info in infos}) == 1, infos  # cache-aware: one replica
    assert all(info["cached_tokens"] >= stored["cached_tokens"] for info in infos)
    assert all(info["recomputed_tokens"] < 64 for info in infos)  # only each question is prefilled
    assert infos[-1]["memory_tokens"] >= stored["cached_tokens"]  # hot in that replica's memory


def router_loads(cluster) -> dict[str, int]:
    workers = httpx.get(f"{cluster.router.url}/get_loads", timeout=10).json()["workers"]
    return {w["worker"]: w["load"] for w in workers}  # -1: the router could not read /get_load


def test_the_router_reads_each_workers_load(cluster):
    assert router_loads(cluster) == {cluster.a.url: 0, cluster.b.url: 0}
    body = {"model": MODEL_NAME, "prompt": "Count:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{cluster.a.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # kept: a dropped generator closes the response
        next(lines)  # A has admitted it
        assert router_loads(cluster) == {cluster.a.url: 1, cluster.b.url: 0}
    info = httpx.get(f"{cluster.router.url}/get_server_info", timeout=10).json()  # forwarded to one
    assert info["replica"] in {"a", "b"} and info["served_model_name"] == MODEL_NAME


def store_objects(seaweed, bucket: str) -> set[str]:
    client = seaweed.client()
    keys: set[str] = set()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="shared/kv/"):
        keys.update(o["Key"] for o in page.get("Contents", []))
    return keys


def metric(url: str, name: str, **labels: str) -> float:
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    return 0.0


def test_gc_on_a_while_b_writes_back_keeps_bs_chunks(cluster, seaweed):
    prompt = document(2, 3000) + "\nQuestion: when?\nAnswer:"
    before = store_objects(seaweed, cluster.bucket)
    stored = metric(cluster.b.url, "cachegen:kv_write_backs_total", outcome="stored")
    assert complete(cluster.b.url, prompt)["kv_cache_info"]["cached_tokens"] == 0
    deadline = time.monotonic() + 120
    while metric(cluster.b.url, "cachegen:kv_write_backs_total", outcome="stored") <= stored:
        assert time.monotonic() < deadline, "B never wrote back"
        time.sleep(0.5)
    written = store_objects(seaweed, cluster.bucket) - before
    assert written, "write-back stored nothing"
    sweeps = metric(cluster.a.url, "cachegen:store_collections_total")
    time.sleep(3)  # A sweeps every second
    assert metric(cluster.a.url, "cachegen:store_collections_total") >= sweeps + 1, "A did not sweep"
    assert written <= store_objects(seaweed, cluster.bucket)  # no live manifest lists them: grace kept them
    assert complete(cluster.a.url, prompt)["kv_cache_info"]["cached_tokens"] >= 512  # A reuses B's chunks

    # the control: without the grace period the same collector removes them
    subprocess.run(
        [sys.executable, "-m", "app", "gc", "--grace-s", "0"],
        cwd=REPO,
        env={**os.environ, **cluster.env},
        check=True,
        capture_output=True,
    )
    assert not written & store_objects(seaweed, cluster.bucket)


def healthy(router: RouterProcess, worker: str) -> bool:
    workers = httpx.get(f"{router.url}/workers", timeout=10).json()
    return next(w["is_healthy"] for w in workers["workers"] if w["url"] == worker)


def test_a_replica_killed_mid_stream_costs_only_its_stream(cluster):
    text = document(3)
    stored = post_context(cluster.router.url, text)
    body = {
        "model": MODEL_NAME,
        "prompt": text + "\nTell a long story:",
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    events: list[str] = []
    killed = None
    started = time.monotonic()
    with pytest.raises(httpx.HTTPError) as ended:  # the router cuts the stream; no [DONE] follows
        with httpx.stream("POST", f"{cluster.router.url}/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if killed is None and "kv_cache_info" in line:
                    killed = json.loads(line[6:])["kv_cache_info"]["replica"]
                if len(events) == 5:
                    os.kill(cluster.by_name[killed].proc.pid, signal.SIGKILL)
                    killed_at = time.monotonic()
    assert killed is not None and len(events) >= 5 and "[DONE]" not in events
    assert time.monotonic() - killed_at < 10, f"the stream hung: {ended.value!r}"
    assert time.monotonic() - started < 60
    survivor = cluster.by_name["b" if killed == "a" else "a"]
    try:
        # the router's health check (every second here) takes the dead replica out of rotation;
        # until then its retries go to the replica holding the prefix (docs/scaleout.md)
        deadline = time.monotonic() + 15
        while healthy(cluster.router, cluster.by_name[killed].url):
            assert time.monotonic() < deadline, "the router never marked the killed replica down"
            time.sleep(0.2)
        for i in range(3):
            info = complete(cluster.router.url, f"{text}\nQuestion {i}: who?\nAnswer:")["kv_cache_info"]
            assert info["replica"] != killed
            assert info["cached_tokens"] >= stored["cached_tokens"]  # the context is intact
        got = httpx.get(f"{survivor.url}/v1/contexts/{stored['id']}", timeout=10)
        assert got.status_code == 200 and got.json()["cached_tokens"] == stored["cached_tokens"]
    finally:
        cluster.by_name[killed].start()  # whole again for whatever runs after
