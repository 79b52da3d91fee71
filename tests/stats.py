"""Chi-square helpers for the statistical tests of speculative sampling."""

from __future__ import annotations

from collections import Counter

import numpy as np
from scipy.stats import chisquare


def chi_square_pvalue(
    counts: Counter, expected_probs: dict[tuple[int, ...], float], min_expected: float = 5.0
) -> float:
    """Goodness of fit of observed outcome counts to exact probabilities.

    Cells whose expected count is below ``min_expected`` are pooled into one cell so the
    chi-square approximation holds. Outcomes outside ``expected_probs`` count as impossible
    and make the p-value 0.
    """
    n = sum(counts.values())
    if any(k not in expected_probs or expected_probs[k] == 0 for k in counts):
        return 0.0
    obs, exp = [], []
    pooled_obs, pooled_exp = 0.0, 0.0
    for k, p in expected_probs.items():
        e = p * n
        if e < min_expected:
            pooled_obs += counts.get(k, 0)
            pooled_exp += e
        else:
            obs.append(counts.get(k, 0))
            exp.append(e)
    if pooled_exp > 0:
        obs.append(pooled_obs)
        exp.append(pooled_exp)
    exp_arr = np.array(exp) * (n / np.sum(exp))
    return float(chisquare(np.array(obs, dtype=float), exp_arr).pvalue)
