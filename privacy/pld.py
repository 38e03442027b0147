"""Privacy-loss distributions (dp-accounting) of the privacy events: the primary accountant.

dp-accounting 0.6.0 has no exponential-mechanism event and its PLD accountant ignores ``count``
for ``RandomizedResponseDpEvent`` (NOTES.md), so events are turned into PLD objects here
directly, with dp-accounting's constructors, and composed with ``compose`` / ``self_compose``.

* Gaussian, Poisson-subsampled Gaussian: ``from_gaussian_mechanism`` (both neighbouring
  directions, pessimistic discretisation).
* A mixture of Gaussians (a person of ≤ k records under Poisson sampling, ``privacy/group.py``):
  ``from_mixture_gaussian_mechanism`` (both directions, connect-the-dots, pessimistic) — the
  exact accounting of dp-accounting's ``MixtureOfGaussiansDpEvent``.
* Exponential mechanism, LimitedDomain: the (ε, δ0)-DP canonical pair (the tightest PLD that
  holds for *every* (ε, δ)-DP mechanism).
* Their Poisson subsampling: the subsampled canonical pair, remove = (qP + (1−q)Q ‖ Q) and
  add = (Q ‖ qP + (1−q)Q), through ``from_two_probability_mass_functions``.
* Parallel parts nested inside a composition are composed sequentially (an upper bound); at the
  top level the accountant takes the maximum over parts instead.

Returns ``None`` for an event shape it cannot represent; the accountant then falls back to RDP.
A ``RepeatAndSelectEvent`` (best of K trials, Papernot & Steinke) has no PLD here at all:
``pld_of_event`` raises ``NotImplementedError`` for it (its bound is an RDP statement), and
``pld_for`` turns that refusal into ``None`` so ``spend`` states the RDP bound alone.
"""

from __future__ import annotations

import math
import numbers
import threading
from functools import lru_cache

import numpy as np
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.pld import privacy_loss_mechanism as plm

from . import events as ev
from .rdp import pure_epsilon

DISCRETIZATION = 1e-4
# Gaussian PLDs use connect-the-dots, which is exact at the grid points: a 2e-4 grid changes
# ε in the 5th digit and halves the time of long DP-SGD runs (bench/RESULTS.md).
GAUSSIAN_DISCRETIZATION = 2e-4


def _canonical_pair(epsilon: float, delta: float) -> tuple[list[float], list[float]]:
    """Dominating pair (P, Q) of every (ε, δ)-DP mechanism, on outcomes 0..3."""
    a = (1.0 - delta) * math.exp(epsilon) / (1.0 + math.exp(epsilon))
    b = (1.0 - delta) / (1.0 + math.exp(epsilon))
    return [delta, a, b, 0.0], [0.0, b, a, delta]


def _log_pmf(probs: list[float]) -> dict[int, float]:
    return {i: math.log(p) for i, p in enumerate(probs) if p > 0}


def subsampled_approx_dp_pld(epsilon: float, delta: float, q: float, discretization: float):
    p, qq = _canonical_pair(epsilon, delta)
    mixture = [q * pi + (1.0 - q) * qi for pi, qi in zip(p, qq)]
    return pld_lib.from_two_probability_mass_functions(
        log_probability_mass_function_lower=_log_pmf(qq),
        log_probability_mass_function_upper=_log_pmf(mixture),
        pessimistic_estimate=True,
        value_discretization_interval=discretization,
        symmetric=False,
    )


class _VectorisedMixtureLoss(plm.MixtureGaussianPrivacyLoss):
    """dp-accounting's mixture-of-Gaussians privacy loss with its inverse computed by one
    vectorised bisection instead of a recursion over every grid point (0.6.0 spends ~30 s per
    mixture there). The same bisection, step for step: every loss starts from the same bracket and
    halves it until it is at most ``precision`` wide, keeping the upper half when the loss at the
    midpoint is above it (the privacy loss decreases in x), and returns the upper end rounded down
    to a multiple of ``precision`` — the library's answer (``tests/accounting/test_group_exact.py`` compares
    the two PLDs)."""

    def _inverse_privacy_losses_with_range(self, privacy_losses, bounds, precision=1e-6):
        losses = np.asarray(privacy_losses, dtype=float)
        if len(losses) == 0:
            return []
        lo = np.full_like(losses, bounds[0])
        hi = np.full_like(losses, bounds[1])
        width = bounds[1] - bounds[0]
        while width > precision:
            mid = (lo + hi) / 2
            split = self._losses_at_runs(mid)
            lower = losses < split
            lo = np.where(lower, mid, lo)
            hi = np.where(lower, hi, mid)
            width = width / 2
        return np.floor(hi / precision) * precision

    def get_delta_for_epsilon(self, epsilon):
        """The library's method, with its final Python loop (each δ raised to the next one's, a
        running maximum from the right over ~10⁶ grid points) as one ``maximum.accumulate``:
        the same values, exactly (a maximum rounds nothing)."""
        if isinstance(epsilon, numbers.Number):
            return super().get_delta_for_epsilon(epsilon)
        epsilons = np.atleast_1d(epsilon)
        if not np.all(epsilons[1:] >= epsilons[:-1]):
            raise ValueError(f"Epsilon values must be non-decreasing: {epsilons}")
        deltas = np.zeros_like(epsilons, dtype=float)
        if self._sampling_prob == 1.0:
            inverse_indices = np.full_like(epsilons, True, dtype=bool)
        elif self.adjacency_type == plm.AdjacencyType.ADD:
            inverse_indices = epsilons < -np.log1p(-self._sampling_prob)
        elif self.adjacency_type == plm.AdjacencyType.REMOVE:
            inverse_indices = epsilons > np.log1p(-self._sampling_prob)
            other_indices = np.logical_not(inverse_indices)
            deltas[other_indices] = -np.expm1(epsilons[other_indices])
        else:
            raise ValueError(f"{self.adjacency_type} adjacency type is not supported.")
        x_cutoffs = self.inverse_privacy_losses(epsilons[inverse_indices])
        deltas[inverse_indices] = self.mu_upper_cdf(x_cutoffs) - np.exp(
            epsilons[inverse_indices] + self.mu_lower_log_cdf(x_cutoffs))
        deltas = np.clip(deltas, 0, 1)
        return np.maximum.accumulate(deltas[::-1])[::-1].copy()

    def _losses_at_runs(self, x: np.ndarray) -> np.ndarray:
        """:meth:`_losses_at` of ``x``, evaluated once per run of equal neighbours: the grid's
        losses come sorted and their inverse is monotone, so every point of a bracket still shared
        has the same midpoint — the first passes have a few distinct ones among a million points.
        Element-wise, so each point's value is the one a full evaluation gives, bit for bit."""
        if len(x) < 2:
            return self._losses_at(x)
        starts = np.flatnonzero(np.concatenate(([True], x[1:] != x[:-1])))
        if len(starts) > len(x) // 2:
            return self._losses_at(x)
        return np.repeat(self._losses_at(x[starts]), np.diff(np.append(starts, len(x))))

    def _losses_at(self, x: np.ndarray) -> np.ndarray:
        """``privacy_loss`` at each point of ``x``: the library's formula, its ``logaddexp.reduce``
        over the mixture's components written as the same left fold one component at a time
        (the same operations in the same order, so the same bits; a row-wise reduce over k + 1
        components is ~20× slower at k = 20)."""
        add = self.adjacency_type == plm.AdjacencyType.ADD
        acc = None
        for c, s in zip(self._precompute_privacy_loss_constants, np.asarray(self.sensitivities)):
            term = c + s * x / self._variance if add else c - s * x / self._variance
            acc = term if acc is None else np.logaddexp(acc, term)
        return -acc if add else acc


class _VectorisedGaussianLoss(plm.GaussianPrivacyLoss):
    """dp-accounting's (Poisson-subsampled) Gaussian privacy loss with the hockey-stick divergence
    over a grid of ε computed along an axis: 0.6.0 inverts the privacy loss once per grid point in
    Python (~0.35 s per subsampled Gaussian at a 1e-3 grid, 5× that at 2e-4, the cost of every
    DP-SGD calibration). The library's formulas, operation for operation —
    ``get_delta_for_epsilon`` with ``_inverse_privacy_loss_{add,remove}`` and
    ``common.log_a_times_exp_b_plus_c`` written on arrays (tests/accounting/test_pld_vectorised.py
    compares the two PLDs)."""

    def get_delta_for_epsilon(self, epsilon):
        q = self.sampling_prob
        if q == 1.0 or self.adjacency_type == plm.AdjacencyType.REPLACE:
            return super().get_delta_for_epsilon(epsilon)  # no per-point inversion to save
        is_scalar = isinstance(epsilon, numbers.Number)
        epsilons = np.array([epsilon]) if is_scalar else np.asarray(epsilon)
        deltas = np.zeros_like(epsilons, dtype=float)
        if self.adjacency_type == plm.AdjacencyType.ADD:
            inverse = epsilons < -math.log1p(-q)
        elif self.adjacency_type == plm.AdjacencyType.REMOVE:
            inverse = epsilons > math.log1p(-q)
            other = np.logical_not(inverse)
            deltas[other] = -np.expm1(epsilons[other])
        else:
            raise ValueError(f"{self.adjacency_type} adjacency type is not supported.")
        chosen = epsilons[inverse]
        x = self._inverse_losses(chosen)
        deltas[inverse] = self.mu_upper_cdf(x) - np.exp(chosen + self.mu_lower_log_cdf(x))
        deltas = np.clip(deltas, 0, 1)
        return float(deltas[0]) if is_scalar else deltas

    def _inverse_losses(self, losses: np.ndarray) -> np.ndarray:
        """``inverse_privacy_loss`` at each privacy loss (q < 1, ADD or REMOVE)."""
        q = self.sampling_prob
        add = self.adjacency_type == plm.AdjacencyType.ADD
        edge = -math.log(1 - q) if add else math.log(1 - q)
        b = -losses if add else losses
        a, c = 1 / q, 1 - 1 / q  # log(a·e^b + c): a > 0, c < 0 (q < 1)
        d = b + np.log(a)
        with np.errstate(invalid="ignore", divide="ignore"):
            without = np.where(b == 0, np.log(a + c), d + np.log1p(-np.exp(np.log(-c) - d)))
        without = -without if add else without
        scale = self._standard_deviation ** 2 / self.sensitivity
        x = -0.5 * self.sensitivity - without * scale  # _inverse_privacy_loss_without_subsampling_remove
        if add:
            x = self.sensitivity + x
        close = np.abs(losses - edge) <= 1e-9 * np.maximum(np.abs(losses), abs(edge))  # math.isclose
        at_edge = -math.inf if add else math.inf  # the inverse at a loss of ±∞ without subsampling
        return np.where(close, at_edge, x)


def gaussian_pld(sigma: float, sampling_prob: float, discretization: float):
    """``pld_lib.from_gaussian_mechanism(sigma, sampling_prob=…)`` (connect-the-dots, pessimistic,
    both directions) with the vectorised divergence above."""
    def one(adjacency):
        loss = _VectorisedGaussianLoss(sigma, sensitivity=1, pessimistic_estimate=True, log_mass_truncation_bound=-50,
                                       sampling_prob=sampling_prob, adjacency_type=adjacency)
        return pld_lib._create_pld_pmf_from_monotone_privacy_loss(  # noqa: SLF001 (the library's own builder)
            loss, pessimistic_estimate=True, value_discretization_interval=discretization, use_connect_dots=True)

    return pld_lib._pld_for_subsampled_mechanism(one, sampling_prob)  # noqa: SLF001


def mixture_gaussian_pld(sigma: float, sensitivities, sampling_probs, discretization: float):
    """``pld_lib.from_mixture_gaussian_mechanism`` (connect-the-dots, pessimistic, both
    directions) with the vectorised inverse above."""
    def one(adjacency):
        loss = _VectorisedMixtureLoss(sigma, list(sensitivities), list(sampling_probs), pessimistic_estimate=True,
                                      adjacency_type=adjacency)
        return pld_lib._create_pld_pmf_from_monotone_privacy_loss(  # noqa: SLF001 (the library's own builder)
            loss, pessimistic_estimate=True, value_discretization_interval=discretization, use_connect_dots=True)

    return pld_lib.PrivacyLossDistribution(one(plm.AdjacencyType.REMOVE), one(plm.AdjacencyType.ADD))


def _approx_dp_params(event) -> tuple[float, float] | None:
    if isinstance(event, ev.ExponentialEvent):
        return pure_epsilon(event), 0.0
    if isinstance(event, ev.LimitedDomainEvent):
        return pure_epsilon(event), event.delta0
    return None


@lru_cache(maxsize=256)
def pld_of_event(event: ev.DpEvent, discretization: float = DISCRETIZATION):
    """dp-accounting ``PrivacyLossDistribution`` of an event, or None if not representable."""
    if isinstance(event, ev.GaussianEvent):
        return pld_lib.from_gaussian_mechanism(
            event.noise_multiplier, value_discretization_interval=discretization)
    if isinstance(event, ev.MixtureOfGaussiansEvent):
        return mixture_gaussian_pld(event.noise_multiplier, event.sensitivities, event.sampling_probs, discretization)
    params = _approx_dp_params(event)
    if params is not None:
        return pld_lib.from_privacy_parameters(
            pld_common.DifferentialPrivacyParameters(*params), value_discretization_interval=discretization)
    if isinstance(event, ev.PoissonSampledEvent):
        q, inner = event.sampling_probability, event.event
        if isinstance(inner, ev.GaussianEvent):
            return gaussian_pld(inner.noise_multiplier, q, discretization)
        params = _approx_dp_params(inner)
        if params is not None:
            return subsampled_approx_dp_pld(params[0], params[1], q, discretization)
        return None
    if isinstance(event, ev.SelfComposedEvent):
        if event.count == 0:
            return pld_lib.identity(value_discretization_interval=discretization)
        inner = pld_of_event(event.event, discretization)
        return None if inner is None else inner.self_compose(event.count)
    if isinstance(event, ev.RepeatAndSelectEvent):
        raise NotImplementedError(
            "the PLD accountant cannot express a RepeatAndSelectEvent (best of K trials): its "
            "privacy is the RDP bound of Papernot & Steinke (2022), see privacy/selection.py")
    if isinstance(event, (ev.ComposedEvent, ev.ParallelEvent)):
        return _fold(type(event), event.events, discretization)
    raise TypeError(f"not a privacy event: {event!r}")


# Folds of compositions computed in this process: (kind, events, grid) -> PLD. A ledger composes
# its dataset's entries again and again with one event more or one changed at the end (the check
# before a run, its reservation, its commit); each fold starts from the longest one kept here
# whose events are a prefix, so it does the same compositions in the same order as from the
# start, and its PLD is the same (issue 29). Bounded: a PLD on a fine grid takes megabytes.
_FOLDS: dict[tuple, object] = {}
_FOLDS_KEPT = 16
_FOLDS_LOCK = threading.Lock()  # the bookkeeping only; compositions run outside it


def _fold(kind: type, events: tuple, discretization: float):
    """``identity ∘ pld(e1) ∘ pld(e2) ∘ …`` (left to right), or None if a part has no PLD."""
    total, start = None, 0
    with _FOLDS_LOCK:
        lengths = sorted({len(key[1]) for key in _FOLDS if key[0] is kind and key[2] == discretization
                          and len(key[1]) <= len(events)}, reverse=True)
        for k in lengths:
            total = _FOLDS.get((kind, events[:k], discretization))
            if total is not None:
                start = k
                break
    if total is None:
        total = pld_lib.identity(value_discretization_interval=discretization)
    for e in events[start:]:
        part = pld_of_event(e, discretization)
        if part is None:
            return None
        total = total.compose(part)
    if start < len(events):
        with _FOLDS_LOCK:
            while len(_FOLDS) >= _FOLDS_KEPT:
                _FOLDS.pop(next(iter(_FOLDS)))
            _FOLDS[(kind, events, discretization)] = total
    return total


def clear_caches() -> None:
    """Forget every PLD computed in this process (benchmarks, tests)."""
    pld_of_event.cache_clear()
    with _FOLDS_LOCK:
        _FOLDS.clear()


_GAUSSIAN_TREE = (ev.GaussianEvent, ev.MixtureOfGaussiansEvent, ev.PoissonSampledEvent, ev.SelfComposedEvent, ev.ComposedEvent, ev.ParallelEvent)


def _only_gaussian(event: ev.DpEvent) -> bool:
    """Gaussian mechanisms under sampling and composition only (a leaf of these is a Gaussian)."""
    return all(isinstance(e, _GAUSSIAN_TREE) for e in ev.all_events(event))


def _has_selection(event: ev.DpEvent) -> bool:
    return any(isinstance(e, ev.RepeatAndSelectEvent) for e in ev.all_events(event))


def pld_for(event: ev.DpEvent, discretization: float = DISCRETIZATION):
    """PLD of an event on one grid (PLDs on different grids do not compose): Gaussian-only
    events use the coarser ``GAUSSIAN_DISCRETIZATION`` when it is coarser than asked."""
    if _has_selection(event):
        return None  # pld_of_event refuses it (NotImplementedError); the accountant states RDP
    grid = max(discretization, GAUSSIAN_DISCRETIZATION) if _only_gaussian(event) else discretization
    return pld_of_event(event, grid)
