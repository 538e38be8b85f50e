"""The gateway as a real process on a real S3 server (SeaweedFS): restart, faults, metrics.

In every fault the request must still be answered, and answered correctly:
the greedy output equals that of a full prefill (``kv_cache: false``).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from codec import LOSSLESS, level_digest
from scheduler.layout import manifest_key, object_name
from tests.conftest import MODEL_NAME
from tests.forged_chunks import zstd_bomb
from tests.gateway_process import GatewayProcess

pytestmark = pytest.mark.slow

PREFIX = "ctx"


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:
    text = (Path(__file__).parent.parent / "data" / "python_history.txt").read_text()
    return tokenizer(text)["input_ids"][:560]  # two full chunks and a tail


def gateway_env(server, bucket: str, **extra: str) -> dict[str, str]:
    return {
        **server.env(),
        "CACHEGEN_STORE": f"s3://{bucket}/{PREFIX}",
        "CACHEGEN_STORE_CACHE_BYTES": "0",  # every read goes to S3
        "CACHEGEN_PREFIX_CACHE": "false",  # and no request reuses KV an earlier one left in memory
        **extra,
    }


def encode(url: str, ids: list[int]) -> httpx.Response:
    return httpx.post(f"{url}/contexts", json={"prompt_token_ids": ids[:512]}, timeout=300)


def complete(url: str, ids: list[int], **extra) -> dict:
    """Lossless unless told otherwise: these tests compare answers with a full prefill's."""
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": 8, "temperature": 0, "kv_quality": "lossless"}
    body.update(extra)
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def metric(url: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f"{name}{{{want}}}" if want else f"{name} "):
            return float(line.split()[-1])
    return 0.0


def chunk_object_keys(server, bucket: str, context_id: str) -> list[str]:
    client = server.client()
    manifest = json.loads(
        client.get_object(Bucket=bucket, Key=f"{PREFIX}/{manifest_key(context_id)}")["Body"].read()
    )
    name = object_name("lossless", level_digest(LOSSLESS))
    return [f"{PREFIX}/kv/{key}/{name}" for key in manifest["chunk_keys"]]


def test_encode_restart_and_hit_from_s3(tmp_path, seaweed, s3_bucket, prompt_ids):
    env = gateway_env(seaweed, s3_bucket)
    with GatewayProcess(env, tmp_path / "first.log") as first:
        created = encode(first.url, prompt_ids).json()
    assert created["cached_tokens"] == 512
    with GatewayProcess(env, tmp_path / "second.log") as second:
        assert [c["id"] for c in httpx.get(f"{second.url}/contexts").json()["data"]] == [created["id"]]
        hit = complete(second.url, prompt_ids, kv_quality="lossless")
        fresh = complete(second.url, prompt_ids, kv_cache=False)
        assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == 512
        assert hit["choices"][0]["text"] == fresh["choices"][0]["text"]
        assert (
            metric(second.url, "cachegen:kv_bytes_loaded_total", level="lossless")
            == created["bytes"]["lossless"]
        )


def test_objects_deleted_or_corrupted_behind_the_gateways_back(tmp_path, seaweed, s3_bucket, prompt_ids):
    with GatewayProcess(gateway_env(seaweed, s3_bucket), tmp_path / "gateway.log") as gw:
        created = encode(gw.url, prompt_ids).json()
        fresh = complete(gw.url, prompt_ids, kv_cache=False)["choices"][0]["text"]
        first, second = chunk_object_keys(seaweed, s3_bucket, created["id"])
        client = seaweed.client()

        client.delete_object(Bucket=s3_bucket, Key=second)
        out = complete(gw.url, prompt_ids)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 256
        assert out["choices"][0]["text"] == fresh

        blob = bytearray(client.get_object(Bucket=s3_bucket, Key=first)["Body"].read())
        blob[len(blob) // 2] ^= 0x40
        client.put_object(Bucket=s3_bucket, Key=first, Body=bytes(blob))
        out = complete(gw.url, prompt_ids)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert out["kv_cache_info"]["faults"] == ["corrupt_chunk"]
        assert out["choices"][0]["text"] == fresh
        assert metric(gw.url, "cachegen:kv_store_faults_total", kind="corrupt_chunk") == 1
        assert "rejected by the codec" in gw.log()

        # re-encoding heals the context
        encode(gw.url, prompt_ids)
        assert complete(gw.url, prompt_ids)["usage"]["prompt_tokens_details"]["cached_tokens"] == 512


def _peak_rss_reset(pid: int) -> int:
    """Reset the process's peak RSS to its current RSS (Linux clear_refs); return that RSS."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _status_kib(pid, "VmRSS") * 1024


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def test_a_decompression_bomb_under_a_real_key_costs_no_memory(tmp_path, seaweed, s3_bucket, prompt_ids):
    """A 3 GiB zstd bomb (about 0.1 MB, CRC valid) written over a stored chunk is refused from its
    header: the request costs under 100 MB of peak RSS, is answered as a full prefill answers it,
    and the fault is counted."""
    bomb = zstd_bomb(layers=30, heads=3, tokens=70_000, dim=64)  # SmolLM2-135M's geometry: 3.1 GiB
    assert len(bomb) < 200_000
    with GatewayProcess(gateway_env(seaweed, s3_bucket), tmp_path / "gateway.log") as gw:
        created = encode(gw.url, prompt_ids).json()
        fresh = complete(gw.url, prompt_ids, kv_cache=False)["choices"][0]["text"]
        first, _ = chunk_object_keys(seaweed, s3_bucket, created["id"])
        seaweed.client().put_object(Bucket=s3_bucket, Key=first, Body=bomb)
        complete(gw.url, prompt_ids, kv_cache=False)  # the prefill's own peak, before the baseline
        before = _peak_rss_reset(gw.proc.pid)
        out = complete(gw.url, prompt_ids)
        peak = _status_kib(gw.proc.pid, "VmHWM") * 1024
        assert peak - before < 100 * 2**20, f"peak RSS rose by {(peak - before) / 2**20:.0f} MiB"
        assert out["choices"][0]["text"] == fresh
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert out["kv_cache_info"]["faults"] == ["shape_mismatch"]
        assert metric(gw.url, "cachegen:kv_store_faults_total", kind="shape_mismatch") == 1
        assert "does not fit the model" in gw.log()


def test_s3_stopped_before_and_during_requests(tmp_path, private_seaweed, prompt_ids):
    server = private_seaweed
    bucket = server.create_bucket()
    with GatewayProcess(gateway_env(server, bucket), tmp_path / "gateway.log") as gw:
        assert encode(gw.url, prompt_ids).status_code == 200
        fresh = complete(gw.url, prompt_ids, kv_cache=False)["choices"][0]["text"]

        # stopped while a run of requests is in flight: each one is answered, correctly
        answers: list[dict] = []

        def ask() -> None:
            for _ in range(3):
                answers.append(complete(gw.url, prompt_ids))

        asker = threading.Thread(target=ask)
        asker.start()
        time.sleep(0.5)
        server.stop()
        asker.join()
        assert [a["choices"][0]["text"] for a in answers] == [fresh] * 3

        # stopped: recomputed, counted, logged; the context API says 503
        out = complete(gw.url, prompt_ids)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert out["choices"][0]["text"] == fresh
        assert "store_unavailable" in out["kv_cache_info"]["faults"]
        assert metric(gw.url, "cachegen:kv_store_faults_total", kind="store_unavailable") >= 1
        assert "KV store unavailable" in gw.log()
        r = encode(gw.url, prompt_ids)
        assert r.status_code == 503 and r.json()["error"]["code"] == "kv_store_unavailable"
        assert httpx.get(f"{gw.url}/contexts").status_code == 503

        # back up: hits again
        server.start()
        out = complete(gw.url, prompt_ids)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 512


@pytest.mark.parametrize("fault", ["wrong_credentials", "missing_bucket"])
def test_misconfigured_store_still_answers(tmp_path, seaweed, s3_bucket, prompt_ids, fault):
    env = gateway_env(seaweed, s3_bucket)
    if fault == "wrong_credentials":
        env["AWS_SECRET_ACCESS_KEY"] = "not-the-secret"
    else:
        env["CACHEGEN_STORE"] = f"s3://{s3_bucket}-missing/{PREFIX}"
    with GatewayProcess(env, tmp_path / "gateway.log") as gw:
        out = complete(gw.url, prompt_ids)
        fresh = complete(gw.url, prompt_ids, kv_cache=False)
        assert out["choices"][0]["text"] == fresh["choices"][0]["text"]
        assert out["kv_cache_info"]["faults"] == ["store_unavailable"]
        assert metric(gw.url, "cachegen:kv_store_faults_total", kind="store_unavailable") == 1
        r = encode(gw.url, prompt_ids)
        assert r.status_code == 503
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_write_back_stores_a_missed_prefix(tmp_path, seaweed, s3_bucket, prompt_ids):
    env = gateway_env(seaweed, s3_bucket, CACHEGEN_WRITE_BACK="true")
    with GatewayProcess(env, tmp_path / "gateway.log") as gw:
        first = complete(gw.url, prompt_ids)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        deadline = time.monotonic() + 60
        while metric(gw.url, "cachegen:kv_write_backs_total", outcome="stored") < 1:
            assert time.monotonic() < deadline, gw.log()
            time.sleep(0.2)
        second = complete(gw.url, prompt_ids)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 512
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
