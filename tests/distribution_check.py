"""Two-sample chi-square test of sampled outputs (speculative decoding must keep the target's
distribution): do two histograms come from the same distribution?"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np
from scipy.stats import chi2_contingency


def same_distribution_pvalue(first: dict[Hashable, int], second: dict[Hashable, int]) -> float:
    """The chi-square p-value of the two histograms; cells seen fewer than 10 times in all are pooled."""
    keys = sorted(set(first) | set(second))
    table = np.asarray([[first.get(k, 0) for k in keys], [second.get(k, 0) for k in keys]])
    rare = table.sum(axis=0) < 10
    if rare.any():
        table = np.concatenate([table[:, ~rare], table[:, rare].sum(axis=1, keepdims=True)], axis=1)
    return float(chi2_contingency(table).pvalue)
