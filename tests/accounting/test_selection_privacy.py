"""Private selection (best of K trials, Papernot & Steinke 2022): distributions, the RDP bound
against dp-accounting's independent implementation and against exact Rényi divergences of an
enumerated best-of-K mechanism, the accountant path, calibration, and argument checks."""

import math

import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant as dpa_rdp
from scipy import special, stats

from privacy import accountant as acct
from privacy import events as ev
from privacy import pld as pld_lib
from privacy import rdp as rdp_lib
from privacy import selection as sel
from privacy.rng import seeded_rng

DELTA = 1e-5
ORDERS = np.array(rdp_lib.DEFAULT_ORDERS)
TNB_PARAMS = [(-0.5, 0.05), (-0.5, 0.4), (0.0, 0.05), (0.0, 0.4), (0.5, 0.1), (1.0, 0.1), (3.0, 0.2)]


def _tail_ks(dist, n=200_000):
    return np.arange(0 if isinstance(dist, sel.PoissonTrials) else 1, n)


# ---- distributions --------------------------------------------------------------------------

@pytest.mark.parametrize("eta,gamma", TNB_PARAMS)
def test_truncated_negative_binomial_pmf_sums_to_one_and_has_its_mean(eta, gamma):
    d = sel.TruncatedNegativeBinomial(eta, gamma)
    ks = _tail_ks(d)
    p = d.pmf(ks)
    assert p.sum() == pytest.approx(1.0, abs=1e-9)
    assert float(np.sum(ks * p)) == pytest.approx(d.mean, rel=1e-8)
    assert d.pmf(0) == 0.0 and d.pmf(2.5) == 0.0


@pytest.mark.parametrize("eta,gamma", TNB_PARAMS)
def test_truncated_negative_binomial_pmf_matches_definition_and_scipy(eta, gamma):
    d = sel.TruncatedNegativeBinomial(eta, gamma)
    ks = np.arange(1, 60)
    # the definition, term by term: (1−γ)^k/(γ^{−η}−1) Π_{ℓ<k}(ℓ+η)/(ℓ+1)  (η≠0)
    if eta != 0.0:
        direct = np.array([(1 - gamma) ** k / (gamma ** (-eta) - 1) * np.prod([(l + eta) / (l + 1) for l in range(k)])
                           for k in ks])
    else:
        direct = (1 - gamma) ** ks / (ks * math.log(1 / gamma))
    np.testing.assert_allclose(d.pmf(ks), direct, rtol=1e-10)
    if eta > 0:
        nb = stats.nbinom(eta, gamma)
        np.testing.assert_allclose(d.pmf(ks), nb.pmf(ks) / nb.sf(0), rtol=1e-9)
    if eta == 0.0:
        np.testing.assert_allclose(d.pmf(ks), stats.logser(1 - gamma).pmf(ks), rtol=1e-9)
    if eta == 1.0:
        np.testing.assert_allclose(d.pmf(ks), stats.geom(gamma).pmf(ks), rtol=1e-9)
        assert d.mean == pytest.approx(1 / gamma)


@pytest.mark.parametrize("mu", [1.0, 4.5, 30.0])
def test_poisson_pmf_matches_scipy(mu):
    d = sel.PoissonTrials(mu)
    ks = _tail_ks(d, 400)
    np.testing.assert_allclose(d.pmf(ks), stats.poisson(mu).pmf(ks), rtol=1e-9, atol=1e-300)
    assert d.pmf(ks).sum() == pytest.approx(1.0, abs=1e-12)
    assert d.mean == mu


@pytest.mark.parametrize("dist", [sel.TruncatedNegativeBinomial(-0.5, 0.2), sel.TruncatedNegativeBinomial(0.0, 0.1),
                                  sel.TruncatedNegativeBinomial(1.0, 0.25), sel.TruncatedNegativeBinomial(2.5, 0.3),
                                  sel.PoissonTrials(6.0)])
def test_sampling_matches_pmf_chi_square(dist):
    draws = dist.sample(seeded_rng(20261125), size=40_000)
    assert draws.dtype.kind == "i"
    # bins: each support point with expected count >= 20, the rest pooled into one tail bin
    lo = 0 if isinstance(dist, sel.PoissonTrials) else 1
    ks = np.arange(lo, 2000)
    expected = 40_000 * dist.pmf(ks)
    keep = expected >= 20
    cut = ks[keep].max()
    observed = np.array([np.sum(draws == k) for k in ks[keep]] + [np.sum(draws > cut)])
    exp_bins = np.append(expected[keep], 40_000 - expected[keep].sum())
    assert draws.min() >= lo
    assert stats.chisquare(observed, exp_bins).pvalue > 1e-3
    assert draws.mean() == pytest.approx(dist.mean, rel=0.05)


def test_sampling_draws_from_the_callers_generator():
    d = sel.TruncatedNegativeBinomial(0.0, 0.05)
    a = d.sample(seeded_rng(7), size=50)
    b = d.sample(seeded_rng(7), size=50)
    c = d.sample(seeded_rng(8), size=50)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert isinstance(d.sample(seeded_rng(1)), int)
    with pytest.raises(TypeError, match="rng"):
        d.sample(7)
    with pytest.raises(TypeError, match="rng"):
        sel.PoissonTrials(3.0).sample(None)


def test_gamma_for_mean_inverts_the_mean():
    for eta in (-0.5, 0.0, 0.5, 2.0):
        for mean in (1.5, 10.0, 100.0):
            g = sel.gamma_for_mean(eta, mean)
            assert sel.TruncatedNegativeBinomial(eta, g).mean == pytest.approx(mean, rel=1e-8)
            assert sel.TruncatedNegativeBinomial(eta, g).mean <= mean


# ---- the bound against dp-accounting's RepeatAndSelect (same theorems, separate code) --------

def _curves():
    yield rdp_lib.rdp_of_event(ev.dpsgd_event(0.01, 1.0, 1000))[0]
    yield rdp_lib.rdp_of_event(ev.dpsgd_event(0.05, 1.5, 300))[0]
    yield rdp_lib.gaussian_rdp(3.0, ORDERS)


@pytest.mark.parametrize("eta,gamma", [(0.0, 0.05), (0.5, 0.1), (1.0, 0.1), (3.0, 0.2), (1.0, 0.5)])
def test_truncated_negative_binomial_bound_matches_dp_accounting(eta, gamma):
    d = sel.TruncatedNegativeBinomial(eta, gamma)
    for curve in _curves():
        ours = sel.repeat_and_select_rdp(curve, d, trial_orders=ORDERS)
        # dp-accounting takes the mean and re-derives γ conservatively (to 1e-9 relative)
        ref = dpa_rdp._compute_rdp_repeat_and_select(ORDERS, curve, d.mean, eta)
        np.testing.assert_allclose(ours, ref, rtol=1e-7)
        assert np.all(ours >= curve * (1 - 1e-12))  # a selection never costs less than one trial here


@pytest.mark.parametrize("mu", [1.0, 3.0, 10.0, 50.0])
def test_poisson_bound_matches_dp_accounting(mu):
    d = sel.PoissonTrials(mu)
    for curve in _curves():
        ours = sel.repeat_and_select_rdp(curve, d, trial_orders=ORDERS)
        ref = dpa_rdp._compute_rdp_repeat_and_select(ORDERS, curve, mu, np.inf)
        # dp-accounting's Poisson branch skips the monotonicity-in-order step that we apply
        ref_monotone = np.minimum.accumulate(ref[::-1])[::-1]
        np.testing.assert_allclose(ours, ref_monotone, rtol=1e-7)
        assert np.all(ours <= ref * (1 + 1e-12))
        assert rdp_lib.rdp_to_epsilon(ORDERS, ours, DELTA)[0] == pytest.approx(
            rdp_lib.rdp_to_epsilon(ORDERS, ref, DELTA)[0], rel=1e-9)


def test_callable_and_array_trial_curves_agree():
    d = sel.TruncatedNegativeBinomial(0.5, 0.1)
    fn = lambda o: rdp_lib.sampled_gaussian_rdp(0.02, 1.2, o) * 200  # noqa: E731
    from_array = sel.repeat_and_select_rdp(fn(ORDERS), d, trial_orders=ORDERS)
    from_callable = sel.repeat_and_select_rdp(fn, d)
    np.testing.assert_allclose(from_callable, from_array, rtol=1e-12)
    some = np.array([2.0, 8.0, 32.0])
    np.testing.assert_allclose(sel.repeat_and_select_rdp(fn, d, orders=some),
                               from_array[np.searchsorted(ORDERS, some)], rtol=1e-12)


# ---- the bound against exact divergences of an enumerated best-of-K mechanism --------------

M, SIGMA_T = 12, 1.5
YS = np.arange(M + 1)


def _trial_pmf(center):
    """One trial: a score on {0..12}, a discretised Gaussian around the candidate's holdout count;
    a neighbouring dataset moves the count by one."""
    w = np.exp(-(YS - center) ** 2 / (2 * SIGMA_T**2))
    return w / w.sum()


P_D, P_D2 = _trial_pmf(5.0), _trial_pmf(6.0)


def _renyi(p, q, lam):
    m = p > 0
    return float(special.logsumexp(lam * np.log(p[m]) + (1 - lam) * np.log(q[m]))) / (lam - 1)


def _sym_renyi(p, q, lam):
    return max(_renyi(p, q, lam), _renyi(q, p, lam))


def _pair_rdp(orders):
    """Exact RDP of the trial on the neighbouring pair {D, D'} (both directions)."""
    return np.array([_sym_renyi(P_D, P_D2, lam) for lam in np.atleast_1d(orders)])


def _k_weights(dist):
    """P[K = k] from scipy (independent of selection.py's pmf), or the defining recursion for η < 0."""
    if isinstance(dist, sel.PoissonTrials):
        ks = np.arange(0, 3000)
        return ks, stats.poisson(dist.mu).pmf(ks)
    ks = np.arange(1, 20_000)
    if dist.eta > 0:
        nb = stats.nbinom(dist.eta, dist.gamma)
        return ks, nb.pmf(ks) / nb.sf(0)
    if dist.eta == 0:
        return ks, stats.logser(1 - dist.gamma).pmf(ks)
    w = np.empty(len(ks))
    w[0] = (1 - dist.gamma) * dist.eta / (dist.gamma ** (-dist.eta) - 1)
    for i in range(1, len(ks)):
        w[i] = w[i - 1] * (1 - dist.gamma) * (i + dist.eta) / (i + 1)
    return ks, w


def _best_of_k(p, dist):
    """Exact output law of "run the trial K times, output the highest score" (⊥ first if K = 0):
    P[max ≤ y] = Σ_k P[K=k]·F(y)^k."""
    ks, w = _k_weights(dist)
    assert w.sum() == pytest.approx(1.0, abs=1e-12)
    cdf_trial = np.cumsum(p)
    bottom = float(w[ks == 0].sum())
    cdf = np.array([np.sum(w * cdf_trial[y] ** ks) for y in range(len(p))])
    law = np.diff(np.concatenate([[bottom], cdf]))
    return np.concatenate([[bottom], law]) if bottom > 0 else law


CHECK_ORDERS = np.array([1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 64.0])


@pytest.mark.parametrize("dist", [sel.TruncatedNegativeBinomial(1.0, 0.1), sel.TruncatedNegativeBinomial(0.0, 0.05),
                                  sel.TruncatedNegativeBinomial(-0.5, 0.05), sel.TruncatedNegativeBinomial(3.0, 0.2),
                                  sel.TruncatedNegativeBinomial(1.0, 0.6), sel.PoissonTrials(1.0),
                                  sel.PoissonTrials(10.0)])
def test_bound_is_above_exact_divergence_of_best_of_k(dist):
    a, a2 = _best_of_k(P_D, dist), _best_of_k(P_D2, dist)
    exact = np.array([_sym_renyi(a, a2, lam) for lam in CHECK_ORDERS])
    bound = sel.repeat_and_select_rdp(_pair_rdp, dist, orders=CHECK_ORDERS)
    assert np.all(exact <= bound + 1e-9), (exact, bound)
    # the check is not vacuous: at low orders the selection leaks more than one trial
    if dist.mean >= 5:
        assert exact[0] > _pair_rdp(CHECK_ORDERS[:1])[0] * 1.1


def test_poisson_formula_fails_below_mean_one_so_it_is_refused():
    """At μ = 0.5 the formula ε + μδ̂ + log(μ)/(λ−1) goes below the exact divergence at λ = 1.5."""
    mu, lam = 0.5, 1.5
    a, a2 = _best_of_k(P_D, sel.PoissonTrials(mu)), _best_of_k(P_D2, sel.PoissonTrials(mu))
    exact = _sym_renyi(a, a2, lam)
    grid = ORDERS
    delta_hat, _ = rdp_lib.rdp_to_delta(grid, _pair_rdp(grid), math.log1p(1 / (lam - 1)))
    formula = _pair_rdp([lam])[0] + mu * delta_hat + math.log(mu) / (lam - 1)
    assert exact > formula
    with pytest.raises(ValueError, match="mu"):
        sel.repeat_and_select_rdp(_pair_rdp, sel.PoissonTrials(mu))
    with pytest.raises(ValueError, match="mu"):
        ev.RepeatAndSelectEvent((ev.GaussianEvent(1.0),), "poisson", mu=mu)


def test_bound_tends_to_one_trial_when_k_is_one():
    """K ≡ 1 in the limits γ → 1 (any η) and η → −1 (any γ): the bound tends to the trial's RDP."""
    curve = rdp_lib.rdp_of_event(ev.dpsgd_event(0.01, 1.0, 1000))[0]
    for d in (sel.TruncatedNegativeBinomial(1.0, 1 - 1e-9), sel.TruncatedNegativeBinomial(0.0, 1 - 1e-9),
              sel.TruncatedNegativeBinomial(-1 + 1e-9, 0.1), sel.TruncatedNegativeBinomial(-1 + 1e-9, 0.5)):
        assert d.pmf(1) == pytest.approx(1.0, abs=1e-7)
        bound = sel.repeat_and_select_rdp(curve, d, trial_orders=ORDERS)
        np.testing.assert_allclose(bound, curve, rtol=0, atol=1e-6)
        # and exactly: the enumerated best-of-K is the trial itself
        a, a2 = _best_of_k(P_D, d), _best_of_k(P_D2, d)
        assert _sym_renyi(a, a2, 2.0) == pytest.approx(_pair_rdp([2.0])[0], abs=1e-6)
    # γ away from 1 (E[K] = 10): a constant overhead over one trial at every order, far below 10×
    d = sel.TruncatedNegativeBinomial(1.0, 0.1)
    bound = sel.repeat_and_select_rdp(curve, d, trial_orders=ORDERS)
    assert np.all(bound - curve > 0.5)
    i = int(np.searchsorted(ORDERS, 8.0))
    assert bound[i] < 10 * curve[i]  # 10 trials composed: RDP 10·ε(λ)


# ---- DP-SGD-like trials: selection vs naive composition --------------------------------------

@pytest.mark.parametrize("q,sigma,steps", [(0.01, 1.0, 1000), (0.02, 0.8, 500), (0.004, 1.2, 3000)])
def test_selection_is_cheaper_than_naive_composition_of_expected_trials(q, sigma, steps):
    trial = ev.dpsgd_event(q, sigma, steps)
    for eta in (0.0, 1.0):
        for mean in (10, 20):
            d = sel.TruncatedNegativeBinomial(eta, sel.gamma_for_mean(eta, float(mean)))
            selected = acct.spend(sel.selection_event([trial], d), DELTA).epsilon
            naive = acct.spend(ev.SelfComposedEvent(trial, mean), DELTA).epsilon  # PLD: the tight one
            single = acct.spend(trial, DELTA).epsilon
            assert single < selected < naive
    # the constant overhead: with E[K] = 2 geometric trials naive composition is cheaper
    d = sel.TruncatedNegativeBinomial(1.0, 0.5)
    assert acct.spend(sel.selection_event([trial], d), DELTA).epsilon > \
        acct.spend(ev.SelfComposedEvent(trial, 2), DELTA).epsilon


# ---- events and the accountant --------------------------------------------------------------

def test_selection_event_is_rdp_only_and_round_trips():
    train = ev.dpsgd_event(0.01, 1.0, 1000)
    d = sel.TruncatedNegativeBinomial(1.0, 0.1)
    event = sel.selection_event([sel.trial_event(train, 20.0), sel.trial_event(None, 20.0)], d)
    assert ev.event_from_json(ev.event_to_json(event)) == event
    poisson = sel.selection_event([sel.trial_event(None, 5.0)], sel.PoissonTrials(4.0))
    assert ev.event_from_dict(ev.event_to_dict(poisson)) == poisson
    assert sel.trial_count_distribution(event) == d and sel.trial_count_distribution(poisson) == sel.PoissonTrials(4.0)

    with pytest.raises(NotImplementedError, match="RDP"):
        pld_lib.pld_of_event(event)
    assert pld_lib.pld_for(event) is None
    spent = acct.spend(event, DELTA)
    assert spent.epsilon_pld is None and spent.accountant.startswith("rdp")
    trial_curve = np.maximum(rdp_lib.rdp_of_event(train)[0], rdp_lib.gaussian_rdp(20.0, ORDERS))
    expected, _ = sel.selection_epsilon(trial_curve, d, DELTA)
    assert spent.epsilon == pytest.approx(expected, rel=1e-12)
    assert spent.epsilon == spent.epsilon_rdp

    # composed with other spending (a ledger entry): RDP adds, PLD still refuses
    other = ev.dpsgd_event(0.02, 1.1, 200)
    both = acct.spend(ev.ComposedEvent((event, other)), DELTA)
    assert both.epsilon_pld is None
    curve = sel.repeat_and_select_rdp(trial_curve, d, trial_orders=ORDERS) + rdp_lib.rdp_of_event(other)[0]
    assert both.epsilon == pytest.approx(rdp_lib.rdp_to_epsilon(ORDERS, curve, DELTA)[0], rel=1e-12)
    # ordinary events keep their two accountants and their label
    assert acct.spend(other, DELTA).accountant == "min(pld, rdp)"


def test_trial_rdp_is_max_over_splits_and_candidates():
    train_a = ev.dpsgd_event(0.01, 1.0, 1000)
    train_b = ev.dpsgd_event(0.05, 2.0, 100)
    trials = [sel.trial_event(train_a, 8.0), sel.trial_event(train_b, 8.0), sel.trial_event(None, 8.0)]
    d = sel.TruncatedNegativeBinomial(0.0, 0.05)
    curve = rdp_lib.rdp_of_event(sel.selection_event(trials, d))[0]
    trial_curve = np.max([rdp_lib.rdp_of_event(train_a)[0], rdp_lib.rdp_of_event(train_b)[0],
                          rdp_lib.gaussian_rdp(8.0, ORDERS)], axis=0)
    np.testing.assert_allclose(curve, sel.repeat_and_select_rdp(trial_curve, d, trial_orders=ORDERS), rtol=1e-12)
    # the zero-shot candidate alone costs its score release only
    zero_shot = rdp_lib.rdp_of_event(sel.selection_event([sel.trial_event(None, 8.0)], d))[0]
    np.testing.assert_allclose(zero_shot, sel.repeat_and_select_rdp(rdp_lib.gaussian_rdp(8.0, ORDERS), d,
                                                                     trial_orders=ORDERS), rtol=1e-12)
    assert np.all(zero_shot <= curve + 1e-12)


def test_trials_with_a_delta_part_are_refused():
    event = sel.selection_event([ev.LimitedDomainEvent(1.0, 1e-6)], sel.TruncatedNegativeBinomial(1.0, 0.1))
    with pytest.raises(ValueError, match="δ-part"):
        rdp_lib.rdp_of_event(event)


def test_release_holdout_score_adds_gaussian_noise_of_sigma():
    rng = seeded_rng(11)
    draws = np.array([sel.release_holdout_score(40, 3.0, rng) for _ in range(20_000)])
    assert draws.mean() == pytest.approx(40.0, abs=0.1)
    assert draws.std() == pytest.approx(3.0, rel=0.03)
    assert stats.kstest((draws - 40.0) / 3.0, "norm").pvalue > 1e-3
    assert sel.holdout_score_event(3.0) == ev.GaussianEvent(3.0)
    assert sel.release_holdout_score(np.int64(5), 1.0, seeded_rng(1)) != 5.0
    with pytest.raises(ValueError, match="correct_count"):
        sel.release_holdout_score(-1, 1.0, rng)
    with pytest.raises(ValueError, match="noise_multiplier"):
        sel.release_holdout_score(3, 0.0, rng)
    with pytest.raises(TypeError, match="rng"):
        sel.release_holdout_score(3, 1.0, 42)


# ---- calibration -----------------------------------------------------------------------------

def test_plan_dpsgd_selection_hits_target_and_reports_naive_composition():
    d = sel.TruncatedNegativeBinomial(1.0, 0.1)
    plan = sel.plan_dpsgd_selection(2.0, DELTA, d, 0.01, 1000, score_noise_multiplier=30.0, n_candidates=12)
    assert plan.selection_epsilon <= 2.0
    assert plan.expected_trials == pytest.approx(10.0)
    # σ is the smallest that fits (to the tolerance): 0.3 % less noise exceeds the target
    train = ev.dpsgd_event(0.01, plan.noise_multiplier / 1.003, 1000)
    less_noise = sel.selection_event([sel.trial_event(train, 30.0), sel.trial_event(None, 30.0)], d)
    assert acct.spend(less_noise, DELTA).epsilon > 2.0
    trial = sel.trial_event(ev.dpsgd_event(0.01, plan.noise_multiplier, 1000), 30.0)
    assert plan.trial_epsilon == pytest.approx(acct.spend(trial, DELTA).epsilon)
    assert plan.trial_epsilon < plan.selection_epsilon < plan.naive_epsilon_expected_trials < plan.naive_epsilon_candidates
    assert plan.to_dict()["distribution"] == "truncated_negative_binomial"
    with pytest.raises(ValueError, match="score_noise_multiplier"):
        sel.plan_dpsgd_selection(0.5, DELTA, d, 0.01, 1000, score_noise_multiplier=1.0, n_candidates=3)


# ---- argument checks -------------------------------------------------------------------------

@pytest.mark.parametrize("call,name", [
    (lambda: sel.TruncatedNegativeBinomial(-1.0, 0.5), "eta"),
    (lambda: sel.TruncatedNegativeBinomial(-3.0, 0.5), "eta"),
    (lambda: sel.TruncatedNegativeBinomial(float("nan"), 0.5), "eta"),
    (lambda: sel.TruncatedNegativeBinomial(1.0, 0.0), "gamma"),
    (lambda: sel.TruncatedNegativeBinomial(1.0, 1.0), "gamma"),
    (lambda: sel.TruncatedNegativeBinomial(1.0, 1.5), "gamma"),
    (lambda: sel.PoissonTrials(0.0), "mu"),
    (lambda: sel.PoissonTrials(-2.0), "mu"),
    (lambda: ev.RepeatAndSelectEvent((ev.GaussianEvent(1.0),), "truncated_negative_binomial", eta=-1.0, gamma=0.5), "eta"),
    (lambda: ev.RepeatAndSelectEvent((ev.GaussianEvent(1.0),), "truncated_negative_binomial", eta=1.0, gamma=1.0), "gamma"),
    (lambda: ev.RepeatAndSelectEvent((ev.GaussianEvent(1.0),), "poisson", mu=0.0), "mu"),
    (lambda: ev.RepeatAndSelectEvent((ev.GaussianEvent(1.0),), "geometric", eta=1.0, gamma=0.5), "distribution"),
    (lambda: ev.RepeatAndSelectEvent((), "poisson", mu=2.0), "trial"),
    (lambda: sel.selection_epsilon(ORDERS * 0.1, sel.PoissonTrials(2.0), 0.0), "delta"),
    (lambda: sel.selection_epsilon(ORDERS * 0.1, sel.PoissonTrials(2.0), 1.0), "delta"),
    (lambda: sel.repeat_and_select_rdp(ORDERS * 0.1, sel.PoissonTrials(2.0), trial_orders=ORDERS - 1.0), "orders"),
    (lambda: sel.repeat_and_select_rdp(ORDERS * 0.1, sel.PoissonTrials(2.0)), "trial_orders"),
    (lambda: sel.plan_dpsgd_selection(0.0, DELTA, sel.PoissonTrials(2.0), 0.01, 10, 5.0, 3), "target_epsilon"),
    (lambda: sel.plan_dpsgd_selection(-1.0, DELTA, sel.PoissonTrials(2.0), 0.01, 10, 5.0, 3), "target_epsilon"),
    (lambda: sel.plan_dpsgd_selection(1.0, 1.5, sel.PoissonTrials(2.0), 0.01, 10, 5.0, 3), "delta"),
    (lambda: sel.gamma_for_mean(0.0, 1.0), "mean"),
])
def test_bad_arguments_name_the_parameter(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_selection_is_one_ledger_entry_with_its_rdp_epsilon(tmp_path):
    from privacy.ledger import Ledger

    ledger = Ledger(tmp_path / "ledger.db")
    ledger.register_dataset("fp-select", "toy", epsilon_cap=8.0, delta=DELTA)
    d = sel.TruncatedNegativeBinomial(1.0, 0.1)
    event = sel.selection_event([sel.trial_event(ev.dpsgd_event(0.01, 1.0, 1000), 20.0),
                                 sel.trial_event(None, 20.0)], d)
    reserved = ledger.reserve("fp-select", "run-select", event)
    # the ledger composes its entries (ComposedEvent of one), through the RDP path for a selection
    assert reserved.epsilon == pytest.approx(acct.spend(ev.ComposedEvent((event,)), DELTA).epsilon, rel=1e-9)
    assert reserved.epsilon == pytest.approx(acct.spend(event, DELTA).epsilon, rel=1e-9)
    row = ledger.commit("run-select", event)
    assert ev.event_from_dict(row["event"]) == event
    assert ledger.spent("fp-select").epsilon_pld is None
    other = ev.dpsgd_event(0.02, 1.1, 200)
    ledger.reserve("fp-select", "run-other", other)
    curve = rdp_lib.rdp_of_event(event)[0] + rdp_lib.rdp_of_event(other)[0]
    assert ledger.spent("fp-select").epsilon == pytest.approx(rdp_lib.rdp_to_epsilon(ORDERS, curve, DELTA)[0], rel=1e-9)


def test_count_k_equals_k_separate_compositions_for_a_selection():
    event = sel.selection_event([sel.trial_event(ev.dpsgd_event(0.01, 1.0, 300), 20.0)],
                                sel.TruncatedNegativeBinomial(0.0, 0.05))
    once = acct.spend(ev.SelfComposedEvent(event, 3), DELTA)
    separate = acct.spend(ev.ComposedEvent((event, event, event)), DELTA)
    assert once.epsilon == pytest.approx(separate.epsilon, rel=1e-12)
    assert once.epsilon_pld is None and separate.epsilon_pld is None
    assert once.epsilon > acct.spend(event, DELTA).epsilon
