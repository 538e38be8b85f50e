"""S3Store against a real S3 server (SeaweedFS started by the fixtures), faults included."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest

from storage.errors import ObjectNotFound, StorageUnavailable
from storage.s3 import S3Store
from storage.tiered import LRUCacheStore
from storage.url import open_store
from tests.support.seaweed import SeaweedServer
from tests.support.store_contract import StoreContract

pytestmark = pytest.mark.slow

# Small enough that a dead server is noticed in seconds, not the defaults' tens. Only for the calls
# that meet a stopped server: the data the faults act on is written with the default timeouts, which
# a loaded machine can need (a write of megabytes while weed shares two cores with a model).
FAST_FAIL = {"max_attempts": 2, "connect_timeout": 1.0, "read_timeout": 2.0}


def make_store(server: SeaweedServer, bucket: str, prefix: str = "ctx", **options: object) -> S3Store:
    return S3Store(
        bucket,
        prefix,
        endpoint_url=server.endpoint_url,
        access_key=server.access_key,
        secret_key=server.secret_key,
        **options,  # type: ignore[arg-type]
    )


@pytest.fixture
def store(seaweed: SeaweedServer, s3_bucket: str) -> Iterator[S3Store]:
    s = make_store(seaweed, s3_bucket)
    yield s
    s.close()


class TestS3Contract(StoreContract):
    pass


def test_prefix_isolates_stores(seaweed: SeaweedServer, s3_bucket: str) -> None:
    a, b = make_store(seaweed, s3_bucket, "a"), make_store(seaweed, s3_bucket, "b/c")
    a.put("k", b"from a")
    b.put("k", b"from b")
    assert a.get("k") == b"from a" and b.get("k") == b"from b"
    assert [i.key for i in b.list()] == ["k"]
    raw = seaweed.client().get_object(Bucket=s3_bucket, Key="b/c/k")["Body"].read()
    assert raw == b"from b"


def test_configured_from_standard_aws_variables(
    seaweed: SeaweedServer, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    store = open_store(f"s3://{s3_bucket}/contexts")
    assert isinstance(store, S3Store) and store.endpoint_url == seaweed.endpoint_url
    store.put("x/0", b"via env")
    assert seaweed.client().get_object(Bucket=s3_bucket, Key="contexts/x/0")["Body"].read() == b"via env"


def test_big_object_and_ranges(store: S3Store) -> None:
    data = os.urandom(12 * 1024 * 1024 + 17)  # a raw fp32 256-token chunk of the default model
    store.put("big", memoryview(data))
    assert store.head("big").size == len(data)  # type: ignore[union-attr]
    assert store.get("big") == data
    assert store.get_range("big", 5_000_000, 1_500_000) == data[5_000_000:6_500_000]
    assert store.get_range("big", len(data) - 3, 10) == data[-3:]


def test_parallel_batches_are_parallel(store: S3Store) -> None:
    keys = [f"chunks/{i:02d}" for i in range(32)]
    blobs = [os.urandom(300_000) for _ in keys]
    for key, blob in zip(keys, blobs, strict=True):
        store.put(key, blob)
    assert store.get_many(keys) == blobs
    assert store.exists_many(keys + ["chunks/missing"]) == [True] * 32 + [False]
    threads: set[str] = set()
    original = store.get

    def recording_get(key: str, limit: int) -> bytes:
        threads.add(threading.current_thread().name)
        return original(key, limit)

    store.get = recording_get  # type: ignore[method-assign]
    store.get_many(keys)
    assert len(threads) > 1


def test_concurrent_callers_share_one_store(store: S3Store) -> None:
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            for i in range(5):
                key = f"t{n}/{i}"
                store.put(key, key.encode() * 1000)
                assert store.get(key) == key.encode() * 1000
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# -- faults ------------------------------------------------------------------


def test_wrong_secret_is_unavailable_not_missing(seaweed: SeaweedServer, s3_bucket: str) -> None:
    good = make_store(seaweed, s3_bucket)
    good.put("k", b"v")
    bad = S3Store(
        s3_bucket, "ctx", endpoint_url=seaweed.endpoint_url, access_key=seaweed.access_key, secret_key="wrong"
    )
    for call in (lambda: bad.get("k"), lambda: bad.head("k"), lambda: bad.head("absent"),
                 lambda: bad.get_range("k", 0, 1), lambda: bad.put("k2", b"v"), lambda: list(bad.list()),
                 lambda: bad.get_many(["k", "absent"]), lambda: bad.exists_many(["k", "absent"])):
        with pytest.raises(StorageUnavailable, match="access refused"):
            call()


def test_unknown_access_key_is_unavailable(seaweed: SeaweedServer, s3_bucket: str) -> None:
    bad = S3Store(s3_bucket, endpoint_url=seaweed.endpoint_url, access_key="nobody", secret_key="x")
    with pytest.raises(StorageUnavailable, match="InvalidAccessKeyId"):
        bad.get("k")


def test_missing_bucket_is_unavailable_not_missing(seaweed: SeaweedServer) -> None:
    store = make_store(seaweed, "no-such-bucket-here")
    for call in (lambda: store.get("k"), lambda: store.head("k"), lambda: store.get_range("k", 0, 9),
                 lambda: store.put("k", b"v"), lambda: list(store.list()),
                 lambda: store.get_many(["a", "b"]), lambda: store.exists_many(["a", "b"])):
        with pytest.raises(StorageUnavailable, match="does not exist"):
            call()


def test_bucket_deleted_while_in_use(seaweed: SeaweedServer) -> None:
    bucket = seaweed.create_bucket()
    store = make_store(seaweed, bucket)
    store.put("k", b"v")
    assert store.head("absent") is None
    seaweed.delete_bucket(bucket)
    with pytest.raises(StorageUnavailable):
        store.head("absent")
    with pytest.raises(StorageUnavailable):
        store.get("k")


def test_nothing_listening_fails_fast(s3_bucket: str) -> None:
    from tests.support.seaweed import _pick_port_pairs

    port = _pick_port_pairs(1)[0]
    store = S3Store(s3_bucket, endpoint_url=f"http://127.0.0.1:{port}", access_key="a", secret_key="b", **FAST_FAIL)
    start = time.monotonic()
    with pytest.raises(StorageUnavailable, match="cannot reach"):
        store.get("k")
    assert time.monotonic() - start < 10


def test_server_stopped_mid_use_then_restarted(private_seaweed: SeaweedServer) -> None:
    bucket = private_seaweed.create_bucket()
    store = make_store(private_seaweed, bucket, **FAST_FAIL)
    blobs = {f"c/{i}": os.urandom(200_000) for i in range(16)}
    writer = make_store(private_seaweed, bucket)
    for key, blob in blobs.items():
        writer.put(key, blob)
    writer.close()

    private_seaweed.stop()
    # Every kind of call fails as "unavailable" (never "not found") within the retry budget.
    for call in (lambda: store.get("c/0"), lambda: store.head("c/1"), lambda: store.put("c/x", b"x"),
                 lambda: store.get_many(list(blobs)), lambda: store.exists_many(list(blobs))):
        start = time.monotonic()
        with pytest.raises(StorageUnavailable):
            call()
        assert time.monotonic() - start < 15

    private_seaweed.start()
    # The same store object recovers once the server is back: no reconnect step needed.
    assert store.get_many(list(blobs)) == list(blobs.values())
    store.put("c/after", b"after restart")
    assert store.get("c/after") == b"after restart"


def test_server_killed_during_parallel_fetch(private_seaweed: SeaweedServer) -> None:
    bucket = private_seaweed.create_bucket()
    store = make_store(private_seaweed, bucket, **FAST_FAIL)
    keys = [f"c/{i}" for i in range(48)]
    writer = make_store(private_seaweed, bucket)
    for key in keys:
        writer.put(key, os.urandom(1_000_000))
    writer.close()
    outcome: list[object] = []

    def fetch() -> None:
        try:
            for _ in range(20):
                store.get_many(keys)
            outcome.append("finished before the stop")
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            outcome.append(exc)

    t = threading.Thread(target=fetch)
    t.start()
    time.sleep(0.3)
    private_seaweed.stop()
    t.join(60)
    assert not t.is_alive()
    assert len(outcome) == 1
    assert outcome[0] == "finished before the stop" or isinstance(outcome[0], StorageUnavailable), outcome
    private_seaweed.start()
    assert store.exists_many(keys) == [True] * len(keys)


def test_cache_in_front_of_s3_serves_hits_without_the_server(private_seaweed: SeaweedServer) -> None:
    bucket = private_seaweed.create_bucket()
    cached = LRUCacheStore(make_store(private_seaweed, bucket, **FAST_FAIL), capacity_bytes=10_000_000)
    cached.put("hot", b"hot chunk")
    private_seaweed.stop()
    assert cached.get("hot") == b"hot chunk"
    with pytest.raises(StorageUnavailable):
        cached.get("cold")
    private_seaweed.start()
    with pytest.raises(ObjectNotFound):
        cached.get("cold")


def test_servers_side_by_side_leave_nothing_behind(seaweed: SeaweedServer) -> None:
    from pathlib import Path

    with SeaweedServer() as other:
        assert other.endpoint_url != seaweed.endpoint_url
        assert set(other._ports.values()).isdisjoint(seaweed._ports.values())
        bucket = other.create_bucket()
        other.client().put_object(Bucket=bucket, Key="k", Body=b"v")
        data_dir, ports = other.data_dir, dict(other._ports)
        env = other.env()
    assert env["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:")
    assert not data_dir.exists()
    for port in ports.values():
        assert not list(Path("/tmp").glob(f"seaweedfs-*-{port}.sock"))
        assert not list(Path("/tmp").glob(f"seaweedfs-*-{port + 10000}.sock"))
