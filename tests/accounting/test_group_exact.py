"""Exact group accounting (issue 37): a record-level Poisson-subsampled Gaussian (DP-SGD, DPZero)
charged per person of ≤ k records is the mixture of Gaussians c = 0..k with Binomial(k, q)
probabilities (privacy/group.py), accounted by the PLD accountant. Checked against independent
computations: a brute-force privacy-loss convolution of the person's true pair in each direction
(removal and addition), dp-accounting's own PLDAccountant on its MixtureOfGaussiansDpEvent, and
the issue's two reference numbers."""

import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy import signal, stats

from privacy import events as ev
from privacy.accountant import spend, spend_by
from privacy.group import CONSERVATIVE_MAP, EXACT_MIXTURE, group_accounting, group_event, grouped_rate
from privacy.pld import mixture_gaussian_pld, pld_for


def _person_pair(q, sigma, k, n=120_001, width=10.0):
    """Densities on a grid of one step with the person (Σ_j Binom(j; k, q)·N(j, σ²)) and without (N(0, σ²))."""
    x = np.linspace(-width * sigma, k + width * sigma, n)
    w = stats.binom.pmf(np.arange(k + 1), k, q)
    return sum(w[j] * stats.norm.pdf(x, loc=j, scale=sigma) for j in range(k + 1)), stats.norm.pdf(x, scale=sigma)


def _loss_pmf(p, q, h):
    """log(p/q) under p, rounded up to multiples of h: (offset index, pmf)."""
    mass = p / p.sum()
    keep = mass > 1e-300
    idx = np.ceil((np.log(p[keep]) - np.log(q[keep])) / h).astype(np.int64)
    return int(idx.min()), np.bincount(idx - idx.min(), weights=mass[keep])


def _brute_epsilon(lo, pmf, steps, h, delta):
    """ε at δ of ``steps`` compositions of one direction's privacy-loss pmf (FFT convolution)."""
    total = np.array([1.0])
    for _ in range(steps):
        total = np.maximum(signal.fftconvolve(total, pmf), 0.0)
    losses = (np.arange(len(total)) + lo * steps) * h

    def delta_at(eps):
        above = losses > eps
        return float(np.sum(total[above] * -np.expm1(eps - losses[above])))

    a, b = 0.0, float(losses[-1])
    for _ in range(60):
        m = (a + b) / 2
        a, b = (m, b) if delta_at(m) > delta else (a, m)
    return b


@pytest.mark.parametrize("k,q,sigma,steps", [(2, 0.05, 1.0, 6), (3, 0.1, 1.5, 6), (5, 0.02, 1.2, 6)])
def test_each_direction_is_within_2_percent_of_a_brute_force_person_pld(k, q, sigma, steps):
    delta, h = 1e-4, 1e-3
    grouped = group_event(ev.dpsgd_event(q, sigma, steps), k)
    assert grouped == ev.SelfComposedEvent(ev.binomial_mixture(q, sigma, k), steps)
    assert group_accounting(grouped) == EXACT_MIXTURE
    pld = pld_for(grouped)
    p, qd = _person_pair(q, sigma, k)
    for mine, (pa, pb) in ((pld._pmf_remove, (p, qd)), (pld._pmf_add, (qd, p))):  # removal, addition
        brute = _brute_epsilon(*_loss_pmf(pa, pb, h), steps, h, delta)
        charged = float(mine.get_epsilon_for_delta(delta))
        assert charged == pytest.approx(brute, rel=0.02), (k, charged, brute)
        assert charged >= brute * (1 - 0.02)
    # the record-level event under-counts the person (the conservative map's excess: the reference test)
    assert spend(ev.dpsgd_event(q, sigma, steps), delta).epsilon < spend(grouped, delta).epsilon


@pytest.mark.parametrize("k,q,sigma,steps", [(2, 0.05, 1.0, 50), (3, 0.02, 1.0, 100), (5, 0.01, 2.0, 100)])
def test_the_charge_matches_dp_accountings_own_mixture_accountant(k, q, sigma, steps):
    """dp-accounting's PLDAccountant composing MixtureOfGaussiansDpEvent (its own builder, a coarser
    grid: slower code, same mathematics) within 2%; ours never below it by more than the grid."""
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-2)
    probs = stats.binom.pmf(np.arange(k + 1), k, q)
    acc.compose(dp_event.MixtureOfGaussiansDpEvent(sigma, list(range(k + 1)), list(probs)), steps)
    theirs = acc.get_epsilon(1e-5)
    ours = spend(group_event(ev.dpsgd_event(q, sigma, steps), k), 1e-5).epsilon
    assert ours == pytest.approx(theirs, rel=0.02)


@pytest.mark.parametrize("k,q,sigma,grid", [(3, 0.1, 1.5, 5e-3), (20, 0.01, 0.9, 2e-2)])
def test_the_vectorised_builder_is_the_librarys_pld_bit_for_bit(k, q, sigma, grid):
    """Its inverse (evaluated once per run of shared midpoints) and its running maximum of δ
    give the library's PMFs exactly, at a small and a large group."""
    sens, probs = [float(c) for c in range(k + 1)], list(stats.binom.pmf(np.arange(k + 1), k, q))
    ours = mixture_gaussian_pld(sigma, sens, probs, grid)
    theirs = pld_lib.from_mixture_gaussian_mechanism(sigma, sens, probs, value_discretization_interval=grid)
    for a, b in ((ours._pmf_remove, theirs._pmf_remove), (ours._pmf_add, theirs._pmf_add)):
        assert a._lower_loss == b._lower_loss and a._infinity_mass == b._infinity_mass
        np.testing.assert_array_equal(a._probs, b._probs)


@pytest.mark.parametrize("k,q,sigma,steps,exact,mapped", [(2, 0.05, 1.0, 200, 10.7, 44.3), (3, 0.1, 1.5, 100, 13.1, 75.7)])
def test_the_issues_reference_numbers(k, q, sigma, steps, exact, mapped):
    record = ev.dpsgd_event(q, sigma, steps)
    charged = spend(group_event(record, k), 1e-5)
    assert round(charged.epsilon, 1) == exact
    assert charged.epsilon == charged.epsilon_pld  # the exact mixture is the PLD accountant's
    assert charged.epsilon_rdp > charged.epsilon  # the RDP cross-check is the conservative map's curve
    assert spend_by("pld", group_event(record, k), 1e-5).epsilon == pytest.approx(charged.epsilon)
    assert round(spend(ev.dpsgd_event(grouped_rate(q, k), sigma / k, steps), 1e-5).epsilon, 1) == mapped


def test_mixture_events_round_trip_and_validate():
    m = ev.binomial_mixture(0.1, 2.0, 3)
    assert m.sensitivities == (0.0, 1.0, 2.0, 3.0)
    assert m.sampling_probs == pytest.approx(tuple(stats.binom.pmf(np.arange(4), 3, 0.1)), rel=1e-12)
    assert m.moved_probability == pytest.approx(grouped_rate(0.1, 3), rel=1e-12) and m.max_sensitivity == 3.0
    assert ev.event_from_json(ev.event_to_json(ev.SelfComposedEvent(m, 4))) == ev.SelfComposedEvent(m, 4)
    with pytest.raises(ValueError, match="sum to 1"):
        ev.MixtureOfGaussiansEvent(1.0, (0.0, 1.0), (0.5, 0.6))
    with pytest.raises(ValueError, match="as many"):
        ev.MixtureOfGaussiansEvent(1.0, (0.0, 1.0), (1.0,))
    # no proven rule groups an already grouped mixture again: refused, never guessed
    from privacy.group import GroupPrivacyError

    with pytest.raises(GroupPrivacyError, match="MixtureOfGaussiansEvent"):
        group_event(m, 2)


def test_which_rule_charged_is_named():
    g, ld = ev.dpsgd_event(0.1, 1.0, 3), ev.SelfComposedEvent(ev.PoissonSampledEvent(0.1, ev.ExponentialEvent(0.5)), 2)
    assert group_accounting(group_event(g, 2)) == EXACT_MIXTURE
    assert group_accounting(group_event(ev.GaussianEvent(1.0), 2)) == "exact"
    with pytest.raises(Exception):
        group_event(ld, 2)  # an exponential mechanism has no group rule at all
    sub_gauss_of_composed = ev.PoissonSampledEvent(0.1, ev.ComposedEvent((ev.GaussianEvent(1.0), ev.GaussianEvent(2.0))))
    both = group_event(ev.ComposedEvent((g, sub_gauss_of_composed)), 2)
    assert group_accounting(both) == f"{EXACT_MIXTURE}+{CONSERVATIVE_MAP}"
    assert math.isfinite(spend(both, 1e-5).epsilon)


def test_the_mixture_is_the_mechanisms_own_sigma_rate_and_steps():
    """Mechanism and accountant agree: the person's mixture keeps the record-level σ (the noise the
    mechanism adds), the mechanism's rate q (moved probability 1 − (1 − q)^k) and its steps."""
    record = ev.dpsgd_event(0.04, 1.3, 10)
    grouped = group_event(record, 4)
    assert grouped.event.noise_multiplier == record.event.event.noise_multiplier
    assert grouped.event.moved_probability == pytest.approx(grouped_rate(0.04, 4), rel=1e-12)
    assert grouped.count == record.count


def test_a_ledger_composes_its_stored_events_old_conservative_entries_kept(tmp_path):
    """A sweep over the unit on one ledger: an entry charged before (the conservative map, stored
    as its event) keeps its event; a new entry is charged the exact mixture; the dataset's ε is the
    composition of the stored events by the accountant (no stale number), below what two
    conservative charges would compose to."""
    from privacy.ledger import Ledger

    fp, delta, k = "c0ffee" + "0" * 58, 1e-5, 3
    record = ev.dpsgd_event(0.05, 1.2, 40)
    old = ev.dpsgd_event(grouped_rate(0.05, k), 1.2 / k, 40)  # what the ledger stored before issue 37
    new = group_event(record, k)
    led = Ledger(tmp_path / "ledger.db")
    led.register_dataset(fp, "people", 1000.0, delta)
    led.reserve(fp, "before", old)
    led.commit("before", old)
    led.reserve(fp, "after", new)
    led.commit("after", new)
    rows = {e["run_id"]: ev.event_from_dict(e["event"]) for e in Ledger(tmp_path / "ledger.db").entries(fp)}
    assert rows == {"before": old, "after": new}
    composed = spend(ev.ComposedEvent((old, new)), delta).epsilon
    assert led.spent(fp).epsilon == pytest.approx(composed, rel=1e-9)
    assert composed < spend(ev.ComposedEvent((old, old)), delta).epsilon
    assert led.counted_events(fp) == [old, new]
