"""One gateway setting against another, in one run: fresh gateways alternate between the two.

    python -m benchmarks.setting_ab --baseline-env CACHEGEN_MALLOC_TRIM_INTERVAL_S=0 --rounds 2 \\
        --out benchmarks/results/setting_ab_malloc_trim.json
    python -m benchmarks.setting_ab --baseline 7ba0a7b --rounds 4

With ``--baseline REV`` the baseline is that revision's code (a git worktree), with this side's
settings.

Each round starts a gateway with the baseline's settings and one with this checkout's defaults
(plus ``--env``), one after the other (the baseline first in even rounds, second in odd ones, so
that an effect of the order does not land on one side), and runs ``benchmarks/vs_vllm.py``'s
workloads on each:
cold TTFT of a 17,000-character context, a new question on it, the same request again, time per
output token, tokens/s at ``--concurrency`` clients for ``--duration`` s, and the peak RSS. The
report gives the medians of each side and their ratios (this / baseline).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from benchmarks.ab import REPO, add_baseline_arguments, alternate, medians, parse_env, report, side_repos
from benchmarks.vs_vllm import LICENCE, gateway_env, peak_rss_gb, run_all
from engine.loading import convert_default_model, default_cache_dir
from tests.gateway_process import GatewayProcess


def one_gateway(
    env: dict[str, str], text: str, args: argparse.Namespace, root: Path, repo: Path = REPO
) -> dict[str, float]:
    model = convert_default_model(default_cache_dir())
    store = Path(tempfile.mkdtemp(dir=root))
    with GatewayProcess(gateway_env(model, "float32", store) | env, store / "gateway.log", repo=repo) as g:
        assert g.proc is not None
        out = run_all(g.url, text, args.duration, [args.concurrency])
        out["peak_rss_gb"] = peak_rss_gb(g.proc.pid)
    tokens = out.pop("tokens_per_s")
    return {**out, f"tokens_per_s_{args.concurrency}": tokens[str(args.concurrency)]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_baseline_arguments(parser)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/setting_ab.json"))
    args = parser.parse_args(argv)
    text = LICENCE.read_text()[:17000]
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        repos = side_repos(args, Path(tmp), stack)
        sides = alternate(
            {"baseline": parse_env(args.baseline_env or args.env), "this": parse_env(args.env)},
            args.rounds,
            lambda name, env, __: one_gateway(env, text, args, Path(tmp), repos[name]),
        )
    report(args.out, args.baseline or " ".join(args.baseline_env), sides, medians(sides))
    return 0


if __name__ == "__main__":
    sys.exit(main())
