"""What (ε, δ)-DP allows a membership-inference attack: the hypothesis-testing region.

Any test of "x was in the training data" against "x was not", run on the output of an (ε, δ)-DP
mechanism, has at every false-positive rate x a true-positive rate (Kairouz, Oh, Viswanath 2015;
Dong, Roth, Su 2019, f-DP's f_{ε,δ})::

    TPR(x) ≤ min(1, e^ε·x + δ, 1 − e^{−ε}·(1 − δ − x)).

Its ROC curve therefore lies under that piecewise-linear curve, and its AUC under the area below
it, :func:`dp_auc_bound`. An attack's measured AUC above the bound contradicts the (ε, δ) claim
(up to the sampling error of the measurement: compare the lower end of its confidence interval).

Pure numpy: names no method and no attack.
"""

from __future__ import annotations

import math

import numpy as np

from .validation import check_nonnegative

__all__ = ["dp_tpr_bound", "dp_auc_bound"]


def _check(epsilon, delta) -> tuple[float, float]:
    epsilon = check_nonnegative(epsilon, "epsilon")
    delta = check_nonnegative(delta, "delta")
    if delta >= 1.0:
        raise ValueError(f"delta must lie in [0, 1), got {delta!r}")
    return epsilon, delta


def dp_tpr_bound(fpr, epsilon: float, delta: float):
    """The largest TPR an (ε, δ)-DP mechanism allows at false-positive rate ``fpr`` (array-like
    in [0, 1]): ``min(1, e^ε·x + δ, 1 − e^{−ε}·(1 − δ − x))``."""
    epsilon, delta = _check(epsilon, delta)
    x = np.asarray(fpr, dtype=float)
    if np.any((x < 0) | (x > 1)) or not np.all(np.isfinite(x)):
        raise ValueError("fpr must lie in [0, 1]")
    e = math.exp(epsilon)
    return np.minimum.reduce([np.ones_like(x), e * x + delta, 1.0 - (1.0 - delta - x) / e])


def dp_auc_bound(epsilon: float, delta: float) -> float:
    """The area under :func:`dp_tpr_bound` over x in [0, 1]: the largest AUC an (ε, δ)-DP
    mechanism allows a membership-inference attack. Exact: the curve is piecewise linear with
    its kinks where its pieces meet — x = (1 − δ)/(1 + e^ε) (the two slopes), (1 − δ)·e^{−ε}
    (the steep one reaches 1) and 1 − δ (the flat one reaches 1) — so the trapezoid rule over
    those points is the integral. 0.5 at (0, 0); tends to 1 as ε grows."""
    epsilon, delta = _check(epsilon, delta)
    e = math.exp(epsilon)
    kinks = [0.0, 1.0, (1.0 - delta) / (1.0 + e), (1.0 - delta) / e, 1.0 - delta]
    x = np.unique(np.clip(kinks, 0.0, 1.0))
    y = dp_tpr_bound(x, epsilon, delta)
    return float(np.sum((x[1:] - x[:-1]) * (y[1:] + y[:-1]) / 2.0))
