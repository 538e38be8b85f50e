"""Store URLs: schemes, S3 bucket/prefix parsing, the optional LRU wrapper. No network."""

from __future__ import annotations

from pathlib import Path

import pytest

from storage import open_store
from storage.local import LocalStore
from storage.memory import MemoryStore
from storage.s3 import DEFAULT_REGION, S3Store
from storage.tiered import LRUCacheStore


@pytest.fixture(autouse=True)
def _no_ambient_aws(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_REGION",
        "AWS_DEFAULT_REGION",
        "AWS_PROFILE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")


def test_file_and_memory(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/kv")
    assert isinstance(store, LocalStore) and store.root == (tmp_path / "kv").resolve()
    assert isinstance(open_store("memory://"), MemoryStore)


@pytest.mark.parametrize(
    "url", ["file://host/x", "ftp://x", "kv", "", "s3://", "s3:///prefix", "s3://b/p?x=1"]
)
def test_bad_urls(url: str) -> None:
    with pytest.raises(ValueError):
        open_store(url)


@pytest.mark.parametrize(
    ("url", "bucket", "prefix"),
    [
        ("s3://kv", "kv", ""),
        ("s3://kv/", "kv", ""),
        ("s3://kv/contexts", "kv", "contexts"),
        ("s3://kv/a/b/", "kv", "a/b"),
    ],
)
def test_s3_url(url: str, bucket: str, prefix: str) -> None:
    store = open_store(url)
    assert isinstance(store, S3Store)
    assert (store.bucket, store.prefix) == (bucket, prefix)
    assert store._object_key("c/0") == (f"{prefix}/c/0" if prefix else "c/0")


def test_s3_prefix_cannot_escape() -> None:
    with pytest.raises(ValueError):
        S3Store.from_url("s3://kv/../other")


def test_s3_reads_the_standard_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    assert S3Store("kv")._client.meta.region_name == DEFAULT_REGION
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    assert S3Store("kv")._client.meta.region_name == "eu-west-1"
    monkeypatch.setenv("AWS_REGION", "eu-central-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    store = S3Store("kv")
    assert store._client.meta.region_name == "eu-central-1"
    assert store.endpoint_url == "http://127.0.0.1:9000"
    assert store._client.meta.config.s3["addressing_style"] == "path"


def test_s3_tunables_reach_botocore() -> None:
    store = S3Store.from_url(
        "s3://kv", max_pool_connections=7, max_attempts=4, connect_timeout=0.5, read_timeout=3
    )
    config = store._client.meta.config
    assert config.max_pool_connections == 7
    assert config.retries["total_max_attempts"] == 4
    assert (config.connect_timeout, config.read_timeout) == (0.5, 3)


def test_cache_bytes_wraps_any_backend() -> None:
    store = open_store("memory://", cache_bytes=1024)
    assert isinstance(store, LRUCacheStore) and isinstance(store.backend, MemoryStore)
    assert store.capacity_bytes == 1024 and store.url == "memory://"
    assert isinstance(open_store("memory://", cache_bytes=0), MemoryStore)
    with pytest.raises(ValueError):
        open_store("memory://", cache_bytes=-1)
