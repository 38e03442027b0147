"""The accountants, by name: what a composed privacy event costs, as (ε, δ).

A registry in the manner of Opacus (``opacus.accountants.register_accountant`` /
``create_accountant``): an accountant is registered under a name and created from it, so a new one
is one class here or in a plugin, and the code that asks for a spend does not change.

Built in:

* ``"pld"``: dp-accounting's privacy-loss distributions (``privacy/pld.py``) — tightest for
  Gaussian mechanisms; it cannot express a best-of-K selection (ε = ∞ there: nothing it proves).
* ``"rdp"``: the project's Rényi-DP curves (``privacy/rdp.py``), converted by BBGHS — the path of
  DP-OPT's published accounting and of the Papernot–Steinke selection bound; ε = ∞ for an event
  whose RDP curve is not a proven bound (a Poisson-subsampled LimitedDomain, ``rdp.rdp_is_proven``).
* ``"min_pld_rdp"`` (the default, :data:`DEFAULT_ACCOUNTANT`): both, and the smaller *proven* one —
  the policy every ε of the project has been stated with (``accountant.spend``): PLD alone where the
  RDP curve is unproven, RDP alone where PLD cannot express the event, else min(PLD, RDP). Both
  numbers are kept in the :class:`PrivacySpend`, so every claim shows its cross-check.

Every accountant answers for the event as given; ``accountant.spend`` first unwraps a composition of
one event (its parallel parts then stay at the top level, where they cost the maximum over parts).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Callable

from . import events as ev
from . import rdp as rdp_lib
from .pld import DISCRETIZATION, pld_for


@dataclass(frozen=True)
class PrivacySpend:
    """One (ε, δ) statement with both accountants' answers (None: that accountant was not asked,
    or cannot express the event)."""

    epsilon: float
    delta: float
    epsilon_pld: float | None
    epsilon_rdp: float | None
    rdp_order: float | None
    accountant: str = "min(pld, rdp)"

    def to_dict(self) -> dict:
        return asdict(self)


def _finite_or_inf(x: float | None) -> float:
    return x if x is not None and math.isfinite(x) else math.inf


def unwrapped(event: ev.DpEvent) -> ev.DpEvent:
    """A composition of one event is that event: its parallel parts (disjoint data) then stay at
    the top level, where their cost is the maximum over parts, instead of nested in a composition,
    where they are composed sequentially (an upper bound). The ledger composes a dataset's entries
    as one ``ComposedEvent``; with a single entry, this keeps its ε the run's own."""
    while isinstance(event, ev.ComposedEvent) and len(event.events) == 1:
        event = event.events[0]
    return event


# ---- the two accounting paths ---------------------------------------------------------------

def epsilon_pld(event: ev.DpEvent, delta: float, discretization: float = DISCRETIZATION) -> float | None:
    """ε at δ of the event's privacy-loss distribution; None where PLD cannot express the event.
    Parallel parts at the top level: the maximum over parts."""
    if isinstance(event, ev.ParallelEvent):
        parts = [epsilon_pld(e, delta, discretization) for e in event.events]
        return None if any(p is None for p in parts) else max(parts)
    pld = pld_for(event, discretization)
    if pld is None:
        return None
    return float(pld.get_epsilon_for_delta(delta))


def epsilon_rdp(event: ev.DpEvent, delta: float, orders=rdp_lib.DEFAULT_ORDERS) -> tuple[float, float | None]:
    """(ε, best order) from the RDP curve; ε = inf when the δ-parts alone exceed δ. Whether the
    curve is a proven bound is ``rdp.rdp_is_proven``'s question, not this one's."""
    if isinstance(event, ev.ParallelEvent):
        parts = [epsilon_rdp(e, delta, orders) for e in event.events]
        return max(parts, key=lambda p: p[0])
    curve, delta_part = rdp_lib.rdp_of_event(event, orders)
    if delta <= delta_part:
        return math.inf, None
    return rdp_lib.rdp_to_epsilon(orders, curve, delta - delta_part)


def delta_pld(event: ev.DpEvent, epsilon: float) -> float | None:
    """δ at ε of the event's PLD (on the default grid); None where PLD cannot express it."""
    pld = pld_for(event, DISCRETIZATION)
    return None if pld is None else float(pld.get_delta_for_epsilon(epsilon))


def delta_rdp(event: ev.DpEvent, epsilon: float) -> float:
    """δ at ε from the RDP curve (BBGHS), its δ-parts added, at most 1."""
    curve, delta_part = rdp_lib.rdp_of_event(event)
    d_rdp, _ = rdp_lib.rdp_to_delta(rdp_lib.DEFAULT_ORDERS, curve, epsilon)
    return min(1.0, d_rdp + delta_part)


# ---- the accountant interface and the registry ----------------------------------------------

class Accountant(ABC):
    """What a privacy event costs. Stateless: the events carry everything (compose them with
    ``ComposedEvent`` / ``SelfComposedEvent``, or ``accountant.PrivacyAccountant``)."""

    name: str = ""

    @abstractmethod
    def spend(self, event: ev.DpEvent, delta: float, discretization: float = DISCRETIZATION) -> PrivacySpend:
        """ε at δ (a valid upper bound, ∞ where nothing proven bounds the event). ``discretization``:
        the PLD grid, where the accountant uses one (coarser: faster and more pessimistic)."""

    @abstractmethod
    def delta_for_epsilon(self, event: ev.DpEvent, epsilon: float) -> float:
        """The smallest δ it proves the event (ε, δ)-DP for (1.0 where it proves nothing)."""


_ACCOUNTANTS: dict[str, Callable[[], Accountant]] = {}
DEFAULT_ACCOUNTANT = "min_pld_rdp"


def register_accountant(name: str, accountant: Callable[[], Accountant] | None = None, *, force: bool = False):
    """Register an accountant class (or any factory of :class:`Accountant`) under ``name``; as a
    decorator without ``accountant``: ``@register_accountant("mine")``. A name already taken is
    refused unless ``force`` (then the new one answers from now on, cached answers forgotten)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"an accountant's name must be a non-empty string, got {name!r}")

    def add(factory):
        if not callable(factory):
            raise TypeError(f"accountant {name!r} must be a class or factory of Accountant, got {factory!r}")
        if name in _ACCOUNTANTS and not force:
            raise ValueError(f"an accountant named {name!r} is already registered (force=True replaces it)")
        _ACCOUNTANTS[name] = factory
        cached_spend.cache_clear()
        return factory

    return add if accountant is None else add(accountant)


def create_accountant(name: str = DEFAULT_ACCOUNTANT) -> Accountant:
    """A new instance of the accountant registered under ``name``."""
    if name not in _ACCOUNTANTS:
        raise ValueError(f"unknown accountant {name!r}; registered: {', '.join(registered_accountants())}")
    accountant = _ACCOUNTANTS[name]()
    if not isinstance(accountant, Accountant):
        raise TypeError(f"accountant {name!r} made {accountant!r}, not an Accountant")
    return accountant


def registered_accountants() -> list[str]:
    return sorted(_ACCOUNTANTS)


@lru_cache(maxsize=2048)
def cached_spend(name: str, event: ev.DpEvent, delta: float, discretization: float) -> PrivacySpend:
    """``create_accountant(name).spend(...)``, remembered: a spend is a pure function of (event, δ,
    grid), and the plan, the preflight, the largest-fitting search, the reservation and the commit
    ask it again and again for the same events."""
    return create_accountant(name).spend(event, delta, discretization)


# ---- the built-in accountants ---------------------------------------------------------------

@register_accountant("pld")
class PldAccountant(Accountant):
    """dp-accounting's PLD accountant alone."""

    name = "pld"

    def spend(self, event, delta, discretization=DISCRETIZATION):
        e_pld = epsilon_pld(event, delta, discretization)
        label = "pld" if e_pld is not None else "pld (cannot express this event)"
        return PrivacySpend(epsilon=_finite_or_inf(e_pld), delta=delta, epsilon_pld=e_pld, epsilon_rdp=None,
                            rdp_order=None, accountant=label)

    def delta_for_epsilon(self, event, epsilon):
        if isinstance(event, ev.ParallelEvent):
            return max(self.delta_for_epsilon(unwrapped(e), epsilon) for e in event.events)
        d = delta_pld(event, epsilon)
        return 1.0 if d is None else d


@register_accountant("rdp")
class RdpAccountant(Accountant):
    """The RDP accountant alone (only where its curve is a proven bound)."""

    name = "rdp"

    def spend(self, event, delta, discretization=DISCRETIZATION):
        e_rdp, order = epsilon_rdp(event, delta)
        if not rdp_lib.rdp_is_proven(event):
            return PrivacySpend(epsilon=math.inf, delta=delta, epsilon_pld=None, epsilon_rdp=e_rdp, rdp_order=order,
                                accountant="rdp (unproven for this event)")
        return PrivacySpend(epsilon=e_rdp, delta=delta, epsilon_pld=None, epsilon_rdp=e_rdp, rdp_order=order,
                            accountant="rdp")

    def delta_for_epsilon(self, event, epsilon):
        if isinstance(event, ev.ParallelEvent):
            return max(self.delta_for_epsilon(unwrapped(e), epsilon) for e in event.events)
        return delta_rdp(event, epsilon) if rdp_lib.rdp_is_proven(event) else 1.0


@register_accountant(DEFAULT_ACCOUNTANT)
class MinPldRdp(Accountant):
    """Both accountants, the smaller proven answer: every ε of the project is stated this way."""

    name = DEFAULT_ACCOUNTANT

    def spend(self, event, delta, discretization=DISCRETIZATION):
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

    def delta_for_epsilon(self, event, epsilon):
        if isinstance(event, ev.ParallelEvent):
            return max(self.delta_for_epsilon(unwrapped(e), epsilon) for e in event.events)
        if not rdp_lib.rdp_is_proven(event):  # see spend: PLD alone decides, and without it nothing does
            d = delta_pld(event, epsilon)
            return 1.0 if d is None else d
        candidates = []
        d = delta_pld(event, epsilon)
        if d is not None:
            candidates.append(d)
        candidates.append(delta_rdp(event, epsilon))
        return min(candidates)
