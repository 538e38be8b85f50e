"""Chunk keys and context ids: deterministic, chained, rooted in the fingerprint."""

from __future__ import annotations

import subprocess
import sys

import pytest

from scheduler.prefix import chunk_keys, context_id, make_fingerprint


def fingerprint(chunk_size: int = 4, weights: str = "w"):
    return make_fingerprint(weights=weights, config={"layers": 2}, vocabulary="v", chunk_size=chunk_size)


def test_only_full_chunks_get_keys():
    fp = fingerprint()
    assert len(chunk_keys(fp, list(range(11)), 4)) == 2
    assert len(chunk_keys(fp, list(range(12)), 4)) == 3
    assert chunk_keys(fp, [1, 2, 3], 4) == []


def test_keys_chain_over_the_whole_prefix():
    fp = fingerprint()
    a = chunk_keys(fp, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = chunk_keys(fp, [1, 2, 3, 4, 5, 6, 7, 9], 4)
    c = chunk_keys(fp, [0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[0] == b[0] and a[1] != b[1]
    assert a[0] != c[0] and a[1] != c[1]  # same second chunk, different history
    assert chunk_keys(fp, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == a  # a longer prompt shares the prefix keys


@pytest.mark.parametrize("change", ["weights", "chunk_size"])
def test_fingerprint_parts_change_every_key(change):
    tokens = list(range(8))
    base = chunk_keys(fingerprint(), tokens, 4)
    other = fingerprint(weights="w2") if change == "weights" else fingerprint(chunk_size=8)
    assert set(base).isdisjoint(chunk_keys(other, tokens, 4))


def test_context_id_is_stable_and_content_addressed():
    fp = fingerprint()
    assert context_id(fp, [1, 2, 3]) == context_id(fp, [1, 2, 3])
    assert context_id(fp, [1, 2, 3]) != context_id(fp, [1, 2, 4])
    assert context_id(fp, [1, 2, 3]).startswith("ctx-")


def test_keys_are_identical_in_another_process():
    code = (
        "from scheduler.prefix import chunk_keys, make_fingerprint;"
        "fp = make_fingerprint(weights='w', config={'layers': 2}, vocabulary='v', chunk_size=4);"
        "print(','.join(chunk_keys(fp, list(range(12)), 4)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123"},
    )
    assert out.stdout.strip().split(",") == chunk_keys(fingerprint(), list(range(12)), 4)
