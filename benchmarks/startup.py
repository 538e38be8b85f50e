"""Gateway start-up time: from ``python -m app`` to ``GET /health`` saying ``ok``.

    python -m benchmarks.startup [--rounds 2]

Issue 16's "keep start-up under 30 s". Each round times three starts of a
fresh gateway (default model, local store), each with its own numba cache
folder (``NUMBA_CACHE_DIR``):

* ``empty_cache``: a new, empty folder: every pinned kernel signature of the
  codec and the engine compiles at import;
* ``after_setup_build``: a new folder that ``scripts/setup.sh``'s last step
  (building the gateway once, with an in-memory store) filled first; that
  build is timed too (``setup_build``);
* ``warm``: the same folder again, as every later start finds it.

Prints a table of the medians and writes JSON to ``benchmarks/results/startup.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.gateway_process import GatewayProcess

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
# scripts/setup.sh's last step
SETUP_BUILD = (
    "from app.build import build_gateway; from app.settings import Settings; build_gateway(Settings())"
)


def start_seconds(numba_cache: Path, root: Path) -> float:
    """One gateway's start, until it is healthy; it is stopped again."""
    env = {"CACHEGEN_STORE": f"file://{root}/store", "NUMBA_CACHE_DIR": str(numba_cache)}
    started = time.perf_counter()
    with GatewayProcess(env, root / "gateway.log"):
        return time.perf_counter() - started


def setup_build_seconds(numba_cache: Path) -> float:
    env = {**os.environ, "CACHEGEN_STORE": "memory://", "NUMBA_CACHE_DIR": str(numba_cache)}
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", SETUP_BUILD], env=env, cwd=REPO, check=True, capture_output=True)
    return time.perf_counter() - started


def one_round(root: Path) -> dict[str, float]:
    empty, built = root / "numba-empty", root / "numba-built"
    row = {"empty_cache": start_seconds(empty, root)}
    row["setup_build"] = setup_build_seconds(built)
    row["after_setup_build"] = start_seconds(built, root)
    row["warm"] = start_seconds(built, root)
    return {name: round(seconds, 2) for name, seconds in row.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS / "startup.json")
    args = p.parse_args()
    rounds = []
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="startup-") as tmp:
            rounds.append(one_round(Path(tmp)))
        print(f"round {i}: {rounds[-1]}", flush=True)
    summary = {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}
    print("\n| start | seconds (median) |\n|---|---:|")
    for name, seconds in summary.items():
        print(f"| {name} | {seconds} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"args": {**vars(args), "out": str(args.out)}, "rounds": rounds, "summary": summary}
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
