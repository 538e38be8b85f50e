"""This checkout against another revision in one run: the baseline's worktree, and the report."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, TypeVar

Setting = TypeVar("Setting")

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


def parse_env(items: list[str]) -> dict[str, str]:
    """``NAME=VALUE`` items as a dict of settings."""
    pairs = [item.split("=", 1) for item in items]
    if any(len(pair) != 2 for pair in pairs):
        raise SystemExit(f"settings are NAME=VALUE: {items}")
    return dict(pairs)  # type: ignore[arg-type]


def add_baseline_arguments(parser: argparse.ArgumentParser) -> None:
    """``--baseline-env`` or ``--baseline REV``, one of them required; then ``--env``."""
    base = parser.add_mutually_exclusive_group(required=True)
    base.add_argument("--baseline-env", nargs="+", help="NAME=VALUE settings of the baseline")
    base.add_argument(
        "--baseline", help="a git revision: the baseline runs its code, with this side's settings"
    )
    parser.add_argument("--env", nargs="*", default=[], help="NAME=VALUE settings of this side")


def side_repos(args: argparse.Namespace, root: Path, stack: ExitStack) -> dict[str, Path]:
    """Where each side's code runs: this checkout, and for ``--baseline`` that revision's worktree
    under ``root`` (removed when ``stack`` closes)."""
    repos = {"baseline": REPO, "this": REPO}
    if args.baseline:
        repos["baseline"] = stack.enter_context(baseline_worktree(args.baseline, root))
    return repos


def alternate(
    settings: dict[str, Setting], rounds: int, run: Callable[[str, Setting, int], dict[str, Any]]
) -> dict[str, list[dict[str, Any]]]:
    """``run(name, setting, round)`` for each side once per round, each side first in turn, so that
    an effect of the order lands on neither side. Returns each side's results, printed as they come."""
    sides: dict[str, list[dict[str, Any]]] = {name: [] for name in settings}
    order = list(settings.items())
    for r in range(rounds):
        for name, setting in order if r % 2 == 0 else order[::-1]:
            sides[name].append(run(name, setting, r))
            print(f"round {r} {name}: {sides[name][-1]}", flush=True)
    return sides


def medians(sides: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Each side's median of every measure over its rounds."""
    return {side: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for side, rows in sides.items()}


def report(
    out: Path,
    revision: str,
    sides: dict[str, list[dict[str, Any]]],
    summary: dict[str, dict[str, float]],
    extra: dict[str, Any] | None = None,
) -> None:
    """Write the rounds and the summaries of both sides (``baseline``, ``this``) with their ratios
    to ``out`` as JSON (with ``extra``'s keys added), and print them as a table."""
    ratios = {key: round(summary["this"][key] / summary["baseline"][key], 2) for key in summary["this"]}
    result = {"baseline": revision, "rounds": sides, "medians": summary, "ratio_this_over_baseline": ratios}
    result.update(extra or {})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'measure':<30}{'baseline':>10}{'this':>10}{'ratio':>8}")
    for key, ratio in ratios.items():
        print(f"{key:<30}{summary['baseline'][key]:>10.3f}{summary['this'][key]:>10.3f}{ratio:>8.2f}")
    print(f"written to {out}")
