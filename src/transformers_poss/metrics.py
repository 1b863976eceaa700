"""Acceptance metrics, defined once and used by generation stats, benchmark and metric.

A *round* drafts some tokens, the target verifies them, and `a` of them are accepted (the bonus token that the
target adds itself is not counted in `a`).

- acceptance length tau = mean over rounds of `a + 1`;
- position acceptance alpha_p = P(position p accepted | positions 1..p-1 accepted)
  = count(rounds with a >= p) / count(rounds with a >= p - 1), for p = 1..depth (NaN when no round reached p-1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def mean_acceptance_length(acceptance_lengths: Sequence[int]) -> float:
    """tau: mean of (accepted draft tokens + 1) over rounds; NaN for no rounds."""
    if len(acceptance_lengths) == 0:
        return math.nan
    return sum(a + 1 for a in acceptance_lengths) / len(acceptance_lengths)


def rounds_accepting_at_least(acceptance_lengths: Sequence[int], depth: int) -> list[int]:
    """[count of rounds with a >= p for p = 0..depth] (entry 0 counts every round)."""
    if any(a < 0 for a in acceptance_lengths):
        raise ValueError("acceptance lengths must be >= 0")
    return [sum(1 for a in acceptance_lengths if a >= p) for p in range(depth + 1)]


def position_acceptance_from_counts(at_least: Sequence[int]) -> list[float]:
    """[alpha_1, ..., alpha_depth] from `rounds_accepting_at_least` counts (which add over sets of rounds)."""
    return [at_least[p] / at_least[p - 1] if at_least[p - 1] else math.nan for p in range(1, len(at_least))]


def position_acceptance(acceptance_lengths: Sequence[int], depth: int | None = None) -> list[float]:
    """[alpha_1, ..., alpha_depth]; depth defaults to the longest acceptance seen."""
    if depth is None:
        depth = max(acceptance_lengths, default=0)
    return position_acceptance_from_counts(rounds_accepting_at_least(acceptance_lengths, depth))
