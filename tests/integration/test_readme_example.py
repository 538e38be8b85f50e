"""The README's "Using it" example, run as written against a real gateway process."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from tests.gateway_process import REPO

pytestmark = pytest.mark.slow


def readme_example() -> str:
    readme = (REPO / "README.md").read_text()
    match = re.search(r"<!-- readme-example:[^>]*-->\n```bash\n(.*?)```", readme, re.DOTALL)
    assert match, "the README lost its runnable example"
    return match.group(1)


def json_values(text: str) -> list[dict]:
    decoder, values, at = json.JSONDecoder(), [], 0
    while at < len(text.strip()):
        value, end = decoder.raw_decode(text, at)
        values.append(value)
        at = end
        while at < len(text) and text[at].isspace():
            at += 1
    return values


@pytest.mark.skipif(shutil.which("curl") is None, reason="the example uses curl")
def test_the_readme_example_works_as_written(gateway):
    script = readme_example().replace("localhost:8000", gateway.url.removeprefix("http://"))
    out = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    context, answer = json_values(out.stdout)
    assert context["object"] == "context" and context["cached_tokens"] >= 256, context
    assert answer["object"] == "chat.completion", answer
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= context["cached_tokens"] - 16
    assert answer["choices"][0]["message"]["content"]
