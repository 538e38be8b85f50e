"""benchmarks/context_study.py's entropy estimates on sequences whose answer is known."""

from __future__ import annotations

import numpy as np

from benchmarks.context_study import conditional_entropy, entropy, study


def test_entropy_of_uniform_symbols_is_their_bits() -> None:
    samples = np.random.default_rng(0).integers(0, 4, 100_000)
    assert abs(entropy(samples) - 2.0) < 0.01
    assert entropy(np.zeros(50, np.int64)) == 0.0


def test_a_context_that_decides_the_symbol_leaves_no_entropy() -> None:
    rng = np.random.default_rng(1)
    context = rng.integers(-3, 4, 20_000)
    assert conditional_entropy(context.copy(), context) < 0.01
    independent = rng.integers(-3, 4, 20_000)
    assert abs(conditional_entropy(independent, context) - entropy(independent)) < 0.02


def test_the_study_finds_what_each_context_knows() -> None:
    """Components that repeat the token before gain from that context only; components that copy
    the component before gain from the neighbour only."""
    rng = np.random.default_rng(2)
    walk = np.repeat(rng.integers(-2, 3, (1, 2, 1, 500)), 2, axis=3)  # each value twice in a row
    copies = np.repeat(rng.integers(-2, 3, (1, 2, 1, 1000)), 2, axis=2)  # component 1 = component 0
    slow, same = study(walk), study(copies)
    assert slow["H|previous token"] < 0.8 * slow["H0"] and slow["H|neighbour"] == slow["H0"]
    assert same["H|neighbour"] < 0.6 * same["H0"] and abs(same["H|previous token"] - same["H0"]) < 0.05
