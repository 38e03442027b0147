"""Audit statistics (privacy/audit.py): ROC/AUC, TPR at low FPR, LiRA, one-run ε lower bounds."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import special, stats
from sklearn import metrics as skm

from privacy import audit as A


def _rng(seed=0):
    return np.random.default_rng(seed)


# ---------------------------------------------------------------- ROC / AUC


def test_perfect_separation_auc_is_one_with_ci_upper_one():
    scores = np.r_[np.linspace(1, 2, 50), np.linspace(-2, -1, 70)]
    y = np.r_[np.ones(50, bool), np.zeros(70, bool)]
    assert A.auc(scores, y) == 1.0
    value, low, high = A.auc_with_ci(scores, y, n_bootstrap=200, rng=_rng(1))
    assert value == 1.0 and high == 1.0 and low == 1.0
    # reversed scores: AUC 0
    assert A.auc(-scores, y) == 0.0


def test_identical_distributions_ci_covers_half():
    rng = _rng(5)
    scores = rng.normal(size=4000)
    y = np.r_[np.ones(2000, bool), np.zeros(2000, bool)]
    value, low, high = A.auc_with_ci(scores, y, n_bootstrap=300, rng=rng)
    assert low <= 0.5 <= high
    assert low <= value <= high
    assert 0.02 < high - low < 0.05  # sd of the AUC here is ~0.009: width ≈ 0.035


def test_auc_ci_coverage_under_null():
    # a 95% interval may miss 0.5 on a given seed; over 30 datasets it should rarely do so
    rng = _rng(6)
    y = np.r_[np.ones(400, bool), np.zeros(400, bool)]
    covered = 0
    for _ in range(30):
        _, low, high = A.auc_with_ci(rng.normal(size=800), y, n_bootstrap=200, rng=rng)
        covered += low <= 0.5 <= high
    assert covered >= 25


def test_auc_ci_shrinks_away_from_half_for_a_real_signal():
    rng = _rng(3)
    y = rng.random(3000) < 0.5
    scores = rng.normal(size=3000) + 0.5 * y
    value, low, high = A.auc_with_ci(scores, y, n_bootstrap=300, rng=rng)
    expected = stats.norm.cdf(0.5 / math.sqrt(2))  # ≈ 0.638
    assert low > 0.5 and low <= expected <= high
    assert value == pytest.approx(skm.roc_auc_score(y, scores), abs=1e-12)


def test_auc_bootstrap_is_reproducible_and_stratified():
    rng = _rng(4)
    y = np.r_[np.ones(3, bool), np.zeros(200, bool)]
    scores = rng.normal(size=203) + y
    a = A.auc_with_ci(scores, y, n_bootstrap=100, rng=_rng(7))
    b = A.auc_with_ci(scores, y, n_bootstrap=100, rng=_rng(7))
    assert a == b  # same Generator seed -> same interval; never fails for lack of a class


@pytest.mark.parametrize("seed", range(5))
def test_auc_and_roc_match_sklearn_with_ties(seed):
    rng = _rng(seed)
    n = 300
    y = rng.random(n) < 0.4
    scores = rng.integers(0, 12, size=n).astype(float) + 0.7 * y  # heavy ties
    assert A.auc(scores, y) == pytest.approx(skm.roc_auc_score(y, scores), abs=1e-12)
    fpr, tpr, thr = A.roc_curve(scores, y)
    sk_fpr, sk_tpr, sk_thr = skm.roc_curve(y, scores, drop_intermediate=False)
    np.testing.assert_allclose(fpr, sk_fpr, atol=1e-12)
    np.testing.assert_allclose(tpr, sk_tpr, atol=1e-12)
    np.testing.assert_array_equal(thr[1:], sk_thr[1:])
    assert thr[0] == np.inf and np.all(np.diff(thr) < 0)
    # trapezoid area under the exact (tie-diagonal) curve equals the Mann-Whitney AUC
    assert np.trapezoid(tpr, fpr) == pytest.approx(A.auc(scores, y), abs=1e-12)


def test_auc_ties_count_half():
    assert A.auc([1.0, 1.0], [1, 0]) == 0.5
    assert A.auc([2.0, 1.0, 1.0], [1, 1, 0]) == pytest.approx(0.75)


# ---------------------------------------------------------------- TPR at FPR


def test_tpr_at_fpr_constructed_exact():
    # 100 non-members with scores 0..99; 10 members with scores 95.5..104.5 step 1
    nonmembers = np.arange(100.0)
    members = np.arange(10.0) + 95.5
    scores = np.r_[members, nonmembers]
    y = np.r_[np.ones(10, bool), np.zeros(100, bool)]
    # FPR <= 0.01 allows exactly one false positive (non-member 99): threshold 98.5 ->
    # members >= 98.5 are 98.5 .. 104.5 = 7; with threshold 99 the FP is 1 and TP is 6,
    # threshold 98.5 has FP = 1 (only 99) and TP = 7.
    res = A.tpr_at_fpr(scores, y, 0.01)
    assert res["tpr"] == pytest.approx(0.7)
    assert res["fpr"] == pytest.approx(0.01)
    assert res["n_members"] == 10 and res["n_nonmembers"] == 100
    assert res["sufficient"] is True
    # FPR <= 0.0 (not allowed: max_fpr in (0, 1]) -> use 0.005: no false positive allowed
    res0 = A.tpr_at_fpr(scores, y, 0.005)
    assert res0["tpr"] == pytest.approx(0.6)  # members above 99: 99.5 .. 104.5 = 6
    assert res0["fpr"] == 0.0
    assert res0["sufficient"] is False  # 100 < 1/0.005 = 200
    # FPR <= 0.05: 5 FPs (95..99) -> every member >= 95.5 -> TPR 1, achieved fpr is 0.04
    # (threshold 95.5 has FP = 4: 96, 97, 98, 99)
    res5 = A.tpr_at_fpr(scores, y, 0.05)
    assert res5["tpr"] == 1.0 and res5["fpr"] == pytest.approx(0.04)
    # Clopper-Pearson bounds
    lo, hi = res["tpr_low"], res["tpr_high"]
    assert lo == pytest.approx(stats.beta.ppf(0.025, 7, 4))
    assert hi == pytest.approx(stats.beta.ppf(0.975, 8, 3))
    assert res5["tpr_high"] == 1.0 and res0["tpr_low"] > 0


def test_tpr_at_fpr_is_le_and_maximal_against_roc():
    rng = _rng(11)
    y = rng.random(5000) < 0.5
    scores = np.round(rng.normal(size=5000) + 1.5 * y, 1)  # ties
    fpr, tpr, _ = A.roc_curve(scores, y)
    for x in (0.001, 0.01, 0.1, 0.37):
        res = A.tpr_at_fpr(scores, y, x)
        assert res["fpr"] <= x
        assert res["tpr"] == pytest.approx(tpr[fpr <= x].max())
        assert res["tpr_low"] <= res["tpr"] <= res["tpr_high"]
        # the achieved point is on the ROC curve
        assert np.any((fpr == res["fpr"]) & (tpr == res["tpr"]))


def test_insufficient_nonmembers_flagged_and_required():
    rng = _rng(12)
    y = np.r_[np.ones(500, bool), np.zeros(500, bool)]
    scores = rng.normal(size=1000) + y
    assert A.tpr_at_fpr(scores, y, 0.01)["sufficient"] is True
    assert A.tpr_at_fpr(scores, y, 0.001)["sufficient"] is False
    assert A.min_nonmembers(0.001) == 1000 and A.min_nonmembers(0.01) == 100
    A.require_enough_nonmembers(1000, 0.001)  # exactly enough
    msg = r"needs at least 1000 non-members for FPR <= 0.001, got 500"
    with pytest.raises(ValueError, match=msg):
        A.require_enough_nonmembers(500, 0.001)
    with pytest.raises(ValueError, match="max_fpr"):
        A.require_enough_nonmembers(500, 0.0)


def test_mia_metrics_keys_and_values():
    rng = _rng(13)
    y = np.r_[np.ones(400, bool), np.zeros(600, bool)]
    scores = rng.normal(size=1000) + 2 * y
    out = A.mia_metrics(scores, y, rng, n_bootstrap=100)
    expected = {"auc", "auc_low", "auc_high", "n_members", "n_nonmembers"}
    for name in ("tpr_at_1pct_fpr", "tpr_at_0.1pct_fpr"):
        expected |= {name, f"{name}_low", f"{name}_high", f"{name}_sufficient"}
    assert set(out) == expected
    assert all(isinstance(v, float) for v in out.values())
    assert out["n_members"] == 400 and out["n_nonmembers"] == 600
    assert out["tpr_at_1pct_fpr_sufficient"] == 1.0 and out["tpr_at_0.1pct_fpr_sufficient"] == 0.0
    assert out["auc"] == pytest.approx(A.auc(scores, y))
    assert out["tpr_at_1pct_fpr"] == A.tpr_at_fpr(scores, y, 0.01)["tpr"]
    assert out["auc_low"] < out["auc"] < out["auc_high"]
    assert A.fpr_key(0.05) == "tpr_at_5pct_fpr" and A.fpr_key(0.0001) == "tpr_at_0.01pct_fpr"


# ---------------------------------------------------------------- LiRA


def _simulate_shadows(seed, shift, n_examples=1000, n_shadows=16):
    rng = _rng(seed)
    difficulty = rng.normal(0.0, 2.0, size=n_examples)  # per-example baseline
    in_mask = rng.random((n_shadows, n_examples)) < 0.5
    shadow = difficulty + shift * in_mask + rng.normal(size=(n_shadows, n_examples))
    member = rng.random(n_examples) < 0.5
    target = difficulty + shift * member + rng.normal(size=n_examples)
    return target, shadow, in_mask, member


def test_lira_detects_shift_online_at_least_as_good_as_offline():
    target, shadow, in_mask, member = _simulate_shadows(21, shift=1.0)
    online = A.lira_scores_online(target, shadow, in_mask)
    offline = A.lira_scores_offline(target, shadow, in_mask)
    auc_on, auc_off, auc_raw = (A.auc(s, member) for s in (online, offline, target))
    # the optimal test with known per-example means has AUC Φ(1/√2) ≈ 0.760
    assert auc_on > 0.7
    assert auc_on >= auc_off - 0.02
    assert auc_off > 0.65
    assert auc_on > auc_raw + 0.05  # calibrating per example beats the raw confidence (≈ 0.62)
    per_example = A.lira_scores_online(target, shadow, in_mask, fix_variance=False)
    assert A.auc(per_example, member) > 0.68


def test_lira_no_shift_is_chance():
    target, shadow, in_mask, member = _simulate_shadows(22, shift=0.0, n_examples=2000)
    for fn in (A.lira_scores_online, A.lira_scores_offline):
        assert abs(A.auc(fn(target, shadow, in_mask), member) - 0.5) < 0.04


def test_lira_formulas_and_fallbacks():
    shadow = np.array([[0.0, 1.0, 5.0], [2.0, 3.0, 7.0], [10.0, 20.0, 9.0], [14.0, 24.0, 9.5]])
    in_mask = np.array([[False, False, True], [False, False, True], [True, True, True],
                        [True, True, True]])
    x = np.array([3.0, 15.0, 8.0])
    # per-example variances (ddof=1), each side has >= 2 shadows for examples 0 and 1
    on = A.lira_scores_online(x, shadow, in_mask, fix_variance=False)
    mu_in = np.array([12.0, 22.0])
    sd_in = np.array([np.std([10, 14], ddof=1), np.std([20, 24], ddof=1)])
    mu_out = np.array([1.0, 2.0])
    sd_out = np.array([np.std([0, 2], ddof=1), np.std([1, 3], ddof=1)])
    want = stats.norm.logpdf(x[:2], mu_in, sd_in) - stats.norm.logpdf(x[:2], mu_out, sd_out)
    np.testing.assert_allclose(on[:2], want, rtol=1e-10)
    # example 2 has no out shadow: global out mean (1.5) and pooled out std are used; finite
    assert np.isfinite(on[2])
    off = A.lira_scores_offline(x, shadow, in_mask, fix_variance=False)
    np.testing.assert_allclose(off[:2], stats.norm.logcdf((x[:2] - mu_out) / sd_out), rtol=1e-10)
    pooled_out = math.sqrt(((0 - 1) ** 2 + (2 - 1) ** 2 + (1 - 2) ** 2 + (3 - 2) ** 2) / 2)
    assert off[2] == pytest.approx(stats.norm.logcdf((8.0 - 1.5) / pooled_out))
    # fixed variance: one pooled std per side
    off_fixed = A.lira_scores_offline(x, shadow, in_mask)
    np.testing.assert_allclose(off_fixed, stats.norm.logcdf((x - [1.0, 2.0, 1.5]) / pooled_out))


def test_logit_confidence_stable():
    np.testing.assert_allclose(
        A.logit_confidence([0.5, 0.9, 0.1]), [0.0, math.log(9), -math.log(9)])
    out = A.logit_confidence(np.array([0.0, 1.0, 1 - 1e-15]))
    assert np.all(np.isfinite(out))
    assert out[0] == pytest.approx(-math.log(1e12 - 1), rel=1e-6)
    assert out[1] == pytest.approx(math.log(1e12 - 1), rel=1e-3)
    assert A.logit_confidence(0.75) == pytest.approx(math.log(3))
    with pytest.raises(ValueError, match="p_true"):
        A.logit_confidence([1.5])


# ---------------------------------------------------------------- one-run audit


def _reference_p_value(m, r, v, eps, delta):
    """The loop of Steinke et al. (2023), Appendix D, written out independently."""
    q = 1.0 / (1.0 + math.exp(-eps))
    beta = stats.binom.sf(v - 1, r, q)
    alpha, total = 0.0, 0.0
    for i in range(1, v + 1):
        total += stats.binom.pmf(v - i, r, q)
        alpha = max(alpha, total / i)
    return min(beta + alpha * delta * 2 * m, 1.0)


@pytest.mark.parametrize("eps", [1.0, 2.0, 4.0])
@pytest.mark.parametrize("m", [100, 1000, 10000])
def test_one_run_bound_exceeds_true_epsilon_with_probability_at_most_beta(eps, m):
    # ε-DP randomized response on each of m canaries: the guess is right w.p. e^ε/(1+e^ε),
    # so the number correct is exactly Bin(m, q) — the worst case of the theorem.
    q = special.expit(eps)
    # exact: the smallest v whose bound exceeds ε has P[Bin(m, q) >= v] <= 0.05
    grid = np.arange(int(m * q), m + 1)
    bounds = np.array([A.one_run_epsilon_lower_bound(m, int(v)) for v in grid[: 200]])
    if np.any(bounds > eps):
        crit = grid[np.argmax(bounds > eps)]
        assert stats.binom.sf(crit - 1, m, q) <= 0.05 + 1e-9
        assert stats.binom.sf(crit - 2, m, q) > 0.05  # and it is tight (one fewer would fail)
    else:
        # m = 100, ε = 4: even 100/100 correct only certifies logit(0.05^(1/100)) ≈ 3.49
        assert grid[-1] == m and A.one_run_epsilon_lower_bound(m, m) < eps
    # simulated seeds
    rng = _rng(int(eps * 100 + m))
    vs = rng.binomial(m, q, size=400)
    sims = np.array([A.one_run_epsilon_lower_bound(m, int(v)) for v in vs])
    assert np.mean(sims > eps) <= 0.08
    assert np.all(sims >= 0)


def test_one_run_bound_grows_with_m_and_is_near_eps_for_large_m():
    for eps in (1.0, 2.0, 4.0):
        q = special.expit(eps)
        means = []
        for m in (100, 1000, 10000):
            vs = _rng(m).binomial(m, q, size=100)
            means.append(np.mean([A.one_run_epsilon_lower_bound(m, int(v)) for v in vs]))
        assert means[0] < means[1] < means[2] < eps
        assert means[2] >= 0.9 * eps  # measured ≈ 0.96ε
        assert means[0] <= 0.75 * eps  # few canaries give a loose bound (≈ 0.6–0.7ε)


def test_one_run_bound_chance_and_edge_cases():
    assert A.one_run_epsilon_lower_bound(1000, 500) == 0.0
    assert A.one_run_epsilon_lower_bound(1000, 520) == 0.0  # within noise of chance
    assert A.one_run_epsilon_lower_bound(0, 0) == 0.0
    assert A.one_run_epsilon_lower_bound(100, 0) == 0.0
    # all r correct: P[Bin(r, q) >= r] = q^r = β  ->  q = β^(1/r)
    assert A.one_run_epsilon_lower_bound(10, 10) == pytest.approx(special.logit(0.05 ** 0.1))
    # p-value at the bound equals β (δ = 0, closed form)
    lb = A.one_run_epsilon_lower_bound(1000, 731)
    assert A.one_run_p_value(1000, 731, lb) == pytest.approx(0.05, rel=1e-6)
    # higher confidence -> smaller bound
    assert A.one_run_epsilon_lower_bound(1000, 731, confidence=0.99) < lb


def test_one_run_delta_term_matches_reference_and_only_lowers_the_bound():
    for m, r, v, eps, delta in [(1000, 1000, 731, 0.8, 1e-5), (2000, 200, 150, 1.0, 1e-4),
                                (100, 50, 40, 0.5, 1e-3)]:
        assert A.one_run_p_value(r, v, eps, delta, num_canaries=m) == pytest.approx(
            _reference_p_value(m, r, v, eps, delta), rel=1e-9)
    lb0 = A.one_run_epsilon_lower_bound(1000, 731)
    lb_d = A.one_run_epsilon_lower_bound(1000, 731, delta=1e-5, num_canaries=1000)
    lb_big = A.one_run_epsilon_lower_bound(1000, 731, delta=1e-4, num_canaries=1000)
    assert lb_big < lb_d <= lb0
    # bisection: p(lb) < β <= p(lb + 1e-6)
    p = lambda e: A.one_run_p_value(1000, 731, e, 1e-5, num_canaries=1000)  # noqa: E731
    assert p(lb_d) < 0.05 <= p(lb_d + 1e-6)
    # δ so large that 2mδ·α alone exceeds β: nothing can be concluded
    assert A.one_run_epsilon_lower_bound(1000, 731, delta=0.01, num_canaries=1000) == 0.0


def test_one_run_audit_on_randomized_response_scores():
    eps, m = 2.0, 4000
    rng = _rng(31)
    included = rng.random(m) < 0.5
    keep = rng.random(m) < special.expit(eps)
    observed = np.where(keep, included, ~included)  # ε-DP randomized response per canary
    scores = observed + 0.01 * rng.random(m)  # any post-processing is allowed
    res = A.one_run_audit(scores, included, k_positive=m // 2, k_negative=m // 2)
    assert set(res) == {"epsilon_lower_bound", "num_guesses", "num_correct", "k_positive",
                        "k_negative"}
    assert res["num_guesses"] == m
    top = np.argsort(-scores, kind="mergesort")
    want = included[top[: m // 2]].sum() + (~included[top[m // 2:]]).sum()
    assert res["num_correct"] == want
    assert 1.5 < res["epsilon_lower_bound"] <= eps
    # fewer, more confident guesses (only the positive side)
    res_pos = A.one_run_audit(scores, included, k_positive=500, k_negative=0)
    assert res_pos["num_guesses"] == 500 and 0 < res_pos["epsilon_lower_bound"] <= eps
    # no signal -> no bound
    noise = rng.normal(size=m)
    assert A.one_run_audit(noise, included, 200, 200)["epsilon_lower_bound"] < 0.5
    # δ uses m = number of canaries
    res_d = A.one_run_audit(scores, included, m // 2, m // 2, delta=1e-6)
    assert res_d["epsilon_lower_bound"] == pytest.approx(A.one_run_epsilon_lower_bound(
        m, res["num_correct"], delta=1e-6, num_canaries=m))


def test_best_one_run_audit_bonferroni():
    eps, m = 4.0, 2000
    rng = _rng(32)
    included = rng.random(m) < 0.5
    scores = rng.normal(size=m) + 3.0 * included
    ks = [(50, 50), (200, 200), (500, 500)]
    best = A.best_one_run_audit(scores, included, ks=ks)
    assert best["num_tried"] == 3 and best["confidence_per_try"] == pytest.approx(1 - 0.05 / 3)
    singles = [A.one_run_audit(scores, included, kp, kn, confidence=1 - 0.05 / 3) for kp, kn in ks]
    best_single = max(s["epsilon_lower_bound"] for s in singles)
    assert best["epsilon_lower_bound"] == pytest.approx(best_single)
    naive = A.best_one_run_audit(scores, included, ks=ks, correct_for_multiple=False)
    assert naive["epsilon_lower_bound"] >= best["epsilon_lower_bound"]
    default = A.best_one_run_audit(scores, included)
    assert default["num_tried"] == 4 and default["epsilon_lower_bound"] > 0


# ---------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    "scores, y, match",
    [
        ([0.1, 0.2, 0.3], [1, 0], "length"),
        ([], [], "empty"),
        ([0.1, 0.2], [1, 2], "0/1"),
        ([0.1, 0.2], ["a", "b"], "is_member"),
        ([0.1, 0.2], [1, 1], "no non-members"),
        ([0.1, 0.2], [0, 0], "no members"),
        ([0.1, np.nan], [1, 0], "finite"),
        ([[0.1, 0.2]], [1, 0], "1-D"),
    ],
)
def test_bad_inputs_raise(scores, y, match):
    for fn in (A.auc, A.roc_curve, lambda s, m: A.tpr_at_fpr(s, m, 0.01),
               lambda s, m: A.auc_with_ci(s, m, n_bootstrap=10, rng=_rng())):
        with pytest.raises(ValueError, match=match):
            fn(scores, y)


def test_bad_parameters_raise():
    s, y = [0.1, 0.5, 0.3], [1, 0, 1]
    with pytest.raises(ValueError, match="max_fpr"):
        A.tpr_at_fpr(s, y, 0.0)
    with pytest.raises(ValueError, match="max_fpr"):
        A.tpr_at_fpr(s, y, 1.5)
    with pytest.raises(ValueError, match="confidence"):
        A.tpr_at_fpr(s, y, 0.1, confidence=1.0)
    with pytest.raises(ValueError, match="rng"):
        A.auc_with_ci(s, y, rng=np.random.RandomState(0))
    with pytest.raises(ValueError, match="n_bootstrap"):
        A.auc_with_ci(s, y, n_bootstrap=0, rng=_rng())
    with pytest.raises(ValueError, match="num_correct"):
        A.one_run_epsilon_lower_bound(10, 11)
    with pytest.raises(ValueError, match="num_guesses"):
        A.one_run_epsilon_lower_bound(-1, 0)
    with pytest.raises(ValueError, match="num_canaries"):
        A.one_run_epsilon_lower_bound(10, 8, delta=1e-5)
    with pytest.raises(ValueError, match="delta"):
        A.one_run_epsilon_lower_bound(10, 8, delta=1.0, num_canaries=10)
    with pytest.raises(ValueError, match="k_positive"):
        A.one_run_audit(s, y, 2, 2)
    with pytest.raises(ValueError, match="is_included"):
        A.one_run_audit(s, [1, 0], 1, 1)
    with pytest.raises(ValueError, match="shadow_in_mask"):
        A.lira_scores_online([0.0, 1.0], np.zeros((3, 2)), np.zeros((3, 3), bool))
    with pytest.raises(ValueError, match="examples"):
        A.lira_scores_online([0.0, 1.0], np.zeros((3, 3)), np.zeros((3, 3), bool))
    with pytest.raises(ValueError, match="in shadow"):
        A.lira_scores_online([0.0, 1.0], np.zeros((3, 2)), np.zeros((3, 2), bool))
    with pytest.raises(ValueError, match="ks"):
        A.best_one_run_audit(s, y, ks=[])
