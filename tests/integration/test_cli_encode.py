"""``python -m app encode``: pre-encodes files into the configured store, same ids as the API."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from scheduler.layout import manifest_key
from tests.gateway_process import REPO

pytestmark = pytest.mark.slow

TEXT = (Path(__file__).parent.parent / "data" / "python_history.txt").read_text()[:1500]


def encode(*args: str, store: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app", "encode", *args],
        check=False,
        cwd=REPO,
        env={**os.environ, "CACHEGEN_STORE": f"file://{store}"},
        capture_output=True,
        text=True,
        timeout=600,
    )


def last_progress(stderr: str, stage: str) -> tuple[int, int]:
    """The last ``done/total`` the progress bar of ``stage`` printed."""
    counts = re.findall(rf"{stage}:\s+\d+%\|[^|]*\| (\d+)/(\d+)", stderr.replace("\r", "\n"))
    assert counts, stderr
    done, total = counts[-1]
    return int(done), int(total)


def test_encode_files_into_the_store(tmp_path, gateway, model_dir):
    source = tmp_path / "doc.txt"
    source.write_text(TEXT)
    missing = tmp_path / "missing.txt"
    store = tmp_path / "store"

    out = encode(str(source), str(missing), "--levels", "lossless", store=store)
    assert out.returncode == 1, out.stderr  # one file cannot be read: nothing is encoded
    assert f"{missing}: cannot read: no such file" in out.stderr
    assert out.stdout == "" and not store.exists()

    out = encode(str(source), "--levels", "lossless", store=store)
    assert out.returncode == 0, out.stderr
    line = json.loads(out.stdout)  # stdout holds only the results; progress is on stderr
    assert line["file"] == str(source) and line["cached_tokens"] >= 256
    assert (store / manifest_key(line["id"])).is_file()
    # real progress: the prefill in tokens, then one encode per chunk and level
    assert last_progress(out.stderr, "prefill") == (line["tokens"], line["tokens"])
    assert last_progress(out.stderr, "encode") == (line["chunks"], line["chunks"])  # one level
    # the same text through the API of another process gets the same id
    via_api = httpx.post(f"{gateway.url}/contexts", json={"text": TEXT, "levels": ["lossless"]}, timeout=300)
    assert via_api.json()["id"] == line["id"]


def test_encode_refuses_unknown_levels_and_long_files(tmp_path, model_dir):
    source = tmp_path / "doc.txt"
    source.write_text(TEXT)
    store = tmp_path / "store"
    out = encode(str(source), "--levels", "lossles", store=store)
    assert out.returncode == 1
    assert "unknown levels lossles; known: lossless" in out.stderr
    long = tmp_path / "long.txt"
    long.write_text("word " * 9000)  # beyond the default model's 8192-token window
    out = encode(str(source), str(long), store=store)
    assert out.returncode == 1
    assert re.search(rf"{re.escape(str(long))}: \d+ tokens, more than the model's 8191", out.stderr), (
        out.stderr
    )
    assert "1 of 2 files refused; nothing encoded" in out.stderr
    assert out.stdout == "" and not (store / "contexts").exists()
