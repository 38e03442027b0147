"""The AUC an (ε, δ)-DP mechanism allows a membership-inference attack (privacy/tradeoff.py):
the area under min(1, e^ε·x + δ, 1 − e^{−ε}(1 − δ − x)), checked against a dense numerical
integral, its closed form at δ = 0, its limits, and ROC curves of mechanisms that meet it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from privacy.tradeoff import dp_auc_bound, dp_tpr_bound


@pytest.mark.parametrize("epsilon,delta", [(0.0, 0.0), (0.5, 1e-5), (1.0, 0.0), (2.0, 0.01), (8.0, 1e-5),
                                           (0.0, 0.2), (3.0, 0.5)])
def test_the_bound_is_the_area_under_the_region(epsilon, delta):
    x = np.linspace(0.0, 1.0, 2_000_001)
    y = np.minimum.reduce([np.ones_like(x), math.exp(epsilon) * x + delta,
                           1 - math.exp(-epsilon) * (1 - delta - x)])
    dense = float(np.sum((x[1:] - x[:-1]) * (y[1:] + y[:-1]) / 2))
    assert dp_auc_bound(epsilon, delta) == pytest.approx(dense, abs=1e-9)
    np.testing.assert_allclose(dp_tpr_bound(x[::1000], epsilon, delta), y[::1000])


def test_closed_form_at_delta_zero_and_limits():
    # δ = 0: two segments meeting at x* = 1/(1 + e^ε), y* = e^ε/(1 + e^ε): area = (1 + y* − x*)/2
    for eps in (0.1, 1.0, 4.0):
        q = math.exp(eps) / (1 + math.exp(eps))
        assert dp_auc_bound(eps, 0.0) == pytest.approx((1 + q - (1 - q)) / 2, abs=1e-12)
    assert dp_auc_bound(0.0, 0.0) == pytest.approx(0.5)
    assert dp_auc_bound(50.0, 0.0) == pytest.approx(1.0, abs=1e-12)
    # ε = 1 allows an AUC of 0.73 at most: a LiRA AUC of 0.9 refutes it
    assert 0.73 < dp_auc_bound(1.0, 1e-5) < 0.732
    # monotone in ε and in δ
    eps = np.linspace(0, 10, 41)
    bounds = [dp_auc_bound(e, 1e-5) for e in eps]
    assert all(b2 > b1 for b1, b2 in zip(bounds, bounds[1:]))
    assert dp_auc_bound(1.0, 0.1) > dp_auc_bound(1.0, 0.01) > dp_auc_bound(1.0, 0.0)


def test_randomised_response_meets_the_bound():
    """ε-randomised response on one bit (say the truth with probability e^ε/(1+e^ε)) is ε-DP and
    its likelihood-ratio test attains the bound: AUC = e^ε/(1+e^ε) = dp_auc_bound(ε, 0)."""
    for eps in (0.3, 1.0, 2.5):
        p = math.exp(eps) / (1 + math.exp(eps))
        # scores: member says 1 w.p. p, non-member says 1 w.p. 1 - p; ties count 1/2
        auc = p * p + 0.5 * (p * (1 - p) + (1 - p) * p)
        assert auc == pytest.approx(dp_auc_bound(eps, 0.0), abs=1e-12)


def test_bad_arguments_are_refused():
    for eps, delta in ((-1.0, 0.0), (float("inf"), 0.0), (1.0, 1.0), (1.0, -0.1), (float("nan"), 0.0)):
        with pytest.raises(ValueError):
            dp_auc_bound(eps, delta)
    with pytest.raises(ValueError, match="fpr"):
        dp_tpr_bound([1.5], 1.0, 0.0)
