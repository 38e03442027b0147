"""The accountant: compose privacy events, answer ε at δ (and δ at ε), calibrate noise.

The answer (``epsilon``) is the smaller of two *valid upper bounds*: the PLD accountant of
dp-accounting (tightest for Gaussian events) and the independent RDP computation of ``rdp.py``
(tighter for long compositions of exponential mechanisms, which PLD can only see through their
(ε, δ) envelope). Both numbers are always reported, so every DP claim shows its cross-check.

Parallel composition (disjoint data, e.g. DP-OPT's generation vs. validation) at the top level
costs the maximum over parts.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from functools import lru_cache

from . import calibrate
from . import events as ev
from . import rdp as rdp_lib
from .calibration_cache import cached
from .pld import DISCRETIZATION, pld_for
from .validation import check_count, check_delta, check_epsilon, check_rate


@dataclass(frozen=True)
class PrivacySpend:
    """One (ε, δ) statement with both accountants' answers."""

    epsilon: float
    delta: float
    epsilon_pld: float | None
    epsilon_rdp: float
    rdp_order: float | None
    accountant: str = "min(pld, rdp)"

    def to_dict(self) -> dict:
        return asdict(self)


def _finite_or_inf(x: float) -> float:
    return x if x is not None and math.isfinite(x) else math.inf


def epsilon_pld(event: ev.DpEvent, delta: float, discretization: float = DISCRETIZATION) -> float | None:
    if isinstance(event, ev.ParallelEvent):
        parts = [epsilon_pld(e, delta, discretization) for e in event.events]
        return None if any(p is None for p in parts) else max(parts)
    pld = pld_for(event, discretization)
    if pld is None:
        return None
    return float(pld.get_epsilon_for_delta(delta))


def epsilon_rdp(event: ev.DpEvent, delta: float, orders=rdp_lib.DEFAULT_ORDERS) -> tuple[float, float | None]:
    """(ε, best order) from the RDP curve; ε = inf when the δ-parts alone exceed δ."""
    if isinstance(event, ev.ParallelEvent):
        parts = [epsilon_rdp(e, delta, orders) for e in event.events]
        return max(parts, key=lambda p: p[0])
    curve, delta_part = rdp_lib.rdp_of_event(event, orders)
    if delta <= delta_part:
        return math.inf, None
    return rdp_lib.rdp_to_epsilon(orders, curve, delta - delta_part)


def spend(event: ev.DpEvent, delta: float, discretization: float = DISCRETIZATION,
          dataset_size: int | None = None) -> PrivacySpend:
    """ε at δ from both accountants; the coarser the PLD discretisation, the faster and the
    more pessimistic (never optimistic) its answer. With ``dataset_size``, δ ≥ 1/n is warned about."""
    check_delta(delta, "delta", n=dataset_size)
    return _spend(_unwrapped(event), float(delta), float(discretization))


def _unwrapped(event: ev.DpEvent) -> ev.DpEvent:
    """A composition of one event is that event: its parallel parts (disjoint data) then stay at
    the top level, where their cost is the maximum over parts, instead of nested in a composition,
    where they are composed sequentially (an upper bound). The ledger composes a dataset's entries
    as one ``ComposedEvent``; with a single entry, this keeps its ε the run's own."""
    while isinstance(event, ev.ComposedEvent) and len(event.events) == 1:
        event = event.events[0]
    return event


@lru_cache(maxsize=2048)
def _spend(event: ev.DpEvent, delta: float, discretization: float) -> PrivacySpend:
    # a pure function of (event, δ, discretisation): plan, preflight, the largest-fitting search,
    # the reservation and the commit ask it again and again for the same events
    e_pld = epsilon_pld(event, delta, discretization)
    e_rdp, order = epsilon_rdp(event, delta)
    if not rdp_lib.rdp_is_proven(event):
        # the RDP curve of a subsampled δ-part mechanism is not a proven bound: PLD alone decides,
        # and where PLD cannot express the event (composed with a private selection, say) nothing
        # proven bounds it: ε = ∞, so the ledger refuses it rather than under-count
        return PrivacySpend(epsilon=_finite_or_inf(e_pld), delta=delta, epsilon_pld=e_pld, epsilon_rdp=e_rdp,
                            rdp_order=order, accountant="pld (rdp: unproven for this event, cross-check only)")
    best = min(_finite_or_inf(e_pld), e_rdp)
    if e_pld is None:
        # no cross-check: the PLD accountant cannot express the event (e.g. a private selection,
        # whose bound is an RDP statement); say so in the record
        return PrivacySpend(epsilon=best, delta=delta, epsilon_pld=None, epsilon_rdp=e_rdp, rdp_order=order,
                            accountant="rdp (no pld for this event)")
    return PrivacySpend(epsilon=best, delta=delta, epsilon_pld=e_pld, epsilon_rdp=e_rdp, rdp_order=order)


def delta_for_epsilon(event: ev.DpEvent, epsilon: float) -> float:
    """Smallest δ (over both accountants) for which the event is (ε, δ)-DP."""
    check_epsilon(epsilon, "epsilon")
    event = _unwrapped(event)
    if isinstance(event, ev.ParallelEvent):
        return max(delta_for_epsilon(e, epsilon) for e in event.events)
    candidates = []
    pld = pld_for(event, DISCRETIZATION)
    if not rdp_lib.rdp_is_proven(event):  # see spend: PLD alone decides, and without it nothing does
        return float(pld.get_delta_for_epsilon(epsilon)) if pld is not None else 1.0
    if pld is not None:
        candidates.append(float(pld.get_delta_for_epsilon(epsilon)))
    curve, delta_part = rdp_lib.rdp_of_event(event)
    d_rdp, _ = rdp_lib.rdp_to_delta(rdp_lib.DEFAULT_ORDERS, curve, epsilon)
    candidates.append(min(1.0, d_rdp + delta_part))
    return min(candidates)


class PrivacyAccountant:
    """Accumulates events; answers the spend of everything composed so far.

    >>> acct = PrivacyAccountant()
    >>> acct.compose(ev.PoissonSampledEvent(0.01, ev.GaussianEvent(1.0)), count=3000)
    >>> round(acct.epsilon(1e-5), 1)
    3.2
    """

    def __init__(self, events: list[ev.DpEvent] | None = None):
        self._events: list[ev.DpEvent] = list(events or [])

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
        return spend(self.event, delta)

    def epsilon(self, delta: float) -> float:
        return self.spend(delta).epsilon

    def delta(self, epsilon: float) -> float:
        return delta_for_epsilon(self.event, epsilon)

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

    def eps_full(sigma):
        # Coarse pessimistic PLD: the σ it accepts is also accepted at the finer default. (Fine
        # for Gaussians, whose PLD uses connect-the-dots; not for the canonical (ε, δ) pairs,
        # where rounding up accumulates over compositions.)
        return spend(ev.dpsgd_event(sample_rate, sigma, steps), delta, discretization=1e-3).epsilon

    # bracket on the RDP bound: σ doubled from 1 until it fits (at most 1e4), then the lower end
    # halved while it still fits (down to 1e-3)
    _, hi = calibrate.walk(lambda s: eps_rdp(s) > target_epsilon, 1.0, lambda s: None if s * 2.0 > 1e4 else s * 2.0)
    if hi is None:
        raise ValueError(f"target_epsilon={target_epsilon} is unreachable for these settings")
    _, lo = calibrate.walk(lambda s: s > 1e-3 and eps_rdp(s) <= target_epsilon, hi / 2.0, lambda s: s / 2.0)
    # Refine on the RDP curve, then on the full accountant (PLD ≤ RDP here, so the answer moves down).
    hi, lo = _bisect_sigma(eps_rdp, target_epsilon, hi, lo, tolerance)
    lo = lo / 1.5
    if eps_full(lo) <= target_epsilon:  # extremely loose RDP: widen the bracket
        lo /= 4.0
    return _bisect_sigma(eps_full, target_epsilon, hi, lo, tolerance)[0]


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
