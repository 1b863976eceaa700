"""Acceptance metrics, defined once (DESIGN.md section 2) and used by generation stats, benchmark and metric.

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


def position_acceptance(acceptance_lengths: Sequence[int], depth: int | None = None) -> list[float]:
    """[alpha_1, ..., alpha_depth]; depth defaults to the longest acceptance seen."""
    if any(a < 0 for a in acceptance_lengths):
        raise ValueError("acceptance lengths must be >= 0")
    if depth is None:
        depth = max(acceptance_lengths, default=0)
    alphas = []
    for p in range(1, depth + 1):
        reached = sum(1 for a in acceptance_lengths if a >= p - 1)
        accepted = sum(1 for a in acceptance_lengths if a >= p)
        alphas.append(accepted / reached if reached else math.nan)
    return alphas
