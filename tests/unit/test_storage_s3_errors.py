"""How S3Store sorts botocore failures into the storage exceptions. No network."""

from __future__ import annotations

import io

import pytest
from botocore.exceptions import ClientError, ConnectTimeoutError, EndpointConnectionError, NoCredentialsError

from storage.errors import ObjectNotFound, ObjectTooLarge, StorageError, StorageUnavailable
from storage.s3 import S3Store, _MemoryviewReader


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> S3Store:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    return S3Store("kv", "ctx", endpoint_url="http://127.0.0.1:9")


def client_error(code: str, status: int) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "Op"
    )


@pytest.mark.parametrize(
    ("exc", "expected", "text"),
    [
        (client_error("NoSuchKey", 404), ObjectNotFound, "c/0"),
        (client_error("NoSuchBucket", 404), StorageUnavailable, "bucket 'kv' does not exist"),
        (client_error("AccessDenied", 403), StorageUnavailable, "access refused"),
        (client_error("InvalidAccessKeyId", 403), StorageUnavailable, "check credentials"),
        (client_error("SignatureDoesNotMatch", 403), StorageUnavailable, "access refused"),
        (client_error("403", 403), StorageUnavailable, "access refused"),
        (client_error("SlowDown", 503), StorageUnavailable, "server error"),
        (client_error("InternalError", 500), StorageUnavailable, "server error"),
        # A bare 404 (a HEAD) cannot tell a missing key from a missing bucket: not "not found".
        (client_error("404", 404), StorageError, "404"),
        (EndpointConnectionError(endpoint_url="http://127.0.0.1:9"), StorageUnavailable, "cannot reach"),
        (ConnectTimeoutError(endpoint_url="http://127.0.0.1:9"), StorageUnavailable, "cannot reach"),
        (NoCredentialsError(), StorageUnavailable, "credentials"),
    ],
)
def test_translation(store: S3Store, exc: Exception, expected: type[StorageError], text: str) -> None:
    translated = store._translate(exc, "get", "c/0")
    assert type(translated) is expected
    assert text in str(translated)


def test_unreachable_endpoint_is_unavailable(store: S3Store) -> None:
    quick = S3Store("kv", endpoint_url="http://127.0.0.1:9", max_attempts=1, connect_timeout=0.5)
    with pytest.raises(StorageUnavailable, match="cannot reach"):
        quick.get("k")
    del store


def test_memoryview_reader_streams_without_copying_the_whole_buffer() -> None:
    data = bytes(range(256)) * 100
    reader = _MemoryviewReader(memoryview(data))
    assert len(reader) == len(data)
    assert io.BufferedReader(reader).read() == data
    reader.seek(0)
    assert reader.read(10) == data[:10] and reader.tell() == 10
    reader.seek(-5, io.SEEK_END)
    assert reader.read() == data[-5:]


def test_memoryview_reader_takes_multidimensional_views() -> None:
    import array

    ints = array.array("i", range(10))
    reader = _MemoryviewReader(memoryview(ints))
    assert reader.read() == ints.tobytes()


class _Body(io.BytesIO):
    """A response body that records how much of it was read."""

    def read(self, size: int | None = -1) -> bytes:  # type: ignore[override]
        data = super().read(size)
        self.taken = getattr(self, "taken", 0) + len(data)
        return data


def test_a_body_over_the_limit_is_refused_from_its_length_before_it_is_read(store: S3Store) -> None:
    body = _Body(bytes(1 << 20))
    with pytest.raises(ObjectTooLarge, match="1048576 bytes"):
        store._read_body({"Body": body, "ContentLength": 1 << 20}, "c/0", limit=1000)
    assert getattr(body, "taken", 0) == 0 and body.closed


def test_a_body_longer_than_its_stated_length_is_cut_off_at_the_limit(store: S3Store) -> None:
    body = _Body(bytes(1 << 20))
    with pytest.raises(ObjectTooLarge):
        store._read_body({"Body": body, "ContentLength": 10}, "c/0", limit=1000)
    assert body.taken == 1001 and body.closed
