"""The accountant's door: compose privacy events, answer ε at δ (and δ at ε), calibrate noise.

Every answer comes from an accountant of the registry (``accountants.py``, Opacus-style
``register_accountant`` / ``create_accountant``); :func:`spend` asks the default,
``"min_pld_rdp"``: the smaller of two *valid upper bounds*, the PLD accountant of dp-accounting
(tightest for Gaussian events) and the independent RDP computation of ``rdp.py`` (tighter for long
compositions of exponential mechanisms, which PLD can only see through their (ε, δ) envelope).
Both numbers are always reported, so every DP claim shows its cross-check.

Parallel composition (disjoint data, e.g. DP-OPT's generation vs. validation) at the top level
costs the maximum over parts.

The calibrations (a target ε in, σ or a number of queries or the largest fitting target out) are
searches of ``calibrate.py`` over these answers.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache

from . import calibrate
from . import events as ev
from .accountants import (DEFAULT_ACCOUNTANT, PrivacySpend, cached_spend, create_accountant,  # noqa: F401
                          epsilon_pld, epsilon_rdp, register_accountant, registered_accountants)
from .accountants import unwrapped as _unwrapped
from .calibration_cache import cached
from .pld import DISCRETIZATION
from .validation import check_count, check_delta, check_epsilon, check_rate


def spend(event: ev.DpEvent, delta: float, discretization: float = DISCRETIZATION,
          dataset_size: int | None = None) -> PrivacySpend:
    """ε at δ by the default accountant (``accountants.DEFAULT_ACCOUNTANT``: min(PLD, RDP), both
    reported); the coarser the PLD discretisation, the faster and the more pessimistic (never
    optimistic) its answer. With ``dataset_size``, δ ≥ 1/n is warned about."""
    return spend_by(DEFAULT_ACCOUNTANT, event, delta, discretization, dataset_size)


def spend_by(accountant: str, event: ev.DpEvent, delta: float, discretization: float = DISCRETIZATION,
             dataset_size: int | None = None) -> PrivacySpend:
    """:func:`spend` by the accountant registered under ``accountant`` (``accountants.py``)."""
    check_delta(delta, "delta", n=dataset_size)
    firsts, rest, share = ev.split_adaptive(event)
    if not firsts:
        return cached_spend(accountant, _unwrapped(event), float(delta), float(discretization))
    # adaptive parts: basic composition of the releases that chose the rest and of the rest
    head = cached_spend(accountant, _unwrapped(ev.ComposedEvent(firsts)), float(delta) * share, float(discretization))
    tail = cached_spend(accountant, _unwrapped(ev.ComposedEvent(rest)), float(delta) * (1 - share),
                        float(discretization))
    return _added(head, tail, delta, share)


def _added(head: PrivacySpend, tail: PrivacySpend, delta: float, share: float) -> PrivacySpend:
    def both(a, b):
        return None if a is None or b is None else a + b

    return PrivacySpend(epsilon=head.epsilon + tail.epsilon, delta=float(delta),
                        epsilon_pld=both(head.epsilon_pld, tail.epsilon_pld),
                        epsilon_rdp=both(head.epsilon_rdp, tail.epsilon_rdp), rdp_order=tail.rdp_order,
                        accountant=f"{tail.accountant} + basic composition ({share:g} δ)")


_SPLITS = tuple(i / 40 for i in range(1, 40))  # the ε splits tried for δ at ε of an adaptive event


def delta_for_epsilon(event: ev.DpEvent, epsilon: float, accountant: str = DEFAULT_ACCOUNTANT) -> float:
    """Smallest δ for which the event is (ε, δ)-DP (by default over both accountants); with adaptive
    parts, the smallest δ_first(tε) + δ_rest((1 − t)ε) over a grid of splits t (basic composition)."""
    check_epsilon(epsilon, "epsilon")
    answer = create_accountant(accountant).delta_for_epsilon
    firsts, rest, _ = ev.split_adaptive(event)
    if not firsts:
        return answer(_unwrapped(event), epsilon)
    head, tail = _unwrapped(ev.ComposedEvent(firsts)), _unwrapped(ev.ComposedEvent(rest))
    return min(1.0, min(answer(head, t * epsilon) + answer(tail, (1 - t) * epsilon) for t in _SPLITS))


class PrivacyAccountant:
    """Accumulates events; answers the spend of everything composed so far.

    >>> acct = PrivacyAccountant()
    >>> acct.compose(ev.PoissonSampledEvent(0.01, ev.GaussianEvent(1.0)), count=3000)
    >>> round(acct.epsilon(1e-5), 1)
    3.2
    """

    def __init__(self, events: list[ev.DpEvent] | None = None, accountant: str = DEFAULT_ACCOUNTANT):
        self._events: list[ev.DpEvent] = list(events or [])
        self.accountant = accountant  # a name of the registry (accountants.py)

    def compose(self, event: ev.DpEvent, count: int = 1) -> "PrivacyAccountant":
        check_count(count, "count")
        if count == 1:
            self._events.append(event)
        elif count > 1:
            self._events.append(ev.SelfComposedEvent(event, count))
        return self

    @property
    def event(self) -> ev.DpEvent:
        if len(self._events) == 1:
            return self._events[0]
        return ev.ComposedEvent(tuple(self._events))

    def spend(self, delta: float) -> PrivacySpend:
        return spend_by(self.accountant, self.event, delta)

    def epsilon(self, delta: float) -> float:
        return self.spend(delta).epsilon

    def delta(self, epsilon: float) -> float:
        return delta_for_epsilon(self.event, epsilon, self.accountant)

    def to_json(self) -> str:
        return json.dumps({"events": [ev.event_to_dict(e) for e in self._events]}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "PrivacyAccountant":
        data = json.loads(text)
        return cls([ev.event_from_dict(e) for e in data["events"]])


# ---- calibration -----------------------------------------------------------------------------

def calibrate_noise_multiplier(target_epsilon: float, delta: float, sample_rate: float, steps: int,
                               tolerance: float = 1e-3) -> float:
    """Smallest noise multiplier σ (to ``tolerance`` relative) whose DP-SGD run of ``steps``
    Poisson-subsampled steps at ``sample_rate`` spends at most ``target_epsilon`` at ``delta``.

    Bisection on log σ: first on the fast RDP bound (which only over-estimates ε, so its σ is
    always sufficient), then refined with the full accountant between the bracket it gives.
    """
    check_epsilon(target_epsilon, "target_epsilon")
    check_delta(delta, "delta")
    check_rate(sample_rate, "sample_rate")
    check_count(steps, "steps", minimum=1)
    # a pure function of its arguments, computed once per process (each costs ~2 s of accounting;
    # plan, preflight, the run and the largest-fitting search ask for the same ones)
    # and across processes, in the state folder's accounting cache (calibration_cache.py)
    return cached("noise_multiplier", _calibrate_noise_multiplier, float(target_epsilon), float(delta),
                  float(sample_rate), int(steps), float(tolerance))


@lru_cache(maxsize=1024)
def _calibrate_noise_multiplier(target_epsilon: float, delta: float, sample_rate: float, steps: int,
                                tolerance: float) -> float:
    def eps_rdp(sigma):
        return epsilon_rdp(ev.dpsgd_event(sample_rate, sigma, steps), delta)[0]

    @lru_cache(maxsize=None)
    def eps_full(sigma):
        # Coarse pessimistic PLD: the σ it accepts is also accepted at the finer default. (Fine
        # for Gaussians, whose PLD uses connect-the-dots; not for the canonical (ε, δ) pairs,
        # where rounding up accumulates over compositions.) With RDP beside it (the default
        # accountant's min): at small ε the coarse PLD can sit above RDP, and the search's fitting
        # end — a σ the RDP bound accepts — must fit the function searched.
        return spend(ev.dpsgd_event(sample_rate, sigma, steps), delta, discretization=1e-3).epsilon

    # bracket on the RDP bound: σ doubled from 1 until it fits (at most 1e4), then the lower end
    # halved while it still fits (down to 1e-3)
    _, hi = calibrate.walk(lambda s: eps_rdp(s) > target_epsilon, 1.0, lambda s: None if s * 2.0 > 1e4 else s * 2.0)
    if hi is None:
        raise ValueError(f"target_epsilon={target_epsilon} is unreachable for these settings")
    _, lo = calibrate.walk(lambda s: s > 1e-3 and eps_rdp(s) <= target_epsilon, hi / 2.0, lambda s: s / 2.0)
    # Refine on the RDP curve, then on the full accountant (PLD ≤ RDP here, so the answer moves down).
    # (to 5 %: its σ is only the bracket's fitting end; the PLD search below narrows it)
    hi, lo = _bisect_sigma(eps_rdp, target_epsilon, hi, lo, max(tolerance, 0.05))
    lo = lo / 1.5
    if eps_full(lo) <= target_epsilon:  # extremely loose RDP: widen the bracket
        lo /= 4.0
    return _secant_sigma(eps_full, target_epsilon, hi, lo, tolerance)


def _secant_sigma(epsilon_of, target_epsilon: float, hi: float, lo: float, tolerance: float) -> float:
    """The fitting σ of the bracket ``[lo, hi]`` (``hi`` fits, ``lo`` does not) narrowed by secant
    steps on (log σ, log ε) — ε(σ) of a Gaussian composition is smooth and near a power law, so
    3–4 accountant calls do what bisection needs 9 for — aimed a quarter of ``tolerance`` inside
    the target so the tests fall on both sides, kept 2 % inside the bracket's ends. Stops
    when the fitting end spends between ``target·(1 − tolerance)`` and the target, or the bracket
    is within a factor ``1 + tolerance``; the answer is the bracket's fitting end."""
    seen: dict[float, float] = {}

    def at(s: float) -> float:
        if s not in seen:
            seen[s] = epsilon_of(s)
        return seen[s]

    aim = math.log(target_epsilon * (1 - tolerance / 4))

    def propose(b: calibrate.Bracket) -> float:
        a, z = math.log(b.lo), math.log(b.hi)
        e_lo, e_hi = at(b.lo), at(b.hi)
        if not (math.isfinite(e_lo) and e_lo > e_hi > 0):
            return math.sqrt(b.lo * b.hi)
        t = a + (z - a) * (math.log(e_lo) - aim) / (math.log(e_lo) - math.log(e_hi))
        return math.exp(min(max(t, a + 0.02 * (z - a)), a + 0.98 * (z - a)))

    def done(b: calibrate.Bracket) -> bool:
        return (target_epsilon * (1 - tolerance) <= at(b.good) <= target_epsilon
                or calibrate.ratio_within(tolerance)(b))

    return calibrate.search(lambda s: at(s) <= target_epsilon, good=hi, bad=lo, good_is_high=True,
                            propose=propose, narrow=done).good


def _bisect_sigma(epsilon_of, target_epsilon: float, hi: float, lo: float, tolerance: float) -> tuple[float, float]:
    """(fitting σ, non-fitting σ) within a factor 1 + tolerance, by bisection on log σ."""
    b = calibrate.search(lambda s: epsilon_of(s) <= target_epsilon, good=hi, bad=lo, good_is_high=True,
                         propose=calibrate.geometric, narrow=calibrate.ratio_within(tolerance))
    return b.good, b.bad


def max_limited_domain_queries(target_epsilon: float, delta: float, epsilon0: float, delta0: float,
                               sample_rate: float, limit: int = 1_000_000) -> int:
    """How many Poisson-subsampled LimitedDomain token queries fit in (target_epsilon, delta)."""
    check_epsilon(target_epsilon, "target_epsilon")
    check_delta(delta, "delta")

    def fits(n: int) -> bool:
        if n == 0:
            return True
        event = ev.SelfComposedEvent(ev.PoissonSampledEvent(sample_rate, ev.LimitedDomainEvent(epsilon0, delta0)), n)
        # (no RDP shortcut: a subsampled LimitedDomain's RDP curve is not a proven bound, and its ε
        # is PLD's alone — rdp.rdp_is_proven)
        return spend(event, delta).epsilon <= target_epsilon

    if not fits(1):
        return 0
    # doubled from 2 while it fits (up to the limit), then bisection on the integers
    fitting, above = calibrate.walk(lambda n: n <= limit and fits(n), 2, lambda n: n * 2)
    lo = 1 if fitting is None else fitting
    hi = min(above, limit + 1)
    return calibrate.search(fits, good=lo, bad=hi, good_is_high=False, propose=calibrate.integer,
                            narrow=calibrate.width_within(1)).good


def largest_fitting_epsilon(events_for, existing: list[ev.DpEvent], delta: float, cap: float,
                            rel_tol: float = 0.004, max_evaluations: int = 40) -> float | None:
    """The largest target ε whose run still fits a budget: ``events_for(x)`` gives the run's
    planned events at target ε = x (raising ``ValueError`` where no run can be planned at x); the
    run fits when those events composed with ``existing`` (what the dataset has spent) give
    ε ≤ ``cap`` at ``delta``. Composition is sub-additive, so this is not cap − spent.

    Returns x such that a run at x fits and one at some x' ≤ x·(1 + rel_tol) does not (both
    evaluated; the composed ε grows with x), at most the cap (or the first guess above it), or
    None when no x ≥ cap·1e-4 fits. Bracketed search: interpolation on the composed ε (it is
    smooth in x), with bisection whenever one side of the bracket stays put
    (``calibrate.toward``; each evaluation calibrates a run, so evaluations are few)."""
    check_epsilon(cap, "cap")
    check_delta(delta, "delta")
    existing = list(existing)
    memo: dict[float, float] = {}

    def total(x: float) -> float:
        if x not in memo:
            if len(memo) >= max_evaluations:
                raise RuntimeError("largest_fitting_epsilon: no bracket after the maximum of evaluations")
            try:
                planned = list(events_for(x))
            except ValueError:
                memo[x] = math.inf  # no run can be planned at x
            else:
                memo[x] = spend(ev.ComposedEvent(tuple(existing + planned)), delta).epsilon if planned else 0.0
        return memo[x]

    spent_now = spend(ev.ComposedEvent(tuple(existing)), delta).epsilon if existing else 0.0
    floor = cap * 1e-4
    # sub-additivity makes cap − spent a good first guess from below; a quarter of it while it does
    # not fit, down to the floor
    _, lo = calibrate.walk(lambda x: total(x) > cap, max(cap - spent_now, floor),
                           lambda x: None if x <= floor else max(x / 4.0, floor))
    if lo is None:
        return None
    hi = max(cap, lo * 1.5)
    if total(hi) <= cap:
        return hi  # a target above the cap is never asked for: the whole cap fits
    return calibrate.search(lambda x: total(x) <= cap, good=lo, bad=hi, good_is_high=False,
                            propose=calibrate.toward(cap, total, rel_tol),
                            narrow=calibrate.relative_within(rel_tol)).good  # fits; hi ≤ lo·(1 + rel_tol) does not
