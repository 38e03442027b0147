"""Declarative privacy events, in the style of dp-accounting's ``DpEvent``.

An event says *what* a run did with private data (a Gaussian step, a Poisson-subsampled
LimitedDomain query, k repetitions, parts on disjoint data); an accountant says *what it costs*.
Every event is a frozen dataclass that round-trips through JSON (``to_dict`` / ``event_from_dict``),
so a run's spend can be stored in the ledger and composed again later with other runs.

Conventions (add/remove neighbouring datasets throughout):

* ``GaussianEvent(σ)``: sensitivity-1 query plus N(0, σ²) noise.
* ``ExponentialEvent(ε, monotone)``: an ε-DP exponential mechanism on a score of sensitivity Δ:
  sampling ∝ exp(ε·score/(2Δ)) (Gumbel-max with scale 2Δ/ε) in general, ∝ exp(ε·score/Δ)
  (scale Δ/ε) when scores are monotone in the data (adding a record never lowers any score).
* ``LimitedDomainEvent(ε0, δ0)``: one LimitedDomain top-1 query (Durfee & Rogers 2019; DP-OPT
  Algorithm 4) on vote counts: the ε0-DP exponential mechanism above (Gumbel scale 2/ε0) plus the
  failure probability δ0 of the limited domain.

  DP-OPT's reference code draws Gumbel noise of scale 1/ε0 but accounts each query as this
  ε0-DP mechanism; a vote that moves from one token to another changes two counts, so scale 1/ε0
  is only 2ε0-DP and its published ε is not a valid bound for what it samples. We sample with
  the paper's scale 2/ε0 (``privacy.mechanisms``), for which the same accounting is valid.
* ``PoissonSampledEvent(q, e)``: ``e`` run on a Poisson subsample with inclusion probability q.
* ``MixtureOfGaussiansEvent(σ, sensitivities, sampling_probs)``: dp-accounting's
  ``MixtureOfGaussiansDpEvent`` — on one side N(0, σ²), on the other Σ_i p_i·N(c_i, σ²) (the
  sensitivity a random variable, c_i with probability p_i; both neighbouring directions are
  accounted). ``binomial_mixture(q, σ, k)`` is a person of ≤ k records under Poisson sampling at
  rate q: c = 0..k with Binomial(k, q) probabilities (``privacy/group.py``).
* ``SelfComposedEvent(e, k)``, ``ComposedEvent([e1, e2, …])``: sequential composition.
* ``ParallelEvent([e1, e2, …])``: parts that touch disjoint subsets of the data; the cost is the
  largest part's (parallel composition).
* ``AdaptiveEvent(first, then, first_delta_share)``: ``then``'s parameters were chosen from
  ``first``'s output (a run's method and comparison, planned on its released split sizes). A PLD
  composition whose later parameters depend on an earlier output is no proven bound, so the
  accountant charges the two by basic composition, which holds for adaptively chosen mechanisms:
  every ``first`` of a composition together at ``first_delta_share`` of δ, everything else at the
  rest of δ, the two ε added (``split_adaptive``).
* ``RepeatAndSelectEvent(trials, distribution, …)``: private selection / hyperparameter tuning
  (Papernot & Steinke 2022): K ~ truncated negative binomial D_{η,γ} or Poisson(μ) trials, each
  running one of ``trials`` (chosen independently of the data), and only the best trial is
  published. Its cost is an RDP statement (``privacy/selection.py`` derives it); the PLD
  accountant cannot express it and refuses it, so ``spend`` reports the RDP bound alone.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any, Union

import math

from .validation import check_count, check_epsilon, check_open_interval, check_positive, check_rate


@dataclass(frozen=True)
class GaussianEvent:
    noise_multiplier: float

    def __post_init__(self):
        check_positive(self.noise_multiplier, "noise_multiplier")


@dataclass(frozen=True)
class ExponentialEvent:
    epsilon: float
    monotone: bool = False

    def __post_init__(self):
        check_epsilon(self.epsilon, "epsilon")


@dataclass(frozen=True)
class LimitedDomainEvent:
    epsilon: float
    delta0: float

    def __post_init__(self):
        check_epsilon(self.epsilon, "epsilon0")
        if not (0.0 < float(self.delta0) < 1.0):
            raise ValueError(f"delta0 must lie in (0, 1), got {self.delta0!r}")


@dataclass(frozen=True)
class PoissonSampledEvent:
    sampling_probability: float
    event: "DpEvent"

    def __post_init__(self):
        check_rate(self.sampling_probability, "sampling_probability")


@dataclass(frozen=True)
class MixtureOfGaussiansEvent:
    noise_multiplier: float
    sensitivities: tuple
    sampling_probs: tuple

    def __post_init__(self):
        check_positive(self.noise_multiplier, "noise_multiplier")
        sens = tuple(float(c) for c in self.sensitivities)
        probs = tuple(float(p) for p in self.sampling_probs)
        object.__setattr__(self, "sensitivities", sens)
        object.__setattr__(self, "sampling_probs", probs)
        if not sens or len(sens) != len(probs):
            raise ValueError(f"a mixture of Gaussians needs as many sampling_probs as sensitivities (at least one), "
                             f"got {len(sens)} and {len(probs)}")
        if any(not math.isfinite(c) or c < 0 for c in sens):
            raise ValueError(f"sensitivities must be finite and >= 0, got {sens!r}")
        if any(not math.isfinite(p) or p < 0 for p in probs) or abs(sum(probs) - 1.0) > 1e-9:
            raise ValueError(f"sampling_probs must be >= 0 and sum to 1, got {probs!r}")

    @property
    def max_sensitivity(self) -> float:
        return max(c for c, p in zip(self.sensitivities, self.sampling_probs) if p > 0)

    @property
    def moved_probability(self) -> float:
        """P(sensitivity > 0): the probability that the output moves at all."""
        return float(min(1.0, sum(p for c, p in zip(self.sensitivities, self.sampling_probs) if c > 0)))


@dataclass(frozen=True)
class SelfComposedEvent:
    event: "DpEvent"
    count: int

    def __post_init__(self):
        check_count(self.count, "count")


@dataclass(frozen=True)
class ComposedEvent:
    events: tuple = field(default_factory=tuple)

    def __post_init__(self):
        object.__setattr__(self, "events", tuple(self.events))


@dataclass(frozen=True)
class ParallelEvent:
    events: tuple = field(default_factory=tuple)

    def __post_init__(self):
        object.__setattr__(self, "events", tuple(self.events))
        if not self.events:
            raise ValueError("ParallelEvent needs at least one part, got none")


TRIAL_COUNT_DISTRIBUTIONS = ("truncated_negative_binomial", "poisson")


@dataclass(frozen=True)
class RepeatAndSelectEvent:
    """Best of K trials, K random, one winner published (Papernot & Steinke 2022).

    ``trials``: the events of the possible trials (one candidate each: its training plus its DP
    holdout score); each trial runs one of them, picked independently of the data, so a trial's
    RDP is at most the largest of theirs at each order. ``distribution``:
    ``"truncated_negative_binomial"`` with ``eta`` > −1 and ``gamma`` in (0, 1), or ``"poisson"``
    with ``mu`` ≥ 1 (the other parameters left None).
    """

    trials: tuple
    distribution: str
    eta: float | None = None
    gamma: float | None = None
    mu: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "trials", tuple(self.trials))
        if not self.trials:
            raise ValueError("RepeatAndSelectEvent needs at least one trial event, got none")
        if self.distribution == "truncated_negative_binomial":
            check_open_interval(self.eta, -1.0, math.inf, "eta")
            check_open_interval(self.gamma, 0.0, 1.0, "gamma")
            if self.mu is not None:
                raise ValueError(f"mu is a Poisson parameter; leave it None here, got {self.mu!r}")
        elif self.distribution == "poisson":
            check_positive(self.mu, "mu")
            if self.mu < 1.0:
                raise ValueError(f"mu must be >= 1 for a Poisson selection (its RDP bound needs it), got {self.mu!r}")
            if self.eta is not None or self.gamma is not None:
                raise ValueError("eta and gamma are truncated-negative-binomial parameters; "
                                 f"leave them None for poisson, got eta={self.eta!r}, gamma={self.gamma!r}")
        else:
            raise ValueError(f"distribution must be one of {TRIAL_COUNT_DISTRIBUTIONS}, "
                             f"got {self.distribution!r}")


@dataclass(frozen=True)
class AdaptiveEvent:
    """``then`` run with parameters chosen from ``first``'s output; charged by basic composition
    (``first`` at ``first_delta_share`` of δ, ``then`` at the rest): see the module docstring."""

    first: "DpEvent"
    then: "DpEvent"
    first_delta_share: float = 0.1

    def __post_init__(self):
        check_open_interval(self.first_delta_share, 0.0, 1.0, "first_delta_share")
        for part in (self.first, self.then):
            if holds_adaptive(part):
                raise ValueError("an AdaptiveEvent's parts cannot hold another AdaptiveEvent (one release chooses "
                                 "the rest); compose adaptive events side by side instead")


DpEvent = Union[
    GaussianEvent,
    ExponentialEvent,
    LimitedDomainEvent,
    PoissonSampledEvent,
    MixtureOfGaussiansEvent,
    SelfComposedEvent,
    ComposedEvent,
    ParallelEvent,
    RepeatAndSelectEvent,
    AdaptiveEvent,
]

_TYPES = {
    "gaussian": GaussianEvent,
    "exponential": ExponentialEvent,
    "limited_domain": LimitedDomainEvent,
    "poisson_sampled": PoissonSampledEvent,
    "mixture_of_gaussians": MixtureOfGaussiansEvent,
    "self_composed": SelfComposedEvent,
    "composed": ComposedEvent,
    "parallel": ParallelEvent,
    "repeat_and_select": RepeatAndSelectEvent,
    "adaptive": AdaptiveEvent,
}
_NAMES = {cls: name for name, cls in _TYPES.items()}


def sub_events(event: DpEvent) -> tuple:
    """The events an event is made of (its direct parts; none for a mechanism)."""
    if isinstance(event, (PoissonSampledEvent, SelfComposedEvent)):
        return (event.event,)
    if isinstance(event, (ComposedEvent, ParallelEvent)):
        return event.events
    if isinstance(event, RepeatAndSelectEvent):
        return event.trials
    if isinstance(event, AdaptiveEvent):
        return (event.first, event.then)
    return ()


def all_events(event: DpEvent):
    """The event and, depth first, every event it is made of."""
    yield event
    for part in sub_events(event):
        yield from all_events(part)


def event_to_dict(event: DpEvent) -> dict[str, Any]:
    """A JSON-ready dict with a ``type`` key; nested events become nested dicts."""
    name = _NAMES.get(type(event))
    if name is None:
        raise TypeError(f"not a privacy event: {event!r}")
    if isinstance(event, PoissonSampledEvent):
        return {"type": name, "sampling_probability": event.sampling_probability,
                "event": event_to_dict(event.event)}
    if isinstance(event, SelfComposedEvent):
        return {"type": name, "count": event.count, "event": event_to_dict(event.event)}
    if isinstance(event, (ComposedEvent, ParallelEvent)):
        return {"type": name, "events": [event_to_dict(e) for e in event.events]}
    if isinstance(event, MixtureOfGaussiansEvent):
        return {"type": name, "noise_multiplier": event.noise_multiplier,
                "sensitivities": list(event.sensitivities), "sampling_probs": list(event.sampling_probs)}
    if isinstance(event, AdaptiveEvent):
        return {"type": name, "first": event_to_dict(event.first), "then": event_to_dict(event.then),
                "first_delta_share": event.first_delta_share}
    if isinstance(event, RepeatAndSelectEvent):
        return {"type": name, "trials": [event_to_dict(e) for e in event.trials],
                "distribution": event.distribution, "eta": event.eta, "gamma": event.gamma, "mu": event.mu}
    out = {"type": name}
    out.update(event.__dict__)
    return out


def event_from_dict(data: dict[str, Any]) -> DpEvent:
    if not isinstance(data, dict) or "type" not in data:
        raise ValueError(f"a privacy event must be a dict with a 'type' key, got {data!r}")
    kind = data["type"]
    cls = _TYPES.get(kind)
    if cls is None:
        raise ValueError(f"unknown privacy event type {kind!r}; known: {sorted(_TYPES)}")
    args = {k: v for k, v in data.items() if k != "type"}
    if cls is PoissonSampledEvent:
        return cls(args["sampling_probability"], event_from_dict(args["event"]))
    if cls is SelfComposedEvent:
        return cls(event_from_dict(args["event"]), args["count"])
    if cls in (ComposedEvent, ParallelEvent):
        return cls(tuple(event_from_dict(e) for e in args["events"]))
    if cls is MixtureOfGaussiansEvent:
        return cls(args["noise_multiplier"], tuple(args["sensitivities"]), tuple(args["sampling_probs"]))
    if cls is AdaptiveEvent:
        return cls(event_from_dict(args["first"]), event_from_dict(args["then"]), args["first_delta_share"])
    if cls is RepeatAndSelectEvent:
        return cls(tuple(event_from_dict(e) for e in args["trials"]), args["distribution"],
                   args.get("eta"), args.get("gamma"), args.get("mu"))
    return cls(**args)


@functools.lru_cache(maxsize=8192)
def holds_adaptive(event: DpEvent) -> bool:
    """Whether ``event`` is, or holds anywhere, an :class:`AdaptiveEvent` (remembered per event: a
    ledger asks it of every entry of a dataset at every reservation)."""
    return isinstance(event, AdaptiveEvent) or any(holds_adaptive(e) for e in sub_events(event))


def split_adaptive(event: DpEvent) -> tuple[tuple, tuple, float | None]:
    """(the ``first`` parts, everything else, their δ share) of an event whose adaptive parts lie
    at the top level or in a top-level composition (a run's event; a ledger's composition of runs);
    no adaptive part: ((), (event,), None). An adaptive part elsewhere (subsampled, repeated, in a
    parallel branch or a selection's trial) is refused: basic composition splits a sequence, not
    those. With several shares the smallest is taken (basic composition holds for any split of δ)."""
    firsts, rest, shares = [], [], []

    def walk(e):
        if isinstance(e, AdaptiveEvent):
            firsts.append(e.first)
            rest.append(e.then)
            shares.append(float(e.first_delta_share))
        elif isinstance(e, ComposedEvent):
            for part in e.events:
                walk(part)
        else:
            if holds_adaptive(e):
                raise ValueError(f"an AdaptiveEvent inside a {type(e).__name__} cannot be accounted "
                                 "(basic composition splits a sequence of releases)")
            rest.append(e)

    walk(event)
    if not firsts:
        return (), (event,), None
    return tuple(firsts), tuple(rest), min(shares)


def event_to_json(event: DpEvent) -> str:
    return json.dumps(event_to_dict(event), sort_keys=True)


def event_from_json(text: str) -> DpEvent:
    return event_from_dict(json.loads(text))


# ---- generic compositions ----------------------------------------------------------------------
# (a method's own events live in its package, e.g. ``tasks/methods/dp_opt/events.py``)

def dpsgd_event(sample_rate: float, noise_multiplier: float, steps: int) -> DpEvent:
    """``steps`` DP-SGD steps: Poisson-subsampled Gaussian on clipped per-sample gradients."""
    check_count(steps, "steps")
    return SelfComposedEvent(PoissonSampledEvent(sample_rate, GaussianEvent(noise_multiplier)), steps)


def binomial_mixture(sample_rate: float, noise_multiplier: float, k: int) -> MixtureOfGaussiansEvent:
    """One Poisson-subsampled Gaussian step (rate q, noise σ per unit of sensitivity) seen by a group
    of ``k`` records, each sampled independently: the number J of them in the batch is
    Binomial(k, q), and they move the clipped sum by at most J — the mixture c = 0..k with
    P(J = c) (Ganesh 2024, arXiv:2401.10294; dp-accounting's ``MixtureOfGaussiansDpEvent``)."""
    check_rate(sample_rate, "sample_rate")
    check_count(k, "k", minimum=1)
    q = float(sample_rate)
    if q >= 1.0:
        probs = [0.0] * k + [1.0]
    else:
        probs = [math.exp(math.lgamma(k + 1) - math.lgamma(j + 1) - math.lgamma(k - j + 1)
                          + j * math.log(q) + (k - j) * math.log1p(-q)) if q > 0 or j == 0 else 0.0
                 for j in range(k + 1)]
        total = sum(probs)
        probs = [p / total for p in probs]
    return MixtureOfGaussiansEvent(float(noise_multiplier), tuple(float(j) for j in range(k + 1)), tuple(probs))
