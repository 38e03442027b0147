"""A release whose output chose the rest's parameters (a run's split sizes) is charged by basic
composition — at its share of δ beside the rest at the remainder — by every path: one run, a
ledger's composition of runs, a group charge, δ at ε, and entries recorded before the marker."""

from __future__ import annotations

import pytest

from privacy import accountant as acct
from privacy import events as ev
from privacy.group import group_event
from privacy.ledger import BudgetExceededError, Ledger
from tests.independent import pld_epsilon

DELTA = 1e-5
SIZES = ev.GaussianEvent(50.0)
FP = "c0de" + "2" * 60


def by_dp_accounting(event, delta):
    return pld_epsilon(event, delta, 1e-4)


def _run(sigma, steps, q=0.02, comparison=20.0):
    return ev.AdaptiveEvent(SIZES, ev.ComposedEvent((ev.dpsgd_event(q, sigma, steps), ev.GaussianEvent(comparison))))


def test_one_run_is_its_release_at_a_tenth_of_delta_plus_the_rest_by_dp_accounting():
    run = _run(0.9, 300)
    got = acct.spend(run, DELTA)
    expected = by_dp_accounting(SIZES, DELTA / 10) + by_dp_accounting(run.then, 0.9 * DELTA)
    assert got.epsilon == pytest.approx(expected, rel=2e-3)
    assert got.epsilon >= acct.spend(ev.ComposedEvent((SIZES, run.then)), DELTA).epsilon  # never the PLD inside
    assert "basic composition" in got.accountant and got.delta == DELTA
    assert ev.event_from_json(ev.event_to_json(run)) == run


def test_a_ledgers_runs_compose_their_releases_together_and_their_rests_together():
    a, b = _run(0.9, 300), _run(1.1, 200, q=0.03)
    both = acct.spend(ev.ComposedEvent((a, b)), DELTA).epsilon
    releases = by_dp_accounting(ev.ComposedEvent((SIZES, SIZES)), DELTA / 10)
    rests = by_dp_accounting(ev.ComposedEvent((a.then, b.then)), 0.9 * DELTA)
    assert both == pytest.approx(releases + rests, rel=2e-3)
    assert both < acct.spend(a, DELTA).epsilon + acct.spend(b, DELTA).epsilon  # the rests still compose by PLD


def test_a_group_charge_keeps_the_split_and_charges_each_part_for_the_group():
    run = _run(0.9, 300)
    grouped = group_event(run, 3)
    assert isinstance(grouped, ev.AdaptiveEvent) and grouped.first == ev.GaussianEvent(50.0 / 3)
    assert grouped.then == group_event(run.then, 3)
    assert acct.spend(grouped, DELTA).epsilon == pytest.approx(
        acct.spend(grouped.first, DELTA / 10).epsilon + acct.spend(grouped.then, 0.9 * DELTA).epsilon)


def test_delta_at_epsilon_is_the_best_split_of_the_two_deltas():
    run = _run(0.9, 300)
    eps = acct.spend(run, DELTA).epsilon
    d = acct.delta_for_epsilon(run, eps)
    assert d == pytest.approx(min(acct.delta_for_epsilon(SIZES, t * eps) + acct.delta_for_epsilon(run.then, (1 - t) * eps)
                                  for t in acct._SPLITS))
    assert 0 < d <= DELTA * 1.01  # the plan's own split is one of many


def test_an_adaptive_part_where_basic_composition_cannot_split_it_is_refused():
    run = _run(0.9, 300)
    for bad in (ev.PoissonSampledEvent(0.5, run), ev.SelfComposedEvent(run, 2), ev.ParallelEvent((run, SIZES))):
        with pytest.raises(ValueError, match="cannot be accounted"):
            acct.spend(bad, DELTA)
    with pytest.raises(ValueError, match="cannot hold another"):
        ev.AdaptiveEvent(SIZES, run)
    with pytest.raises(ValueError):
        ev.AdaptiveEvent(SIZES, run.then, first_delta_share=1.0)


def test_the_ledger_never_passes_the_cap_counted_by_basic_composition(tmp_path):
    """A run at 4, then the largest run the ledger admits under a cap of 8: the spend the ledger
    states is the proven one (the two releases at δ/10, the two rests at 9δ/10, by dp-accounting), ≤ 8."""
    led = Ledger(tmp_path / "ledger.db")
    led.register_dataset(FP, "toy", 8.0, DELTA)

    def at(target):  # a run at about ``target``: DP-SGD's σ chosen for it, with the release in front
        sigma = acct.calibrate_noise_multiplier(target - acct.spend(SIZES, DELTA / 10).epsilon, 0.9 * DELTA, 0.02, 300)
        return ev.AdaptiveEvent(SIZES, ev.dpsgd_event(0.02, sigma, 300))

    first = at(4.0)
    led.reserve(FP, "run-1", first)
    led.commit("run-1", first)
    fits = acct.largest_fitting_epsilon(lambda x: [at(x)], led.counted_events(FP), DELTA, 8.0)
    second = at(fits)
    led.reserve(FP, "run-2", second)
    spent = led.spent(FP).epsilon
    proven = (by_dp_accounting(ev.ComposedEvent((SIZES, SIZES)), DELTA / 10)
              + by_dp_accounting(ev.ComposedEvent((first.then, second.then)), 0.9 * DELTA))
    assert spent == pytest.approx(proven, rel=2e-3) and spent <= 8.0
    assert proven <= 8.0 * 1.002
    with pytest.raises(BudgetExceededError):
        led.reserve(FP, "run-3", at(1.0))


def test_an_entry_recorded_before_the_marker_is_counted_with_its_release_split_off(tmp_path):
    """The ledger's older entries hold the release composed in front of the rest (and into each
    parallel branch): it is split off as a new entry's is, so an old ledger is counted the same way."""
    from privacy.ledger.common import _counted

    rest = ev.ComposedEvent((ev.dpsgd_event(0.02, 0.9, 300), ev.GaussianEvent(20.0)))
    legacy = ev.ComposedEvent((SIZES, ev.dpsgd_event(0.02, 0.9, 300), ev.GaussianEvent(20.0)))
    assert _counted(ev.event_to_json(legacy)) == ev.AdaptiveEvent(SIZES, rest)
    branches = (ev.dpsgd_event(0.02, 0.9, 300), ev.ExponentialEvent(1.0))
    parallel = ev.ParallelEvent(tuple(ev.ComposedEvent((SIZES, b)) for b in branches))
    assert _counted(ev.event_to_json(parallel)) == ev.AdaptiveEvent(SIZES, ev.ParallelEvent(branches))
    icl = ev.ComposedEvent((ev.ComposedEvent((SIZES, ev.GaussianEvent(3.0))), ev.GaussianEvent(3.0)))
    assert _counted(ev.event_to_json(icl)) == ev.AdaptiveEvent(SIZES, ev.ComposedEvent((ev.GaussianEvent(3.0),) * 2))
    plain = ev.dpsgd_event(0.02, 0.9, 300)  # no release in front: as it is
    assert _counted(ev.event_to_json(plain)) == plain
    led = Ledger(tmp_path / "ledger.db")
    led.register_dataset(FP, "toy", 8.0, DELTA)
    led.reserve(FP, "old", legacy)
    assert led.spent(FP).epsilon == pytest.approx(acct.spend(ev.AdaptiveEvent(SIZES, rest), DELTA).epsilon)
    assert led.spent(FP).epsilon > acct.spend(legacy, DELTA).epsilon
