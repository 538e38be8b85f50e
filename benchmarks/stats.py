"""Statistics the benchmarks share, from the libraries that define them: numpy and scipy."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.stats import mannwhitneyu


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between closest ranks (numpy's default, as vLLM's
    benchmarks report them)."""
    return float(np.percentile(np.asarray(values, dtype=float), q))


def mann_whitney(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Mann-Whitney U of ``x`` and its two-sided p-value: the normal approximation with ties
    corrected and no continuity correction, so it holds for the samples of any size we take."""
    result = mannwhitneyu(x, y, alternative="two-sided", method="asymptotic", use_continuity=False)
    return float(result.statistic), float(result.pvalue)
