"""The plan of one run, computed once and never written into a config (issue 36).

A run's budget is the user's ``target_epsilon`` at the run's δ. :func:`plan_run` divides it into
releases and returns one frozen :class:`RunPlan`:

* the release of the partition's sizes (a Gaussian count, ``(ε_S, δ/10)``: a function of its σ and
  δ only), when the method makes a ``dp`` claim;
* with ``no_prompt_share`` > 0, the comparison of the run's output with no prompt on the holdout
  (:func:`no_prompt_comparison`: a Gaussian scalar of sensitivity 1 per unit at
  ``no_prompt_share · target`` and ``δ/10``; the release ``no_prompt``, composed last);
* the method's own release, calibrated to what is left — ``ε' = target − ε_S − ε_C`` at
  ``9δ/10`` (``8δ/10`` with the comparison) —
  by the method's own calibration, handed in as a callable ``calibrate(epsilon, delta)``: σ, the
  number of steps or queries stay the method's business, the division of the budget is this
  module's. A selection of the method's settings is one such callable (its trials calibrated
  together with :func:`calibrate_trial_target`). With the comparison, the method's share is then
  raised (:func:`joint_share`) until the method and the comparison, composed by the accountant at
  ``9δ/10``, spend ``target − ε_S`` (the shares order the releases; the composed total is what is
  calibrated).

The run's guarantee (``RunPlan.guarantee_epsilon``, within :data:`JOINT_TOLERANCE` below the
target) is the sizes release ``(ε_S, δ/10)`` and the rest ``(target − ε_S, 9δ/10)`` by basic
composition of mechanisms whose (ε, δ) are fixed beforehand — it holds for the adaptive choice of
the method's parameters from the released sizes [DR14, Thm. 3.16]. The event the ledger composes
is the sizes release composed with the method's (into each branch of a parallel composition: a
record lies in one branch, and the sizes are about it too) and the comparison; the accountant's ε
of it is below the guarantee. For a record-level run charged
per person (a group of at most k records each) the ledger is charged the group-privacy event
(:func:`privacy.group.group_event`: a Poisson-subsampled Gaussian — DP-SGD, DPZero — by the exact
mixture of Gaussians, ``privacy.group_accounting`` = ``exact_mixture``; the conservative map only
where no exact form exists); the per-record event is what the target calibrates.

Pure: numpy, scipy, dp-accounting and the standard library only (tests/pipeline/test_architecture.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from . import accountant as acct
from . import calibrate
from . import events as ev

SIZES_DELTA_SHARE = 0.1  # of a dp run's δ, for the release of its partition's sizes
NO_PROMPT = "no_prompt"  # the release comparing a run's output with no prompt on the holdout
NO_PROMPT_DELTA_SHARE = 0.1  # of a dp run's δ, for that comparison (when it has one)


class PlanError(ValueError):
    """A budget that cannot be planned (one line naming the problem); nothing was reserved."""


class FrozenMap(Mapping):
    """An immutable mapping (nested dicts frozen too, lists become tuples) that pickles, compares
    equal to a dict with the same items and is hashable when its values are."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping | None = None):
        object.__setattr__(self, "_data", {k: _frozen(v) for k, v in dict(data or {}).items()})

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __setattr__(self, name, value):
        raise AttributeError("a FrozenMap cannot be changed")

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._data.items(), key=lambda kv: repr(kv[0]))))

    def __repr__(self) -> str:
        return f"FrozenMap({self._data!r})"

    def __reduce__(self):
        return FrozenMap, (thawed(self),)


def _frozen(value):
    if isinstance(value, FrozenMap):
        return value
    if isinstance(value, Mapping):
        return FrozenMap(value)
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


def thawed(value):
    """A plain (JSON-able) copy of a frozen value: FrozenMap → dict, tuple → list."""
    if isinstance(value, Mapping):
        return {k: thawed(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [thawed(v) for v in value]
    return value


@dataclass(frozen=True)
class Release:
    """One release of a run and its share of the budget: ``epsilon`` at ``delta`` (its share of
    the run's δ), its event (the worst case), and what one privacy ``unit`` moves it by
    (``sensitivity``: 1 for a mechanism stated per unit; k for a record-level one charged per
    person of ≤ k records, by group privacy). ``statistics``: the names of its deterministic pre-noise
    statistics (``tasks/neighbours.py``: the released sizes, clipped per-unit gradient sums,
    selection counts), each of which one unit moves by at most ``sensitivity`` (L2, in units of the
    mechanism's clip): what the neighbour harness checks (tests/claims/test_neighbour_harness.py); () where
    none is declared."""

    name: str
    epsilon: float
    delta: float
    event: ev.DpEvent
    sensitivity: float = 1.0
    unit: str = "record"
    statistics: tuple[str, ...] = ()


class Calibrated(Protocol):
    """What a method's calibration returns for an ε share and δ (``tasks.methods.MethodPlan``)."""

    method: str
    guarantee: str
    n_train: int
    event: ev.DpEvent | None
    params: Mapping[str, Any]
    settings: Mapping[str, Any]
    reads_private: bool
    note: str


Calibration = Callable[[float, float], Calibrated]  # (ε share, δ share) -> the method's plan at it


@dataclass(frozen=True)
class RunPlan:
    """A run's plan: δ, the user's budget and its division into releases, the method's share,
    the event the ledger is charged (``event``; ``record_event``: the per-record one of a run
    charged per person), the guarantee and the method's settings (immutable). Its attribute names
    are those of a method's plan, so ``train`` and ``post_process`` read it alike."""

    method: str
    guarantee: str
    n_train: int
    delta: float
    target_epsilon: float | None = None
    method_epsilon: float | None = None
    releases: tuple[Release, ...] = ()
    event: ev.DpEvent | None = None
    record_event: ev.DpEvent | None = None
    params: FrozenMap = field(default_factory=FrozenMap)
    settings: FrozenMap = field(default_factory=FrozenMap)
    reads_private: bool = True
    note: str = ""
    group_size: int | None = None
    guarantee_epsilon: float | None = None  # the run's proven ε at δ (per record when charged per person)

    def __post_init__(self):
        if self.guarantee not in ("dp", "ldp", "none"):
            raise PlanError(f"guarantee must be dp, ldp or none, got {self.guarantee!r}")
        if (self.event is not None) != (self.guarantee == "dp"):
            raise PlanError(f"{self.method}: a plan has a privacy event if and only if its guarantee is dp")
        object.__setattr__(self, "params", FrozenMap(self.params))
        object.__setattr__(self, "settings", FrozenMap(self.settings))
        object.__setattr__(self, "releases", tuple(self.releases))

    def release(self, name: str) -> Release | None:
        return next((r for r in self.releases if r.name == name), None)

    @property
    def sizes_event(self) -> ev.DpEvent | None:
        sizes = self.release("sizes")
        return None if sizes is None else sizes.event

    @property
    def no_prompt(self) -> Release | None:
        """The release comparing the run's output with no prompt on the holdout (None: the run has none)."""
        return self.release(NO_PROMPT)

    def charged(self, method_event: ev.DpEvent) -> tuple[ev.DpEvent, ev.DpEvent | None]:
        """The realised counterpart of the plan's events for the event a training actually spent
        (≤ the planned one): (the event the ledger is charged, the per-record event of a run
        charged per person, else None)."""
        sizes = self.release("sizes")
        share = round(sizes.delta / self.delta, 12) if sizes is not None else None  # the plan's share, not its float
        event = method_event if sizes is None else with_size_release(method_event, sizes.event, share)
        if self.no_prompt is not None:
            event = with_release(event, self.no_prompt.event)
        if self.group_size:
            return group_charge(event, self.group_size, self.method, self.charge_unit), event
        return event, None

    @property
    def own(self) -> Release | None:
        """The method's own release (``method``, or ``selection`` for a selection of its settings:
        every trial and the noisy holdout scores, one mechanism); None without a dp claim. Never the
        sizes or the no-prompt comparison."""
        return next((r for r in self.releases if r.name not in ("sizes", NO_PROMPT)), None)

    @property
    def charge_unit(self) -> str:
        """The unit the ledger charges this plan per (``record`` for a plan without releases)."""
        return "record" if self.own is None else self.own.unit


def with_size_release(event: ev.DpEvent, size_event: ev.DpEvent,
                      sizes_delta_share: float = SIZES_DELTA_SHARE) -> ev.DpEvent:
    """The sizes release and the method's event planned on its output: an adaptive composition,
    which the accountant charges by basic composition (the release at ``sizes_delta_share`` of δ,
    the rest at the remainder: what the plan's guarantee is)."""
    return ev.AdaptiveEvent(size_event, event, sizes_delta_share)


def with_release(event: ev.DpEvent, other: ev.DpEvent) -> ev.DpEvent:
    """``event`` composed with one more release (the comparison with no prompt: it reads the
    holdout, not a branch): appended to a composition (to the part chosen after the sizes), else
    a composition of the two."""
    if isinstance(event, ev.AdaptiveEvent):
        return ev.AdaptiveEvent(event.first, with_release(event.then, other), event.first_delta_share)
    if isinstance(event, ev.ComposedEvent):
        return ev.ComposedEvent(tuple(event.events) + (other,))
    return ev.ComposedEvent((event, other))


def group_accounting(event: ev.DpEvent) -> str:
    """How a group charge accounted its subsampled parts (``privacy.group.group_accounting``):
    ``exact_mixture``, ``conservative_map``, both joined by ``+``, or ``exact``."""
    from .group import group_accounting as rule

    return rule(event)


def group_charge(event: ev.DpEvent, k: int, name: str, person_field: str) -> ev.DpEvent:
    """The group-privacy event of ``event`` for a person of ≤ ``k`` records; an event without a
    proven group rule is a :class:`PlanError` naming the method."""
    from .group import GroupPrivacyError, group_event

    try:
        return group_event(event, k)
    except GroupPrivacyError as exc:
        raise PlanError(f"{name}: {exc}; refused for this record-level run on a dataset of people "
                        f"(data.person_field: {person_field})") from None


def no_prompt_comparison(epsilon: float, delta: float) -> tuple[ev.GaussianEvent, float]:
    """The comparison with no prompt at the budget (``epsilon``, ``delta``): one Gaussian release of
    D = Σ_holdout (right with the prompt − right without) — a scalar one record (one person, each of
    their rows weighing 1/n) moves by ≤ 1 — its σ the exact analytic Gaussian's
    (:func:`privacy.mechanisms.analytic_gaussian_sigma`). Returns (its event, its ε by the
    accountant: what the plan counts; never above ``epsilon`` by more than the PLD's rounding)."""
    from .mechanisms import analytic_gaussian_sigma

    event = ev.GaussianEvent(analytic_gaussian_sigma(epsilon, delta))
    return event, acct.spend(event, delta).epsilon


def plan_run(name: str, target_epsilon: float, delta: float, n_train: int, calibration: Calibration, *,
             sizes_event: ev.DpEvent | None = None, sizes_sigma: float | None = None, unit: str = "record",
             group_size: int | None = None, person_field: str | None = None, always_dp: bool = False,
             release: str = "method", sizes_delta_share: float = SIZES_DELTA_SHARE,
             statistics: tuple[str, ...] = (), no_prompt_share: float = 0.0,
             no_prompt_statistics: tuple[str, ...] = ()) -> RunPlan:
    """The one plan of method ``name``'s run: ``calibration(ε, δ)`` is the method's own (its plan
    at a budget). A method that makes no ``dp`` claim at the whole budget (``always_dp`` False:
    asked first) gets a plan without releases. A ``dp`` one: the sizes release at
    ``sizes_delta_share`` of δ; with ``no_prompt_share`` > 0 the comparison with no prompt on the
    holdout (:func:`no_prompt_comparison`) at that share of the target and ``NO_PROMPT_DELTA_SHARE``
    of δ (its statistic ``no_prompt_statistics``); the method calibrated to the rest, checked to meet
    the target (a calibration that misses it is refused), the group charge when ``group_size`` is set.
    ``release``: the name of the method's own release (``selection`` for a selection);
    ``statistics``: its declared pre-noise statistics (:class:`Release`)."""
    target = float(target_epsilon)
    if not always_dp:
        alone = calibration(target, delta)
        if alone.guarantee != "dp":
            return _plan_of(alone, delta, target_epsilon=None, method_epsilon=None)
    delta_sizes = delta * sizes_delta_share if sizes_event is not None else 0.0
    eps_sizes = acct.spend(sizes_event, delta_sizes).epsilon if sizes_event is not None else 0.0
    delta_np = delta * NO_PROMPT_DELTA_SHARE if no_prompt_share > 0 else 0.0
    np_event, eps_np = no_prompt_comparison(target * no_prompt_share, delta_np) if delta_np else (None, 0.0)
    share = target - eps_sizes - eps_np
    if not share > target * 1e-3:
        raise PlanError(f"{name}: privacy.target_epsilon = {target:g} leaves nothing for the method once the split "
                        f"sizes are released (ε = {eps_sizes:.4f} at data.size_noise_sigma = {sizes_sigma:g} records)"
                        f"{f' and the comparison with no prompt (ε = {eps_np:.4f})' if np_event else ''}; "
                        "raise the target or data.size_noise_sigma")
    method_delta = delta - delta_sizes - delta_np
    own = calibration(share, method_delta)
    if own.guarantee != "dp" or own.event is None:
        raise PlanError(f"{name}: its calibration at ε = {share:.4f} makes no dp claim (guarantee {own.guarantee!r})")
    method_eps = acct.spend(own.event, method_delta).epsilon
    if not eps_sizes + method_eps + eps_np <= target * (1 + 1e-6):
        raise PlanError(f"{name}: its plan would spend ε = {method_eps:.4f} at δ = {method_delta:g} above its "
                        f"share {share:.4f} of privacy.target_epsilon = {target:g} (a calibration that misses its "
                        "target); nothing reserved")

    def after_sizes(own_event: ev.DpEvent) -> ev.DpEvent:  # the releases chosen from the released sizes
        return own_event if np_event is None else with_release(own_event, np_event)

    rest_target, rest_delta = target - eps_sizes, delta - delta_sizes
    if np_event is not None:
        share, own = joint_share(calibration, after_sizes, share, own, rest_target, rest_delta, method_delta)
    guarantee = eps_sizes + acct.spend(after_sizes(own.event), rest_delta).epsilon
    if not guarantee <= target * (1 + 1e-6):
        raise PlanError(f"{name}: its plan would spend ε = {guarantee:.4f} above privacy.target_epsilon = {target:g} "
                        "(a calibration that misses its target); nothing reserved")
    k = group_size or None
    sized = None if sizes_event is None else Release("sizes", eps_sizes, delta_sizes, sizes_event,
                                                     statistics=("released_sizes",))
    compared = None if np_event is None else Release(NO_PROMPT, eps_np, delta_np, np_event,
                                                     statistics=tuple(no_prompt_statistics))
    own_release = Release(release, share, method_delta, own.event, statistics=tuple(statistics))
    releases = tuple(dataclasses.replace(r, sensitivity=float(k or 1), unit=person_field if k else unit)
                     for r in (sized, own_release, compared) if r is not None)
    params = {**own.params, "privacy.guarantee_epsilon": guarantee}
    if sized or compared:
        params["privacy.method_epsilon"] = share
    if sized:
        params["privacy.size_epsilon"] = eps_sizes
    if compared:
        params.update({"privacy.no_prompt_epsilon": eps_np, "no_prompt.noise_sigma": np_event.noise_multiplier})
    event = own.event if sizes_event is None else with_size_release(own.event, sizes_event, sizes_delta_share)
    event = event if np_event is None else with_release(event, np_event)
    record_event = None
    if k:
        params["privacy.group_size"] = k
        record_event, event = event, group_charge(event, k, name, person_field or unit)
        params["privacy.group_accounting"] = group_accounting(event)
    return RunPlan(own.method, "dp", own.n_train, delta, target, share, releases, event, record_event,
                   params, own.settings, own.reads_private, own.note, k, guarantee)


JOINT_TOLERANCE = 0.005  # a run's composed ε lands within 0.5 % below its target (never above)
_JOINT_TESTS = 6  # calibrations per grid at most
_COARSE = 1e-3  # the search's first accounting grid: pessimistic, so a share that fits there fits at the default


def joint_share(calibration: Calibration, composed: Callable[[ev.DpEvent], ev.DpEvent], share: float,
                own: Calibrated, target: float, delta: float, method_delta: float) -> tuple[float, Calibrated]:
    """The method's share raised until ``composed(method's event)`` — the method with the releases
    that follow it (the comparison with no prompt) — spends ``target`` at ``delta`` by the
    accountant, to within :data:`JOINT_TOLERANCE` below: (share, the method's plan at it).

    The additive split (each release alone at its part of δ) leaves 10–15 % unspent: the PLD of a
    composition at the whole δ is tighter than the sum of its parts. Composing them is valid here
    although the comparison reads the method's output: its σ is fixed beforehand and one unit moves
    its statistic by ≤ 1 whatever the output (adaptive composition of fixed dominating pairs). The
    released sizes stay outside (basic composition, :func:`plan_run`): the method's parameters are
    chosen from their output, and a PLD composition with parameters chosen from an earlier output
    is no proven bound, while basic composition of fixed (ε, δ) is.

    The composed ε(s) is smooth and increasing in the share s (a calibration's σ falls as s grows)
    with slope near 1: from the additive share, steps up by what is left, then secant steps once
    the target is bracketed — first on a coarse pessimistic grid (cheap), then, where that left more
    than the tolerance unspent at the default grid, on the default grid itself. A share whose
    calibration fails, makes no dp claim or overshoots is a bracket's upper end; a mechanism whose
    ε moves in steps (a number of queries) or stops growing ends the search at its last fitting
    share. The answer is always a tested share whose composed ε is ≤ target at the default grid."""
    def total(e: ev.DpEvent, grid: float | None) -> float:
        return acct.spend(composed(e), delta, **({} if grid is None else {"discretization": grid})).epsilon

    def at(s: float, grid: float | None) -> tuple[Calibrated | None, float]:
        try:
            mine = calibration(s, method_delta)
        except ValueError:  # no calibration at this share: above what the mechanism can be set to
            return None, math.inf
        if mine.guarantee != "dp" or mine.event is None:
            return None, math.inf
        return mine, total(mine.event, grid)

    best, good = own, share
    for grid, slack in ((_COARSE, 2 / 5), (None, 4 / 5)):  # the coarse grid: pessimistic, above the default
        fits = [(good, total(best.event, grid))]
        enough, aim, bad = target * (1 - JOINT_TOLERANCE * slack), target * (1 - JOINT_TOLERANCE * slack / 2), None
        for _ in range(_JOINT_TESTS if fits[-1][1] < enough else 0):
            s = _next_share(fits, bad, aim)
            mine, eps = at(s, grid)
            if eps > target:
                bad = (s, eps if math.isfinite(eps) else target * 2)
                if s / fits[-1][0] < 1 + 1e-6:
                    break
                continue
            grew = eps - fits[-1][1] >= target * 1e-4
            fits.append((s, eps))
            good, best = s, mine
            if not grew or eps >= enough:
                break  # close enough, or ε no longer grows with the share (discrete or capped)
    if best is not own and not total(best.event, None) <= target * (1 + 1e-9):
        return share, own  # a pessimistic coarse grid cannot overshoot; the additive share is safe
    return good, best


def _next_share(fits: list[tuple[float, float]], bad: tuple[float, float] | None, aim: float) -> float:
    """The next share to try toward composed ε = ``aim``: the secant point between the last fitting
    share and an overshooting one (kept 2 % inside them); else extrapolated along the last two
    fitting ones; else up by what is left (slope 1)."""
    g, g_eps = fits[-1]
    if bad is not None:
        t = g + (bad[0] - g) * (aim - g_eps) / max(bad[1] - g_eps, 1e-12)
        return min(max(t, g + 0.02 * (bad[0] - g)), g + 0.98 * (bad[0] - g))
    if len(fits) >= 2 and fits[-1][1] > fits[-2][1]:
        p, p_eps = fits[-2]
        return g + (aim - g_eps) * (g - p) / (g_eps - p_eps)
    return g + (aim - g_eps)


def _plan_of(own: Calibrated, delta: float, **budget) -> RunPlan:
    return RunPlan(own.method, own.guarantee, own.n_train, delta, event=own.event, params=own.params,
                   settings=own.settings, reads_private=own.reads_private, note=own.note, **budget)


# ---- a selection's trials: one per-trial target for the whole mechanism's budget ---------------

def first_trial_target(target: float, delta: float, *, every_candidate: bool, n_trained: int,
                       distribution=None, score_sigma: float | None = None) -> float:
    """A first guess of the per-trial ε at which a selection spends ``target``: every candidate
    once — ``n_trained`` Gaussian trainings composed (closed form); random stopping — the target
    less the Gaussian selection overhead of the law of K (Papernot & Steinke)."""
    from . import selection as psel

    if every_candidate:
        return psel.composed_gaussian_target(target, n_trained, delta)
    overhead = psel.gaussian_selection_overhead(
        target - psel.gaussian_selection_overhead(target / 2, delta, distribution, score_sigma), delta,
        distribution, score_sigma)
    return max(target - 1.1 * overhead, target / 8)


def calibrate_trial_target(epsilon_at: Callable[[float], float], target: float, first: float,
                           tolerance: float = 0.01) -> float:
    """The largest per-trial target ε t found at which the whole selection spends at most
    ``target`` (``epsilon_at(t)``: its ε when every trial is calibrated to t), within
    ``tolerance`` (relative) of it: secant steps from ``first`` (ε(t) is smooth and increasing
    with slope ≈ 1). Raises :class:`PlanError` when no t above target/1000 fits."""
    def at(t: float) -> float:  # a per-trial target too small for any σ does not fit (not an internal error)
        try:
            return epsilon_at(t)
        except ValueError as exc:
            if "unreachable" not in str(exc):
                raise
            return float("inf")

    try:
        best = calibrate.largest_within(at, target, first, tolerance=tolerance, floor=target * 1e-3)
    except calibrate.BelowFloor:
        raise PlanError(f"selection: privacy.target_epsilon leaves too little for the trials (the selection "
                        f"overhead alone comes near ε = {target:.4g}): raise the target, lower "
                        "selection.expected_trials or raise selection.score_noise_multiplier") from None
    if best is None:
        raise PlanError(f"selection: no per-trial calibration found that keeps the selection within ε = {target:.4g}")
    return best
