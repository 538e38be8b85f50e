"""This checkout against another revision in one run: the baseline's worktree, and the report."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


@contextmanager
def baseline_worktree(revision: str, root: Path) -> Iterator[Path]:
    """``revision`` checked out into a temporary git worktree under ``root``, removed after."""
    worktree = root / "baseline"
    subprocess.run(["git", "worktree", "add", "--detach", str(worktree), revision], cwd=REPO, check=True)
    try:
        yield worktree
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO, check=False)


def report(out: Path, revision: str, sides: dict[str, list[dict[str, Any]]], summary: dict[str, dict[str, float]]) -> None:
    """Write the rounds and the summaries of both sides (``baseline``, ``this``) with their ratios
    to ``out`` as JSON, and print them as a table."""
    ratios = {key: round(summary["this"][key] / summary["baseline"][key], 2) for key in summary["this"]}
    result = {"baseline": revision, "rounds": sides, "medians": summary, "ratio_this_over_baseline": ratios}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'measure':<30}{'baseline':>10}{'this':>10}{'ratio':>8}")
    for key, ratio in ratios.items():
        print(f"{key:<30}{summary['baseline'][key]:>10.3f}{summary['this'][key]:>10.3f}{ratio:>8.2f}")
    print(f"written to {out}")
