"""``python -m app encode``: pre-encodes files into the configured store, same ids as the API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.gateway_process import REPO

pytestmark = pytest.mark.slow

TEXT = (Path(__file__).parent.parent / "data" / "python_history.txt").read_text()[:1500]


def test_encode_files_into_the_store(tmp_path, gateway, model_dir):
    source = tmp_path / "doc.txt"
    source.write_text(TEXT)
    missing = tmp_path / "missing.txt"
    store = tmp_path / "store"
    env = {**os.environ, "CACHEGEN_STORE": f"file://{store}"}
    out = subprocess.run(
        [sys.executable, "-m", "app", "encode", str(source), str(missing), "--levels", "lossless"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 1, out.stderr  # one file could not be read
    assert f"{missing}: cannot read" in out.stdout + out.stderr
    line = next(json.loads(x) for x in out.stdout.splitlines() if x.startswith("{"))
    assert line["file"] == str(source) and line["cached_tokens"] >= 256
    assert (store / "contexts" / f"{line['id']}.json").is_file()
    # the same text through the API of another process gets the same id
    via_api = httpx.post(f"{gateway.url}/contexts", json={"text": TEXT, "levels": ["lossless"]}, timeout=300)
    assert via_api.json()["id"] == line["id"]
