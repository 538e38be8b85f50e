"""S3-compatible object storage (AWS S3, MinIO, SeaweedFS) as an ObjectStore: ``s3://bucket/prefix``.

Configured by the standard AWS variables (``AWS_ENDPOINT_URL``, ``AWS_REGION``
or ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``), or by
constructor arguments that win over them. Addressing is path-style, which every
S3 server accepts and MinIO/SeaweedFS need.

Errors are sorted with care because the scheduler acts on them: ObjectNotFound
only when the server said the key is absent in a bucket that exists;
StorageUnavailable for everything that says "the store cannot answer now"
(network, timeouts, credentials, a missing bucket, 5xx after retries).
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
    ResponseStreamingError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)

from storage.base import DEFAULT_LIMIT, ObjectInfo, ObjectStore, check_key, check_size
from storage.errors import ObjectNotFound, StorageError, StorageUnavailable

DEFAULT_REGION = "us-east-1"

_MISSING_KEY_CODES = frozenset({"NoSuchKey"})
_REFUSED_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "InvalidToken",
        "ExpiredToken",
        "TokenRefreshRequired",
        "AllAccessDisabled",
        "403",
    }
)
_NETWORK_ERRORS = (
    BotoConnectionError,  # endpoint unreachable, connect/read timeouts, connection closed
    HTTPClientError,
    IncompleteReadError,
    ResponseStreamingError,  # the connection broke while the body was streaming
    ConnectionError,  # builtin: urllib3 can leak these while a body is read
    TimeoutError,
)


class _MemoryviewReader(io.RawIOBase):
    """A seekable file over a memoryview, so botocore can stream (and re-send on retry)
    a caller's buffer without first copying it into one big ``bytes``."""

    def __init__(self, view: memoryview) -> None:
        self._view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def]
        chunk = self._view[self._pos : self._pos + len(buffer)]
        n = len(chunk)
        memoryview(buffer).cast("B")[:n] = chunk
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def __len__(self) -> int:
        return len(self._view)


class S3Store(ObjectStore):
    """Objects at ``s3://{bucket}/{prefix}/{key}``; one client shared by all threads."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        max_pool_connections: int = 32,
        max_attempts: int = 3,
        connect_timeout: float = 2.0,
        read_timeout: float = 5.0,
        parallelism: int | None = None,
    ) -> None:
        if not bucket or "/" in bucket:
            raise ValueError(f"invalid bucket name {bucket!r}")
        prefix = prefix.strip("/")
        if prefix:
            check_key(prefix)
        self.bucket = bucket
        self.prefix = prefix
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        region = (
            region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or DEFAULT_REGION
        )
        config = Config(
            region_name=region,
            s3={"addressing_style": "path"},
            # "standard" retries connection errors, read timeouts, throttling and 5xx with
            # jittered exponential backoff. total_max_attempts counts the first try (botocore's
            # "max_attempts" would not).
            retries={"total_max_attempts": max_attempts, "mode": "standard"},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_pool_connections=max_pool_connections,
            # The chunk container carries its own checksums; the SDK's default CRC on every
            # put and get is a second pass over each body that MinIO/SeaweedFS do not need.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        session = boto3.session.Session(
            aws_access_key_id=access_key, aws_secret_access_key=secret_key, region_name=region
        )
        # endpoint_url=None lets botocore read AWS_ENDPOINT_URL(_S3) itself.
        self._client = session.client("s3", endpoint_url=endpoint_url, config=config)
        self.endpoint_url: str = self._client.meta.endpoint_url
        self._parallelism = parallelism or max_pool_connections
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, **options: object) -> S3Store:
        """``s3://bucket`` or ``s3://bucket/some/prefix``; options are the constructor's keywords."""
        parsed = urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise ValueError(f"expected s3://bucket[/prefix], got {url!r}")
        if parsed.query or parsed.fragment or parsed.params:
            raise ValueError(f"s3:// URLs take no query or fragment (use AWS_* variables): {url!r}")
        return cls(parsed.netloc, parsed.path, **options)  # type: ignore[arg-type]

    # -- errors --------------------------------------------------------------

    def _object_key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _translate(self, exc: Exception, op: str, key: str | None) -> StorageError:
        where = f"{op} s3://{self.bucket}/{self._object_key(key) if key else self.prefix}"
        at = f" at {self.endpoint_url}"
        if isinstance(exc, ClientError):
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            message = error.get("Message") or code
            if code in _MISSING_KEY_CODES and key is not None:
                return ObjectNotFound(key)
            if code == "NoSuchBucket":
                return StorageUnavailable(f"{where}: bucket {self.bucket!r} does not exist{at}")
            if code in _REFUSED_CODES or status == 403:
                return StorageUnavailable(
                    f"{where}: access refused{at} ({code}: {message}); check credentials"
                )
            if status is not None and (status >= 500 or status == 429):
                return StorageUnavailable(f"{where}: server error{at} after retries ({code}: {message})")
            return StorageError(f"{where}: {code}: {message}")
        if isinstance(exc, NoCredentialsError | PartialCredentialsError):
            return StorageUnavailable(
                f"{where}: no usable credentials (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)"
            )
        if isinstance(exc, _NETWORK_ERRORS):
            return StorageUnavailable(f"{where}: cannot reach{at}: {exc}")
        if isinstance(exc, BotoCoreError):
            return StorageUnavailable(f"{where}{at}: {exc}")
        return StorageError(f"{where}: {exc}")

    _CAUGHT = (ClientError, BotoCoreError, *_NETWORK_ERRORS)

    # -- single objects ----------------------------------------------------

    def _read_body(self, response: dict, key: str = "", limit: int | None = None) -> bytes:  # type: ignore[type-arg]
        """The body, closed after; with ``limit``, refused from its Content-Length before a byte is
        read, and never read past ``limit + 1`` bytes (a server that lies about the length)."""
        body = response["Body"]
        try:
            if limit is None:
                return body.read()
            check_size(key, int(response.get("ContentLength") or 0), limit)
            data = body.read(limit + 1)
            check_size(key, len(data), limit)
            return data
        finally:
            body.close()

    def get(self, key: str, limit: int = DEFAULT_LIMIT) -> bytes:
        obj_key = self._object_key(key)
        try:
            return self._read_body(self._client.get_object(Bucket=self.bucket, Key=obj_key), key, limit)
        except self._CAUGHT as exc:
            raise self._translate(exc, "get", key) from exc

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if start < 0 or length < 0:
            raise ValueError(f"bad range start={start} length={length}")
        if length == 0:
            if self.head(key) is None:
                raise ObjectNotFound(key)
            return b""
        obj_key = self._object_key(key)
        try:
            response = self._client.get_object(
                Bucket=self.bucket, Key=obj_key, Range=f"bytes={start}-{start + length - 1}"
            )
            return self._read_body(response)
        except ClientError as exc:
            # A range that starts at or past the end: like a file read there, nothing.
            if exc.response.get("Error", {}).get("Code") == "InvalidRange":
                return b""
            raise self._translate(exc, "get_range", key) from exc
        except self._CAUGHT as exc:
            raise self._translate(exc, "get_range", key) from exc

    def put(self, key: str, data: bytes | memoryview) -> None:
        obj_key = self._object_key(key)
        # bytes/bytearray go to the HTTP layer as they are; a memoryview is streamed from
        # the caller's buffer. A single PUT is atomic on S3: readers see old or new, whole.
        body: bytes | bytearray | _MemoryviewReader
        body = _MemoryviewReader(data) if isinstance(data, memoryview) else data
        try:
            self._client.put_object(Bucket=self.bucket, Key=obj_key, Body=body, ContentLength=len(body))
        except self._CAUGHT as exc:
            raise self._translate(exc, "put", key) from exc

    def head(self, key: str) -> ObjectInfo | None:
        # A one-byte ranged GET, not HEAD: a HEAD's 404 has no body, so "no such key" and
        # "no such bucket" look the same, and a vanished bucket would read as a cache miss.
        obj_key = self._object_key(key)
        try:
            response = self._client.get_object(Bucket=self.bucket, Key=obj_key, Range="bytes=0-0")
            self._read_body(response)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            if code in _MISSING_KEY_CODES:
                return None
            if code == "InvalidRange":  # only an empty object has no byte 0
                return ObjectInfo(key, 0)
            raise self._translate(exc, "head", key) from exc
        except self._CAUGHT as exc:
            raise self._translate(exc, "head", key) from exc
        content_range = response.get("ContentRange") or ""
        total = content_range.rpartition("/")[2]
        size = int(total) if total.isdigit() else int(response.get("ContentLength", 0))
        modified = response.get("LastModified")
        return ObjectInfo(key, size, modified.timestamp() if modified else 0.0)

    def delete(self, key: str) -> None:
        obj_key = self._object_key(key)
        try:
            self._client.delete_object(Bucket=self.bucket, Key=obj_key)
        except self._CAUGHT as exc:
            raise self._translate(exc, "delete", key) from exc

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        full_prefix = f"{self.prefix}/{prefix}" if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0
        paginator = self._client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full_prefix):
                for obj in page.get("Contents", []):
                    modified = obj.get("LastModified")
                    yield ObjectInfo(
                        obj["Key"][strip:], int(obj["Size"]), modified.timestamp() if modified else 0.0
                    )
        except self._CAUGHT as exc:
            raise self._translate(exc, "list", None) from exc

    # -- batches -------------------------------------------------------------

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._parallelism, thread_name_prefix="s3store")
            return self._pool

    def _get_or_none(self, key: str, limit: int) -> bytes | None:
        try:
            return self.get(key, limit)
        except ObjectNotFound:
            return None

    def get_many(self, keys: Iterable[str], limit: int = DEFAULT_LIMIT) -> list[bytes | None]:
        keys = [check_key(k) for k in keys]
        if len(keys) <= 1:
            return [self._get_or_none(k, limit) for k in keys]
        return list(self._executor().map(lambda k: self._get_or_none(k, limit), keys))

    def exists_many(self, keys: Iterable[str]) -> list[bool]:
        keys = [check_key(k) for k in keys]
        if len(keys) <= 1:
            return [self.head(k) is not None for k in keys]
        return [info is not None for info in self._executor().map(self.head, keys)]

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._client.close()
