"""Group privacy of a declarative event: what a record-level mechanism costs one person who
contributes at most ``k`` records (add/remove neighbouring datasets throughout).

``group_event(event, k)`` returns an ordinary event (the ledger composes it like any other) whose
accountant answer bounds the hockey-stick divergence between datasets that differ by one person:
``GaussianEvent(σ)`` → ``GaussianEvent(σ/k)`` (exact); a Poisson-subsampled Gaussian → the exact
mixture of Gaussians over Binomial(k, q) shifts (rule ``exact_mixture``); any other
Poisson-subsampled M → subsampling at 1 − (1 − q)^k of group(M, k) (rule ``conservative_map``, a
valid bound); a composition → the composition of the grouped parts; a ``ParallelEvent`` → their
composition. Anything else is refused with :class:`GroupPrivacyError`, never charged a guess.

The proof of each rule: docs/privacy-claims.md, "Group privacy of an event".
numpy/scipy/dp-accounting only (here: math), like the rest of ``privacy/``.
"""

from __future__ import annotations

import math

from . import events as ev


class GroupPrivacyError(ValueError):
    """An event for which no group-privacy rule is proven here: it cannot be charged per person."""


def grouped_rate(q: float, k: int) -> float:
    """1 − (1 − q)^k: the probability that at least one of k records, each sampled independently
    with probability q, is sampled (computed without cancellation)."""
    if q >= 1.0:
        return 1.0
    return float(min(1.0, -math.expm1(k * math.log1p(-q))))


def group_event(event: ev.DpEvent, k: int) -> ev.DpEvent:
    """The event of ``event`` for a group of at most ``k`` records (one person with ≤ k records):
    see the module docstring for each rule and its proof. ``k = 1`` returns an event with the
    same accountant answer (parallel parts become composed: never cheaper)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"a group size must be an integer >= 1, got {k!r}")
    return _group(event, k)


EXACT_MIXTURE = "exact_mixture"
CONSERVATIVE_MAP = "conservative_map"


def group_accounting(event: ev.DpEvent) -> str:
    """Which rule charged the Poisson-subsampled parts of a group event (the run record's
    ``privacy.group_accounting``): ``exact_mixture`` when every one is a mixture of Gaussians
    (and none a conservatively mapped subsampled event), ``conservative_map`` when every one was
    mapped, ``exact_mixture+conservative_map`` when both occur; ``exact`` for an event without
    subsampling (a Gaussian's σ/k is exact)."""
    parts = list(ev.all_events(event))
    mixture = any(isinstance(e, ev.MixtureOfGaussiansEvent) for e in parts)
    mapped = any(isinstance(e, ev.PoissonSampledEvent) for e in parts)
    if mixture and mapped:
        return f"{EXACT_MIXTURE}+{CONSERVATIVE_MAP}"
    return EXACT_MIXTURE if mixture else CONSERVATIVE_MAP if mapped else "exact"


def _group(event: ev.DpEvent, k: int) -> ev.DpEvent:
    if isinstance(event, ev.GaussianEvent):
        return ev.GaussianEvent(event.noise_multiplier / k)
    if isinstance(event, ev.PoissonSampledEvent) and isinstance(event.event, ev.GaussianEvent):
        return ev.binomial_mixture(event.sampling_probability, event.event.noise_multiplier, k)
    if isinstance(event, ev.PoissonSampledEvent):
        return ev.PoissonSampledEvent(grouped_rate(event.sampling_probability, k), _group(event.event, k))
    if isinstance(event, ev.SelfComposedEvent):
        return ev.SelfComposedEvent(_group(event.event, k), event.count)
    if isinstance(event, (ev.ComposedEvent, ev.ParallelEvent)):
        return ev.ComposedEvent(tuple(_group(e, k) for e in event.events))
    if isinstance(event, ev.AdaptiveEvent):  # group privacy of each part; basic composition still splits them
        return ev.AdaptiveEvent(_group(event.first, k), _group(event.then, k), event.first_delta_share)
    raise GroupPrivacyError(
        f"no group-privacy rule for a {type(event).__name__} event: a record-level run with it cannot be charged per person "
        "(use a unit-level run: data.privacy_unit naming the person's field)")
