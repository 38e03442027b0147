"""Group privacy of a declarative event: what a record-level mechanism costs one person who
contributes at most ``k`` records (add/remove neighbouring datasets throughout).

``group_event(event, k)`` returns an event whose accountant answer bounds, for every ε, the
hockey-stick divergence δ(ε) between the mechanism's outputs on two datasets that differ by one
person — i.e. by at most ``k`` records, all added or all removed together. It is declarative (the
result is an ordinary event, composed by the ledger like any other) and is defined only where a
sound rule is proven below; any other event is refused with :class:`GroupPrivacyError`, never
charged a guess. The rules:

* ``GaussianEvent(σ)`` (a query of L2 sensitivity 1 per record, plus N(0, σ²)) → ``GaussianEvent(σ/k)``.
  k records move the query by at most k (triangle inequality); N(0, σ²) vs N(k, σ²) is, after
  dividing by k, N(0, (σ/k)²) vs N(1, (σ/k)²), and a shift j ≤ k is dominated by the shift k
  (the Gaussian hockey-stick divergence grows with the shift). Exact, not a bound.
  (A Laplace mechanism would be the same rule, b → b/k; the events module has no Laplace event.)
* ``PoissonSampledEvent(q, GaussianEvent(σ))`` (a DP-SGD / DPZero step: clipped per-record
  contributions of norm ≤ 1 summed, plus N(0, σ²)) → ``MixtureOfGaussiansEvent(σ, [0, 1, …, k],
  Binomial(k, q))``: EXACT (rule ``exact_mixture``). J ~ Binomial(k, q) of the person's records are
  in the batch, and they move the sum by a vector of norm ≤ J; the vector-valued mixture is
  dominated by the scalar one with each shift replaced by its norm (Choquette-Choo, Ganesh, Steinke,
  Thakurta 2023, Cor. 4.7) and a larger shift only dominates a smaller one, so the pair
  (N(0, σ²), Σ_j P(J = j)·N(j, σ²)) dominates the person's pair in both directions, and is attained
  when the person's records have aligned gradients (tight: Ganesh 2024, arXiv:2401.10294). Its ε is
  the PLD accountant's (dp-accounting's mixture PLD); the RDP curve of the event is only the
  conservative map below (``rdp.mixture_rdp_bound``), a cross-check the default accountant's
  minimum never prefers over the exact PLD unless it is smaller (and then it is a valid bound too).
* ``PoissonSampledEvent(q, M)`` for any other M (each record in the batch independently with
  probability q) → ``PoissonSampledEvent(1 − (1 − q)^k, group(M, k))`` (rule ``conservative_map``,
  a valid bound, not exact; the review measured it 2–7× above the mixture for Gaussians). Let B be the others' sample and J the
  number of the person's records sampled, J ~ Binomial(k, q). With the person, the output is
  P = (1 − q')·Q + q'·R, where Q = M(B) (none of the person's records sampled, probability
  (1 − q)^k = 1 − q') and R = Σ_{j≥1} P(J = j | J ≥ 1)·M(B ∪ S_j), a mixture. Each pair
  (M(B ∪ S_j), M(B)) is dominated — in every hockey-stick divergence H_γ, γ ≥ 0, both orders — by
  the pair of group(M, j), and that by the pair of group(M, k) (the rules here are monotone in the
  group size). The hockey-stick divergence is jointly convex, so the mixture R is dominated too:
  H_γ(R‖Q) ≤ Σ_j w_j H_γ(M(B ∪ S_j)‖Q) ≤ H_γ(A‖B) for the group(M, k) pair (A, B), and likewise
  H_γ(Q‖R) ≤ H_γ(B‖A). Then for γ ≥ 1, H_γ((1 − q')Q + q'R ‖ Q) = q'·H_{γ'}(R‖Q) with
  γ' = (γ − 1 + q')/q' (the removal direction), and H_γ(Q ‖ (1 − q')Q + q'R) =
  (1 − γ(1 − q'))₊·H_{γ''}(Q‖R) with γ'' = γq'/(1 − γ(1 − q')) (the addition direction): both are
  increasing in the inner divergences, so the person's pair is dominated by the pair of Poisson
  subsampling at rate q' applied to (A, B) — what the accountant computes for the returned event
  (PLD: the hockey-stick curves; RDP: dominance in every H_γ is Blackwell dominance, so every
  Rényi divergence is dominated as well). The person is in the batch with probability q', not q:
  the rate cannot stay q.
* ``SelfComposedEvent(M, n)``, ``ComposedEvent([M₁, …])`` → the same composition of the grouped
  parts: (adaptive) composition of mechanisms each dominated by its grouped pair is dominated by
  the composition of those pairs.
* ``ParallelEvent([M₁, …])`` (parts on disjoint sets of RECORDS) → ``ComposedEvent`` of the grouped
  parts: a person's k records may lie in several parts, so the parts no longer touch the person
  disjointly; composing them is a valid bound (each part sees at most k of the person's records).
  Keeping the parallel maximum would need the parts to be split by person, which an event cannot
  show.
* Anything else — a ``MixtureOfGaussiansEvent`` (already a group's; its records' draws are not
  independent copies of it), ``ExponentialEvent`` (report-noisy-max / argmax), ``LimitedDomainEvent`` (DP-OPT's
  top-1 queries on votes), ``RepeatAndSelectEvent`` (private selection) — is refused: the generic
  group-privacy bound of an (ε, δ) mechanism, (kε, k·e^{(k−1)ε}·δ), is not an event the accountant
  composes, and these mechanisms' per-unit costs belong to their own unit-level variants
  (``data.privacy_unit`` naming the person).

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
    raise GroupPrivacyError(
        f"no group-privacy rule for a {type(event).__name__} event: a record-level run with it cannot be charged per person "
        "(use a unit-level run: data.privacy_unit naming the person's field)")
