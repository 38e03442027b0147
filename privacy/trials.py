"""The secret number of trials K of a private selection: its laws, their sampling, their means.

A selection by random stopping (Papernot & Steinke 2022; ``privacy/selection.py`` states the
procedure and its privacy) runs K trials, K drawn from a law that is part of the mechanism: the
truncated negative binomial D_{η,γ} (η = 1: geometric) or Poisson(μ). The RDP bound of the
selection depends on K's law through these classes (``privacy/rdp.py``, ``repeat_and_select_rdp``),
and K is sampled here from the run's secret DP generator (``privacy.rng``), never from a seed.
Definitions and means: the docstring of ``privacy/selection.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

import numpy as np
from scipy import special

from . import calibrate
from . import events as ev
from .validation import check_count, check_open_interval, check_positive


def _check_rng(rng) -> np.random.Generator:
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator (the run's secret DP stream), got {rng!r}")
    return rng


@dataclass(frozen=True)
class TruncatedNegativeBinomial:
    """D_{η,γ} of Papernot & Steinke (definition in the module docstring), support {1, 2, …}."""

    eta: float
    gamma: float

    def __post_init__(self):
        object.__setattr__(self, "eta", check_open_interval(self.eta, -1.0, math.inf, "eta"))
        object.__setattr__(self, "gamma", check_open_interval(self.gamma, 0.0, 1.0, "gamma"))

    @property
    def name(self) -> str:
        return "truncated_negative_binomial"

    def log_pmf(self, k) -> np.ndarray:
        """log P[K = k] for integer k (−inf off the support k ≥ 1)."""
        k = np.asarray(k, dtype=float)
        eta, gamma = self.eta, self.gamma
        log_1mg = math.log1p(-gamma)
        with np.errstate(invalid="ignore", divide="ignore"):
            if eta == 0.0:
                out = k * log_1mg - np.log(k) - math.log(-math.log(gamma))
            else:
                # Π_{ℓ=0}^{k−1}(ℓ+η) = η·Γ(k+η)/Γ(1+η); its sign is that of η, as is the sign of
                # γ^{−η} − 1, so the ratio is positive and computed from absolute values.
                log_prod = math.log(abs(eta)) + special.gammaln(k + eta) - special.gammaln(1.0 + eta)
                log_norm = math.log(abs(math.expm1(-eta * math.log(gamma))))
                out = k * log_1mg + log_prod - special.gammaln(k + 1.0) - log_norm
        return np.where((k >= 1) & (k == np.floor(k)), out, -np.inf)

    def pmf(self, k) -> np.ndarray:
        return np.exp(self.log_pmf(k))

    @property
    def mean(self) -> float:
        eta, gamma = self.eta, self.gamma
        if eta == 0.0:
            return (1.0 - gamma) / (gamma * -math.log(gamma))
        # η(1−γ) / (γ(1 − γ^η)), with 1 − γ^η = −expm1(η log γ) for accuracy near η = 0
        return eta * (1.0 - gamma) / (gamma * -math.expm1(eta * math.log(gamma)))

    def sample(self, rng: np.random.Generator, size: int | None = None):
        """K (or ``size`` draws of it) by inversion of the CDF, from the caller's generator."""
        return _sample_by_inversion(self.log_pmf, 1, _check_rng(rng), size)


@dataclass(frozen=True)
class PoissonTrials:
    """K ~ Poisson(μ), support {0, 1, …}; K = 0 publishes ⊥ (no winner)."""

    mu: float

    def __post_init__(self):
        object.__setattr__(self, "mu", check_positive(self.mu, "mu"))

    @property
    def name(self) -> str:
        return "poisson"

    def log_pmf(self, k) -> np.ndarray:
        k = np.asarray(k, dtype=float)
        with np.errstate(invalid="ignore"):
            out = k * math.log(self.mu) - self.mu - special.gammaln(k + 1.0)
        return np.where((k >= 0) & (k == np.floor(k)), out, -np.inf)

    def pmf(self, k) -> np.ndarray:
        return np.exp(self.log_pmf(k))

    @property
    def mean(self) -> float:
        return self.mu

    def sample(self, rng: np.random.Generator, size: int | None = None):
        draws = _check_rng(rng).poisson(self.mu, size=size)
        return int(draws) if size is None else draws.astype(int)


TrialCount = Union[TruncatedNegativeBinomial, PoissonTrials]


def _sample_by_inversion(log_pmf, start: int, rng: np.random.Generator, size: int | None):
    n = 1 if size is None else check_count(size, "size", minimum=1)
    u = rng.random(n)
    out = np.empty(n, dtype=int)
    pending = np.arange(n)
    cum, k0, chunk = 0.0, start, 4096
    while pending.size:
        ks = np.arange(k0, k0 + chunk)
        cdf = cum + np.cumsum(np.exp(log_pmf(ks)))
        idx = np.searchsorted(cdf, u[pending], side="left")
        hit = idx < chunk
        out[pending[hit]] = ks[idx[hit]]
        pending = pending[~hit]
        if pending.size and cdf[-1] <= cum:  # the tail underflowed: the remaining mass is < 1e-300
            out[pending] = ks[-1]
            break
        cum, k0 = float(cdf[-1]), k0 + chunk
    return int(out[0]) if size is None else out


def trial_count_distribution(event: ev.RepeatAndSelectEvent) -> TrialCount:
    """The K distribution that a ``RepeatAndSelectEvent`` accounts for (sample K from this)."""
    if event.distribution == "poisson":
        return PoissonTrials(event.mu)
    return TruncatedNegativeBinomial(event.eta, event.gamma)


def gamma_for_mean(eta: float, mean: float, tolerance: float = 1e-12) -> float:
    """The γ of D_{η,γ} with E[K] = ``mean`` (> 1); E[K] decreases in γ, solved by bisection
    (the returned γ's mean is at most the asked one)."""
    eta = check_open_interval(eta, -1.0, math.inf, "eta")
    mean = check_open_interval(mean, 1.0, math.inf, "mean")
    lo, hi = 1e-300, 1.0 - 1e-16
    if TruncatedNegativeBinomial(eta, hi).mean > mean:
        raise ValueError(f"mean={mean!r} is too close to 1 for eta={eta!r}")
    return calibrate.search(lambda g: not TruncatedNegativeBinomial(eta, g).mean > mean, good=hi, bad=lo,
                            good_is_high=True, propose=calibrate.arithmetic,
                            narrow=calibrate.width_within_fraction(tolerance)).good
