"""The one place a run's plan is computed: :func:`plan_for` (config, method, released sizes) →
a frozen :class:`privacy.plan.RunPlan`, by the pure planner of ``privacy/plan.py`` with the
method's own calibration (``Mechanism.plan`` at the ε share the planner gives it; a selection of its
settings is the method's :func:`tasks.selected.selected` spec). The flow computes it once
and hands it to the tasks; ``privprompt plan`` (``tasks/planning.py``) and the budget hints
(:func:`largest_fitting_target_epsilon`) call the same function. Nothing here writes a value
into a config: the budget travels as an argument.
"""

from __future__ import annotations

import math
from dataclasses import replace

from privacy import accountant as acct
from privacy import events as ev
from privacy import plan as pplan
from privacy.plan import RunPlan

from .errors import ConfigError

SIZES_DELTA_SHARE = pplan.SIZES_DELTA_SHARE


def resolve_delta(cfg, n_train: int) -> float:
    """δ of a run, under one policy for every method:

    * no ``privacy.target_delta``: min(1e-5, 1/(10·n_train)), rounded down to 1, 2 or 5 × 10^k;
    * a configured δ ≥ 1/n_train — which (ε, δ)-DP lets a mechanism spend on publishing whole
      records — is refused with a :class:`ConfigError`, unless the config opts in with
      ``privacy.allow_delta_at_least_one_over_n: true`` (then it is warned about, and the run
      record says so: :func:`delta_opt_in`)."""
    import numbers

    from privacy.validation import check_delta

    if isinstance(n_train, bool) or not isinstance(n_train, numbers.Integral) or n_train < 1:
        raise ConfigError(f"a run's δ needs the number of training records n_train >= 1, got {n_train!r}")
    n_train = int(n_train)
    if cfg.privacy.target_delta:
        allow = cfg.privacy.allow_delta_at_least_one_over_n
        try:
            return check_delta(cfg.privacy.target_delta, "privacy.target_delta", n=n_train,
                               allow_at_least_one_over_n=allow)
        except ValueError as exc:
            raise ConfigError(
                f"{exc}; or, to accept it knowingly, set "
                "privacy.allow_delta_at_least_one_over_n: true (the run record then carries "
                "privacy.delta_opt_in=true)") from None
    # rounded down to 1, 2 or 5 × 10^k: n here is a released size, and a partition drawn anew (its
    # file touched) must keep its dataset's δ, not move it by a record's worth of noise
    return check_delta(_round_down_125(min(1e-5, 0.1 / n_train)), "the default δ", n=n_train,
                       allow_at_least_one_over_n=False)


def delta_opt_in(cfg, n_train: int, delta: float) -> bool:
    """True when this run's δ is ≥ 1/n_train under ``privacy.allow_delta_at_least_one_over_n``
    (the run record tags it ``privacy.delta_opt_in``)."""
    return bool(cfg.privacy.allow_delta_at_least_one_over_n and n_train >= 1 and delta >= 1.0 / n_train)


def _round_down_125(x: float) -> float:
    """The largest 1, 2 or 5 × 10^k not above ``x`` (> 0)."""
    k = math.floor(math.log10(x))
    for m in (5, 2, 1):
        if m * 10.0 ** k <= x * (1 + 1e-12):
            return float(f"{m}e{k}")
    return float(f"5e{k - 1}")


def runner(cfg, name: str):
    """What runs method ``name`` of ``cfg`` through the lifecycle: the method, or — when its
    settings are selected privately — its :func:`tasks.selected.selected` spec."""
    from .selected import method_for

    return method_for(cfg, name)


def plan_for(cfg, name: str, sizes, delta: float | None = None, target_epsilon: float | None = None) -> RunPlan:
    """Method ``name``'s run plan on the released ``sizes`` (:class:`tasks.data.ReleasedSizes`:
    the method plans with ñ, and for a dp claim their release is part of the run's mechanism,
    ``privacy.plan.plan_run``), at δ ``delta`` (None: :func:`resolve_delta`) and the budget
    ``target_epsilon`` (None: the config's ``privacy.target_epsilon``; :func:`planned_events`
    asks other budgets). The config is read, never changed. Raises :class:`ConfigError`."""
    method = runner(cfg, name)
    if delta is None:
        delta = resolve_delta(cfg, sizes.n_for_delta)
    target = float(cfg.privacy.target_epsilon if target_epsilon is None else target_epsilon)

    def calibration(epsilon: float, delta_share: float):
        # whether the run reads private rows is the method's declared trait, never a plan's own say
        own = method.mechanism.plan(cfg, sizes.n_train, delta_share, epsilon=epsilon)
        return replace(own, reads_private=method.traits.reads_private)

    try:
        plan = pplan.plan_run(name, target, delta, sizes.n_train, calibration, sizes_event=sizes.event,
                              sizes_sigma=sizes.sigma, unit=cfg.data.charge_unit, group_size=cfg.data.group_size,
                              person_field=cfg.data.person_field, always_dp=method.traits.always_dp,
                              release=method.traits.release, statistics=release_statistics(method),
                              no_prompt_share=no_prompt_share(cfg, method, name),
                              no_prompt_statistics=(NO_PROMPT_STATISTIC,))
    except pplan.PlanError as exc:
        raise ConfigError(str(exc)) from None
    check_statistics(plan)
    return plan


def shadow_plan(cfg, name: str, sizes, n_pool: int) -> RunPlan:
    """An audit shadow's plan: the audited run's own (:func:`plan_for` on its released ``sizes``:
    σ from the method's share after the sizes release, q on the run's ñ), so a shadow has the
    audited prompt's noise. A selection's trials are calibrated inside the selection: its shadows
    (and a shadow without sizes) are the method at the whole target, on ñ (or the pool's ``n_pool``)."""
    from .selected import Selection

    run = runner(cfg, name)
    method = run.mechanism.method if isinstance(run.mechanism, Selection) else run
    if sizes is None or run is not method:
        n = n_pool if sizes is None else sizes.n_train
        return method.mechanism.plan(cfg, n, resolve_delta(cfg, n), epsilon=cfg.privacy.target_epsilon)
    return plan_for(cfg, name, sizes)


NO_PROMPT_STATISTIC = "no_prompt_difference"  # tasks.neighbours: the comparison's pre-noise D


def no_prompt_share(cfg, method, name: str | None = None) -> float:
    """The share of the run's target its comparison with no prompt gets (``fallback.epsilon_share``;
    0: none). None for a method that already chooses against no prompt inside its own mechanism
    (``Traits.compares_with_no_prompt``: DP-OPT's DP-argmax among its candidates and the empty
    instruction; a private selection, whose candidates include "no prompt"): a second comparison
    would read the holdout again for an answer the run's mechanism already gave; 0 for a baseline
    (``name`` other than ``cfg.method``): it publishes nothing for a comparison to guard."""
    if method.traits.compares_with_no_prompt:
        return 0.0
    if name is not None and name != cfg.method:  # a baseline beside the published method publishes nothing
        return 0.0
    return float(cfg.fallback.epsilon_share)


def check_statistics(plan: RunPlan) -> None:
    """Refuse a dp plan with a release whose pre-noise statistic the neighbour harness cannot
    compute (none declared, or one not registered in ``tasks.neighbours``): a combination nothing
    checks is never run (issue 37)."""
    from . import neighbours

    for release in plan.releases if plan.guarantee == "dp" else ():
        if release.name == "sizes":  # the partition's own counts (tasks.neighbours.released_sizes)
            continue
        missing = [s for s in release.statistics if neighbours.statistic(s) is None]
        if not release.statistics or missing:
            raise ConfigError(f"{plan.method}: its release '{release.name}' declares "
                              f"{'no pre-noise statistic' if not release.statistics else 'the unregistered ' + ', '.join(missing)}"
                              " (Traits.neighbour_statistics, tasks/neighbours.register_statistic), so the neighbour "
                              "harness cannot check its sensitivity: refused")


def release_statistics(method) -> tuple[str, ...]:
    """The pre-noise statistics a method's own release declares (``Traits.neighbour_statistics``;
    a selection adds its holdout count vectors): what the neighbour harness checks."""
    own = tuple(method.traits.neighbour_statistics)
    return own + ("selection_counts",) if method.traits.release == "selection" else own


def with_size_release(event, sizes):
    """A dp run's event: the release of its partition's sizes composed with the method's
    (``privacy.plan.with_size_release``)."""
    return pplan.with_size_release(event, sizes.event)


# ---- what fits -------------------------------------------------------------------------------

def planned_epsilon(cfg, name: str, plan, delta: float) -> float:
    """ε of a dp plan's worst case (its event, by the accountant), refused with a
    :class:`ConfigError` when above ``privacy.target_epsilon``: a method's calibration (σ, number of
    queries) must meet the target, and one that does not — a bug, or a stale or tampered accounting
    cache (privacy/calibration_cache.py) — is stopped before anything is reserved. ``plan`` and a
    run check it alike. For a record-level run charged per person it checks the per-record event
    (``plan.record_event``: what the target is for); the ledger charges ``plan.event``."""
    epsilon = acct.spend(plan.record_event if plan.record_event is not None else plan.event, delta).epsilon
    target = float(cfg.privacy.target_epsilon)
    if not epsilon <= target * (1 + 1e-6):
        raise ConfigError(f"{name}: its plan would spend ε = {epsilon:.4f} at δ = {delta:g}, above "
                          f"privacy.target_epsilon = {target:g} (a calibration that misses its target; if the "
                          "state folder's cache/accounting.json was edited or copied from elsewhere, remove it); "
                          "nothing reserved")
    return epsilon


def planned_events(cfg, sizes, delta: float, target_epsilon: float | None = None) -> list:
    """The worst-case events of every dp run of ``cfg`` (baselines and the published method) on
    the released ``sizes``, at the budget ``target_epsilon`` instead of the config's when given."""
    events = []
    for name in cfg.run_methods:
        plan = plan_for(cfg, name, sizes, delta, target_epsilon)
        if plan.event is not None:
            events.append(plan.event)
    return events


def _shown_digits(x: float) -> int:
    """Decimals that show ``x`` with 4 significant digits (never fewer than 0)."""
    return max(3 - math.floor(math.log10(x)), 0)


LARGEST_SEARCHED = 100.0  # the largest target the fitting search tries (above it no meaningful guarantee)


def largest_fitting_target_epsilon(cfg, sizes, delta: float, existing: list, cap: float) -> float | None:
    """The largest ``privacy.target_epsilon`` at which a run of ``cfg`` still fits the dataset's
    budget: its planned events composed with ``existing`` (the ledger's counted events) by the
    accountant, ≤ ``cap``. None when no run of ``cfg`` fits, or when it plans no dp event (then the
    budget does not limit it).

    The answer is the number a user types: rounded DOWN to 4 significant digits and checked to
    fit as rounded. (Rounding down alone is not enough: calibration meets each target only to a
    tolerance, so the composed ε is not monotone in the target at that scale, and 2.422 could
    compose to 3.0003 where 2.4226 composed to ≤ 3.)"""
    planned = planned_events(cfg, sizes, delta)
    if not planned:
        return None
    if not existing and len(planned) == 1 and not cfg.data.group_size:
        # nothing spent and one dp run: every method calibrates its worst case to ε ≤ its target,
        # so a run at target = cap fits, and no larger target is meaningful (exact, no search); not
        # so for a record-level run charged per person (its charge is above its per-record target)
        return float(cap)

    def fits(x: float) -> bool:
        try:
            events = planned_events(cfg, sizes, delta, x)
        except ValueError:
            return False
        return acct.spend(ev.ComposedEvent(tuple(existing + events)), delta).epsilon <= cap

    if cap > LARGEST_SEARCHED:
        # above ~100 a target states no meaningful guarantee, and calibrating σ for it (σ → 0: a
        # PLD on an ever finer grid) took minutes and gigabytes: the search stops there
        if fits(LARGEST_SEARCHED):
            return LARGEST_SEARCHED

    def events_for(x: float) -> list:
        if x > LARGEST_SEARCHED:
            raise ValueError("not searched")  # counted as not fitting: the walk steps down at once
        return planned_events(cfg, sizes, delta, x)

    found = acct.largest_fitting_epsilon(events_for, existing, delta, cap)
    if found is None:
        return None
    digits = _shown_digits(found)
    step = 10.0 ** -digits
    shown = math.floor(found / step) * step
    for _ in range(10):  # a step or two down at most, in practice
        if shown <= 0:
            break
        if fits(round(shown, digits)):
            return round(shown, digits)
        shown -= step
    return found  # fits (the search checked it), unrounded


def fitting_hint(largest: float | None) -> str:
    if largest is None:
        return "no target_epsilon fits: the dataset's budget is spent for this config"
    if largest == LARGEST_SEARCHED:
        return (f"the largest target_epsilon that still fits: ≥ {LARGEST_SEARCHED:g} (not searched further: a larger "
                "target states no meaningful guarantee)")
    return f"the largest target_epsilon that still fits: ≈ {largest:.{_shown_digits(largest)}f}"
