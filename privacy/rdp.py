"""Rényi-DP curves of the privacy events, composed and converted to (ε, δ).

This is the independent cross-check of the PLD accountant and the path on which DP-OPT's
published accounting is reproduced. Everything is a function of an array of orders α.

Sources, next to the formulas below:
* Gaussian and Poisson-subsampled Gaussian: Mironov, Talwar, Zhang (2019), "Rényi Differential
  Privacy of the Sampled Gaussian Mechanism", integer and fractional orders (the same series that
  Opacus and TF-Privacy evaluate).
* Exponential mechanism: Bun & Steinke (2016) Remark 3.4 and the bounded-range bound, as DP-OPT's
  reference accountant (autodp-based) evaluates them.
* Poisson subsampling of any other mechanism: the general upper bound of Zhu & Wang (2019),
  in the form autodp evaluates it (``compose_poisson_subsampled_mechanisms1``), at integer orders,
  with linear interpolation of the cumulant (which is convex in α) in between.
* Approximate RDP (LimitedDomain's δ0): the δ-parts add under composition; Poisson sampling maps
  (RDP, δ0) to (RDP subsampled at q(1−δ0)/(1−qδ0), q·δ0), as in DP-OPT's accountant.
* Best of K trials, K random (private selection): Papernot & Steinke (2022), Theorems 2 and 6,
  evaluated here (``repeat_and_select_rdp``) as derived in ``selection.py``.
* Conversion to (ε, δ): Balle et al. (2020) / Bun et al. "BBGHS" Theorem 21, the one Opacus uses.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Callable, Sequence, Union

import numpy as np
from scipy import special

from . import calibrate
from . import events as ev
from .trials import PoissonTrials, TrialCount, TruncatedNegativeBinomial, trial_count_distribution

# Fractional orders near 1 matter for small ε; large integer orders for tiny δ or pure-DP-like
# mechanisms. A superset of Opacus's default orders.
DEFAULT_ORDERS: tuple[float, ...] = tuple(
    sorted(set([1.0 + x / 10.0 for x in range(1, 100)] + [float(a) for a in range(11, 257)]
               + [320.0, 384.0, 512.0, 768.0, 1024.0]))
)


# ---- small numerics ------------------------------------------------------------------------

def _log_add(a: float, b: float) -> float:
    if a == -np.inf:
        return b
    if b == -np.inf:
        return a
    m = max(a, b)
    return m + math.log1p(math.exp(-abs(a - b)))


def _log_sub(a: float, b: float) -> float:
    """log(exp(a) - exp(b)), a >= b."""
    if b == -np.inf:
        return a
    if a == b:
        return -np.inf
    if a < b:
        raise ValueError("log_sub: a < b")
    return a + math.log1p(-math.exp(b - a))


def _log_erfc(x: float) -> float:
    # erfc(x) = 2 Φ(-x √2)
    return math.log(2.0) + float(special.log_ndtr(-x * math.sqrt(2.0)))


def _logcomb(n, k):
    return special.gammaln(n + 1) - special.gammaln(k + 1) - special.gammaln(n - k + 1)


# ---- Gaussian --------------------------------------------------------------------------------

def gaussian_rdp(noise_multiplier: float, orders) -> np.ndarray:
    orders = np.asarray(orders, dtype=float)
    return orders / (2.0 * noise_multiplier**2)


def _logsumexp(terms: np.ndarray) -> float:
    """log Σ exp(terms) of a 1-d array, by the steps of scipy's ``special.logsumexp`` (≥ 1.15: the
    largest term kept out of the sum, ``log1p(Σ_rest exp(t − max) / count_max) + log(count_max) +
    max``) without its array-API dispatch, which cost more than the sum on the ~250 short arrays of
    each noise multiplier's RDP curve (same numbers: tests/accounting/test_accountant.py)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        a_max = terms.max()
        at_max = terms == a_max
        count = at_max.sum(dtype=float)
        s = np.exp(np.where(at_max, -np.inf, terms) - a_max).sum()
        if s != 0:
            s = s / count
        out = np.log1p(s) + np.log(count) + a_max
        if not np.isfinite(out):  # as scipy: an infinite sum is the direct one's
            out = np.log(np.exp(terms).sum())
    return float(out)


def _log_a_int_parts(alpha: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(i, log C(α, i), α − i, i² − i) for i = 0..α: the parts of the integer-order series that do
    not depend on q or σ, computed once per order (every σ a calibration tries asks for them)."""
    i = np.arange(alpha + 1, dtype=float)
    parts = (i, _logcomb(alpha, i), alpha - i, i * i - i)
    for p in parts:
        p.flags.writeable = False
    return parts


_log_a_int_parts = lru_cache(maxsize=2048)(_log_a_int_parts)


def _sampled_gaussian_log_a_int(q: float, sigma: float, alpha: int) -> float:
    i, log_comb, rest, quad = _log_a_int_parts(alpha)
    terms = log_comb + i * math.log(q) + rest * math.log1p(-q) + quad / (2.0 * sigma**2)
    return _logsumexp(terms)


def _sampled_gaussian_log_a_frac(q: float, sigma: float, alpha: float) -> float:
    # Mironov et al. (2019), Section 3.3: two convergent series, summed term by term in order
    # (i = 0, 1, …) until both terms fall below e^-30. The terms' special functions (binomial
    # coefficient, log Φ) are evaluated a block of i at a time as arrays — the same ufunc loops
    # and the same IEEE arithmetic as one i at a time, so every term and the sum are the same,
    # bit for bit, as the scalar loop; only the running log-sum stays a Python loop (its
    # floating-point order is the answer's; ``_log_add`` and ``_log_sub`` written inline). The
    # block grows, so a short series computes little.
    neg_inf = -math.inf
    log_a0, log_a1 = neg_inf, neg_inf
    z0 = sigma**2 * math.log(1.0 / q - 1.0) + 0.5
    log_q, log_1mq = math.log(q), math.log1p(-q)
    two_var = 2.0 * sigma**2
    scale = math.sqrt(2.0) * sigma
    sqrt2, log2, log_half = math.sqrt(2.0), math.log(2.0), math.log(0.5)
    log, log1p, exp = math.log, math.log1p, math.exp
    start, block = 0, 128
    while True:
        i = np.arange(start, start + block, dtype=float)
        coef = special.binom(alpha, i).tolist()
        j = alpha - i
        # (a zero coefficient — only at an integer α, which has its own series — is math.log's
        # domain error when the sum reaches it, as it was)
        log_coef = np.array([log(abs(c)) if c else neg_inf for c in coef])
        with np.errstate(all="ignore"):  # IEEE results, silent, as Python's float arithmetic
            log_t0 = log_coef + i * log_q + j * log_1mq
            log_t1 = log_coef + j * log_q + i * log_1mq
            log_e0 = log_half + (log2 + special.log_ndtr(-((i - z0) / scale) * sqrt2))
            log_e1 = log_half + (log2 + special.log_ndtr(-((z0 - j) / scale) * sqrt2))
            log_s0 = (log_t0 + (i * i - i) / two_var + log_e0).tolist()
            log_s1 = (log_t1 + (j * j - j) / two_var + log_e1).tolist()
        for k, c in enumerate(coef):
            if not c:
                raise ValueError("math domain error")
            s0, s1 = log_s0[k], log_s1[k]
            if c > 0:  # log_a ← _log_add(log_a, s)
                if log_a0 == neg_inf:
                    log_a0 = s0
                elif s0 != neg_inf:
                    log_a0 = (s0 if s0 > log_a0 else log_a0) + log1p(exp(-abs(log_a0 - s0)))
                if log_a1 == neg_inf:
                    log_a1 = s1
                elif s1 != neg_inf:
                    log_a1 = (s1 if s1 > log_a1 else log_a1) + log1p(exp(-abs(log_a1 - s1)))
            else:  # log_a ← _log_sub(log_a, s)
                if s0 != neg_inf:
                    if log_a0 == s0:
                        log_a0 = neg_inf
                    elif log_a0 < s0:
                        raise ValueError("log_sub: a < b")
                    else:
                        log_a0 = log_a0 + log1p(-exp(s0 - log_a0))
                if s1 != neg_inf:
                    if log_a1 == s1:
                        log_a1 = neg_inf
                    elif log_a1 < s1:
                        raise ValueError("log_sub: a < b")
                    else:
                        log_a1 = log_a1 + log1p(-exp(s1 - log_a1))
            if (s1 if s1 > s0 else s0) < -30 or start + k + 1 > 100_000:  # max(s0, s1), NaN included
                return _log_add(log_a0, log_a1)
        start += block
        block = min(2 * block, 8192)


@lru_cache(maxsize=4096)
def _sampled_gaussian_rdp_one(q: float, sigma: float, alpha: float) -> float:
    if q == 1.0:
        return alpha / (2.0 * sigma**2)
    if float(alpha).is_integer():
        log_a = _sampled_gaussian_log_a_int(q, sigma, int(alpha))
    else:
        log_a = _sampled_gaussian_log_a_frac(q, sigma, alpha)
    return max(log_a, 0.0) / (alpha - 1.0)


def sampled_gaussian_rdp(q: float, noise_multiplier: float, orders) -> np.ndarray:
    return np.array([_sampled_gaussian_rdp_one(float(q), float(noise_multiplier), float(a)) for a in orders])


# ---- exponential mechanism -------------------------------------------------------------------

def _log_sinh(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=float)
    return x + np.log1p(-np.exp(-2.0 * x)) - math.log(2.0)


def exponential_rdp(epsilon: float, orders, monotone: bool = False) -> np.ndarray:
    """RDP of an ε-DP exponential mechanism (see ``events.ExponentialEvent`` for its sampling).

    General: min(α ε²/2, log[(sinh(αε) − sinh((α−1)ε)) / sinh(ε)] / (α−1), ε) — the RDP of a
    pure ε-DP mechanism (Bun & Steinke 2016) and a zCDP bound, exactly as DP-OPT's reference
    accountant evaluates it (its numbers are reproduced on this path).
    Monotone: the two-point bound of the reference's monotone case (Bun & Steinke 2016,
    Remark 3.4), capped by the bounded-range zCDP bound α ε²/8 and by ε.
    """
    a = np.asarray(orders, dtype=float)
    e = float(epsilon)
    if not monotone:
        # log(sinh(a e) - sinh((a-1) e)) computed stably
        big = a * e
        small = (a - 1.0) * e
        log_diff = _log_sinh(big) + np.log1p(-np.exp(_log_sinh(small) - _log_sinh(big)))
        exact = (log_diff - _log_sinh(np.array(e))) / (a - 1.0)
        return np.minimum(np.minimum(a * e * e / 2.0, exact), e)
    # monotone (DP-OPT reference form)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        enegt = ((a - 1.0) * np.expm1(a * e)) / (a * (np.exp(a * e) - np.exp(e)))
        t = np.log(1.0 / enegt)
        num = (np.exp(a * (e - t)) - np.exp(-a * t)
               - (np.exp(a * e - (a + 1.0) * t) - np.exp(e - (a + 1.0) * t)))
        den = np.exp(e - t) - np.exp(-t)
        exact = np.log(num / den) / (a - 1.0)
    exact = np.where(np.isfinite(exact), exact, e)
    return np.minimum(np.minimum(exact, a * e * e / 8.0), e)


# ---- Poisson subsampling of a general mechanism ----------------------------------------------

def _poisson_general_cgf_int(q: float, base_rdp_int: np.ndarray, alpha: int) -> float:
    """Zhu & Wang (2019) general upper bound on the cumulant (α−1)·RDP at integer α ≥ 2.

    ``base_rdp_int[j]`` is the base mechanism's RDP at order j. For j ≥ 3 the paper's term is
    3·e^{(j−1)ε(j)}; autodp (and so DP-OPT's published numbers) uses e^{j·ε(j+1)}. We take the
    larger of the two for each j, so the bound holds under either reading and reproduces the
    reference wherever its term dominates (it does at DP-OPT's settings)."""
    if q == 1.0:
        return (alpha - 1) * base_rdp_int[alpha]
    lq, l1q = math.log(q), math.log1p(-q)
    terms = [(alpha - 1) * l1q + math.log1p((alpha - 1) * q),
             _logcomb(alpha, 2) + 2 * lq + (alpha - 2) * l1q + base_rdp_int[2]]
    if alpha >= 3:
        j = np.arange(3, alpha + 1)
        moment = np.maximum(j * base_rdp_int[j + 1], math.log(3.0) + (j - 1) * base_rdp_int[j])
        terms.extend(_logcomb(alpha, j) + j * lq + (alpha - j) * l1q + moment)
    return float(special.logsumexp(terms))


def poisson_subsampled_rdp(q: float, base_rdp, base_pure_epsilon: float, orders) -> np.ndarray:
    """RDP of ``base`` on a Poisson subsample with rate q, for any base mechanism.

    ``base_rdp(order_array)`` evaluates the base RDP. Integer orders use the general bound;
    fractional orders interpolate the cumulant linearly between neighbouring integers (valid:
    the cumulant of the privacy loss is convex in α). Capped by the pure-DP amplification
    log(1 + q(e^ε − 1)).
    """
    orders = np.asarray(orders, dtype=float)
    amax = int(math.ceil(orders.max()))
    ints = np.arange(0, amax + 2, dtype=float)
    base = np.full(amax + 2, np.inf)
    base[2:] = base_rdp(ints[2:])
    cgf = {a: _poisson_general_cgf_int(q, base, a) for a in range(2, amax + 1)}
    eps_inf = math.log1p(q * math.expm1(base_pure_epsilon)) if math.isfinite(base_pure_epsilon) else np.inf
    out = np.empty_like(orders)
    for i, a in enumerate(orders):
        if a <= 2.0:
            val = cgf[2]  # RDP is non-decreasing in α: order 2 bounds every order in (1, 2]
        elif float(a).is_integer():
            val = cgf[int(a)] / (a - 1.0)
        else:
            lo, hi = math.floor(a), math.ceil(a)
            val = ((a - lo) * cgf[hi] + (hi - a) * cgf[lo]) / (a - 1.0)
        out[i] = min(val, eps_inf)
    return out


def mixture_rdp_bound(event: ev.MixtureOfGaussiansEvent, orders) -> np.ndarray:
    """An upper bound on the RDP of a mixture of Gaussians (no exact RDP form here; dp-accounting
    0.6.0's RDP accountant has none either, so its exact ε is the PLD accountant's): the
    Poisson-subsampled Gaussian at rate q' = P(c > 0) and noise σ/c_max. With Q = N(0, σ²) and the
    other side (1 − q')·Q + q'·R, R the mixture of the shifts c > 0, each N(c, σ²) is dominated by
    N(c_max, σ²) in every hockey-stick divergence, both orders; by joint convexity so is R, and the
    subsampling identities of ``privacy/group.py`` carry it to the whole pair: dominance in every
    H_γ, hence in every Rényi divergence. A cross-check only: it is the conservative map."""
    q, c = event.moved_probability, event.max_sensitivity
    if q <= 0.0 or c <= 0.0:
        return np.zeros_like(np.asarray(orders, dtype=float))
    sigma = event.noise_multiplier / c
    if q >= 1.0:
        return gaussian_rdp(sigma, orders)
    return sampled_gaussian_rdp(q, sigma, orders)


# ---- events → (RDP curve, δ-part) ------------------------------------------------------------

def pure_epsilon(event: ev.DpEvent) -> float:
    """Pure-DP ε of an event (inf for Gaussian)."""
    if isinstance(event, (ev.GaussianEvent, ev.MixtureOfGaussiansEvent)):
        return math.inf
    if isinstance(event, (ev.ExponentialEvent, ev.LimitedDomainEvent)):
        return event.epsilon
    if isinstance(event, ev.PoissonSampledEvent):
        inner = pure_epsilon(event.event)
        q = event.sampling_probability
        return math.log1p(q * math.expm1(inner)) if math.isfinite(inner) else math.inf
    if isinstance(event, ev.SelfComposedEvent):
        return event.count * pure_epsilon(event.event) if event.count else 0.0
    if isinstance(event, ev.ComposedEvent):
        return sum(pure_epsilon(e) for e in event.events)
    if isinstance(event, ev.ParallelEvent):
        return max(pure_epsilon(e) for e in event.events)
    if isinstance(event, ev.RepeatAndSelectEvent):
        return math.inf  # no pure-DP bound is claimed for best-of-K (an RDP statement only)
    raise TypeError(f"not a privacy event: {event!r}")


# the curve of each part of a composition, per orders: a plain dict, so a history of hundreds of
# parts is looked up without hashing the orders again for each part
_PART_CURVES: dict[tuple[float, ...], dict] = {}


@lru_cache(maxsize=512)
def _rdp_cached(event: ev.DpEvent, orders: tuple[float, ...]) -> tuple[np.ndarray, float]:
    curve, delta = _rdp(event, np.asarray(orders, dtype=float))
    curve = np.array(curve, dtype=float)
    curve.flags.writeable = False  # shared by every caller: read-only
    return curve, float(delta)


def _orders_key(orders) -> tuple[float, ...]:
    return DEFAULT_ORDERS if orders is DEFAULT_ORDERS else tuple(float(o) for o in orders)  # floats already


@lru_cache(maxsize=8192)
def rdp_is_proven(event: ev.DpEvent) -> bool:
    """False when the event holds a Poisson-subsampled mechanism with a δ-part (LimitedDomain):
    its RDP curve here uses the DP-OPT reference's rule — amplify the pure part at
    q(1−δ0)/(1−qδ0) and add qδ0 — which has no proof for that mechanism (the subsampling theorem
    needs the base mechanism's RDP in both directions, and a LimitedDomain pair is infinitely
    divergent on the tokens one side can return). Such an event's ε is the PLD accountant's alone;
    the RDP number is kept as a cross-check only (privacy/accountant.py)."""
    if isinstance(event, ev.PoissonSampledEvent) and rdp_of_event(event.event, (2.0,))[1] > 0:
        return False
    return all(rdp_is_proven(e) for e in ev.sub_events(event))  # each part remembered


def rdp_of_event(event: ev.DpEvent, orders=DEFAULT_ORDERS) -> tuple[np.ndarray, float]:
    """(RDP at each order, additive δ-part) of an event (the curve read-only)."""
    return _rdp_cached(event, _orders_key(orders))


def _rdp(event: ev.DpEvent, orders: np.ndarray) -> tuple[np.ndarray, float]:
    if isinstance(event, ev.GaussianEvent):
        return gaussian_rdp(event.noise_multiplier, orders), 0.0
    if isinstance(event, ev.MixtureOfGaussiansEvent):
        return mixture_rdp_bound(event, orders), 0.0
    if isinstance(event, ev.ExponentialEvent):
        return exponential_rdp(event.epsilon, orders, event.monotone), 0.0
    if isinstance(event, ev.LimitedDomainEvent):
        return exponential_rdp(event.epsilon, orders, monotone=False), event.delta0
    if isinstance(event, ev.PoissonSampledEvent):
        q, inner = event.sampling_probability, event.event
        if isinstance(inner, ev.GaussianEvent):
            return sampled_gaussian_rdp(q, inner.noise_multiplier, orders), 0.0
        _, inner_delta = rdp_of_event(inner, (2.0,))
        q_eff = q * (1.0 - inner_delta) / (1.0 - q * inner_delta) if inner_delta > 0 else q
        curve = poisson_subsampled_rdp(
            q_eff, lambda o: rdp_of_event(inner, tuple(o))[0], pure_epsilon(inner), orders)
        return curve, q * inner_delta
    if isinstance(event, ev.SelfComposedEvent):
        curve, delta = rdp_of_event(event.event, tuple(orders))
        return event.count * curve, event.count * delta
    if isinstance(event, ev.ComposedEvent):  # a ledger's history: hundreds of parts, most of them alike
        key = tuple(float(o) for o in orders)
        curves = _PART_CURVES.setdefault(key, {})
        if len(curves) > 8192:  # a long-lived worker's many distinct parts: start over
            curves.clear()
        total, delta = np.zeros_like(orders), 0.0
        for e in event.events:
            part = curves.get(e)
            if part is None:
                part = curves[e] = _rdp_cached(e, key)
            total += part[0]
            delta += part[1]
        return total, delta
    if isinstance(event, ev.ParallelEvent):
        parts = [rdp_of_event(e, tuple(orders)) for e in event.events]
        return np.max([c for c, _ in parts], axis=0), max(d for _, d in parts)
    if isinstance(event, ev.RepeatAndSelectEvent):
        return rdp_of_repeat_and_select(event, orders), 0.0
    raise TypeError(f"not a privacy event: {event!r}")


# ---- best of K trials (private selection: Papernot & Steinke 2022) --------------------------
# The theorems, the neighbouring relation and why the bound is RDP only: privacy/selection.py.

TrialRdp = Union[Callable[[np.ndarray], np.ndarray], Sequence[float], np.ndarray]


def _orders_array(orders, name: str = "orders") -> np.ndarray:
    a = np.asarray(orders, dtype=float).ravel()
    if a.size == 0 or not np.all(np.isfinite(a)) or np.any(a <= 1.0):
        raise ValueError(f"{name} must be finite Rényi orders > 1, got {orders!r}")
    return a


def _trial_curve(trial_rdp: TrialRdp, grid: np.ndarray, orders_given) -> np.ndarray:
    if callable(trial_rdp):
        curve = np.asarray(trial_rdp(grid), dtype=float)
    else:
        curve = np.asarray(trial_rdp, dtype=float)
        if orders_given is None:
            raise ValueError("a trial RDP array needs the orders it is evaluated at (trial_orders)")
    if curve.shape != grid.shape:
        raise ValueError(f"trial RDP curve has shape {curve.shape}, expected {grid.shape}")
    if np.any(np.isnan(curve)) or np.any(curve < 0):
        raise ValueError(f"trial RDP values must be >= 0 (or inf), got {curve!r}")
    return curve


def repeat_and_select_rdp(trial_rdp: TrialRdp, distribution: TrialCount, orders=None,
                          trial_orders=None) -> np.ndarray:
    """RDP curve ε'(λ) of publishing the best of K trials, at each of ``orders``.

    ``trial_rdp``: the RDP of ONE trial, either a callable ``f(order_array) -> rdp_array`` (then it
    is evaluated on ``orders`` ∪ ``trial_orders``, default ``rdp.DEFAULT_ORDERS``, the grid over
    which λ̂ is optimised), or an array of its values at ``trial_orders`` (then ``orders`` default
    to ``trial_orders`` and must be among them). ``distribution``: the law of K.
    Theorem 2 / Theorem 6 of Papernot & Steinke, as derived in the docstring of ``privacy/selection.py``.
    """
    if not isinstance(distribution, (TruncatedNegativeBinomial, PoissonTrials)):
        raise TypeError(f"distribution must be TruncatedNegativeBinomial or PoissonTrials, got {distribution!r}")
    if callable(trial_rdp):
        base = DEFAULT_ORDERS if trial_orders is None else trial_orders
        want = _orders_array(base if orders is None else orders)
        grid = np.unique(np.concatenate([_orders_array(base, "trial_orders"), want]))
    else:
        if trial_orders is None:
            raise ValueError("a trial RDP array needs the orders it is evaluated at (trial_orders)")
        grid = _orders_array(trial_orders, "trial_orders")
        want = grid if orders is None else _orders_array(orders)
        if not np.all(np.isin(want, grid)):
            raise ValueError("orders must be among trial_orders when the trial RDP is given as an array")
        order_idx = np.argsort(grid)
        grid, trial_rdp = grid[order_idx], np.asarray(trial_rdp, dtype=float)[order_idx]
    eps = _trial_curve(trial_rdp, grid, trial_orders)

    if isinstance(distribution, TruncatedNegativeBinomial):
        log_inv_gamma = -math.log(distribution.gamma)
        with np.errstate(invalid="ignore"):
            per_hat = (1.0 - 1.0 / grid) * eps + log_inv_gamma / grid
        constant = (1.0 + distribution.eta) * min(log_inv_gamma, float(np.nanmin(per_hat)))
        out = eps + constant + math.log(distribution.mean) / (grid - 1.0)
    else:
        mu = distribution.mu
        if mu < 1.0:
            # below 1 the log(μ) term is negative and the bound can fall below the exact Rényi
            # divergence (tests/accounting/test_selection_privacy.py enumerates a case); dp-accounting also
            # requires a mean of at least 1
            raise ValueError(f"mu must be >= 1 for the Poisson selection bound, got {mu!r}")
        out = np.empty_like(grid)
        for i, lam in enumerate(grid):
            eps_hat = math.log1p(1.0 / (lam - 1.0))
            delta_hat, _ = rdp_to_delta(grid, eps, eps_hat)
            out[i] = eps[i] + mu * delta_hat + math.log(mu) / (lam - 1.0)
    # monotonicity in the order: (λ', ε')-RDP implies (λ, ε')-RDP for λ ≤ λ'
    out = np.minimum.accumulate(out[::-1])[::-1]
    return out[np.searchsorted(grid, want)]


def rdp_of_repeat_and_select(event: ev.RepeatAndSelectEvent, orders: np.ndarray) -> np.ndarray:
    """RDP of a ``RepeatAndSelectEvent`` at ``orders`` (``_rdp`` dispatches here).

    A trial's curve is the maximum over its possible trial events (the candidate is chosen
    independently of the data); trials with a δ-part are refused."""
    for trial in event.trials:
        _, delta_part = rdp_of_event(trial, (2.0,))
        if delta_part > 0:
            raise ValueError(f"the Papernot-Steinke bound needs RDP trials; this trial has a δ-part "
                             f"{delta_part:g} (approximate RDP): {trial!r}")

    def trial_curve(o: np.ndarray) -> np.ndarray:
        key = tuple(float(x) for x in o)
        return np.max([rdp_of_event(t, key)[0] for t in event.trials], axis=0)

    return repeat_and_select_rdp(trial_curve, trial_count_distribution(event), orders=orders)


# ---- conversion ------------------------------------------------------------------------------

def rdp_to_epsilon(orders, rdp, delta: float) -> tuple[float, float]:
    """Smallest ε over the orders at which the curve is (ε, δ)-DP (BBGHS conversion).
    Returns (ε, best order)."""
    a = np.asarray(orders, dtype=float)
    r = np.asarray(rdp, dtype=float)
    if delta <= 0:
        return math.inf, math.nan
    eps = r + np.log1p(-1.0 / a) - (math.log(delta) + np.log(a)) / (a - 1.0)
    eps = np.where(np.isnan(eps), np.inf, eps)
    i = int(np.argmin(eps))
    return max(float(eps[i]), 0.0), float(a[i])


def rdp_to_delta(orders, rdp, epsilon: float) -> tuple[float, float]:
    """Smallest δ over the orders for the given ε (inverse of the BBGHS conversion)."""
    a = np.asarray(orders, dtype=float)
    r = np.asarray(rdp, dtype=float)
    log_delta = (a - 1.0) * (r - epsilon + np.log1p(-1.0 / a)) - np.log(a)
    log_delta = np.where(np.isnan(log_delta), np.inf, log_delta)
    i = int(np.argmin(log_delta))
    return float(min(math.exp(min(log_delta[i], 0.0)), 1.0)), float(a[i])


def gaussian_sigma_for_epsilon(epsilon: float, delta: float) -> float:
    """σ of the Gaussian mechanism (sensitivity 1) that is (ε, δ)-DP by its closed-form RDP curve
    and the conversion above: 60 bisections of [1e-2, 1e3] on a log scale (ε falls as σ grows),
    the upper end returned. Fast and never optimistic (the RDP conversion only over-estimates ε);
    a first guess or a default, not what a ledger charges (the accountant answers that)."""
    orders = np.asarray(DEFAULT_ORDERS, dtype=float)

    def fits(sigma: float) -> bool:
        return not rdp_to_epsilon(orders, gaussian_rdp(sigma, orders), delta)[0] > epsilon

    return calibrate.search(fits, good=1e3, bad=1e-2, good_is_high=True, propose=calibrate.geometric,
                            max_tests=60).good
