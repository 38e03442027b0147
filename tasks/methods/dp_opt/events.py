"""DP-OPT's privacy events, composed from the generic ones of ``privacy.events``."""

from __future__ import annotations

from privacy.events import (DpEvent, ExponentialEvent, LimitedDomainEvent, ParallelEvent, PoissonSampledEvent,
                            SelfComposedEvent)
from privacy.validation import check_count


def generation_event(epsilon0: float, delta0: float, sample_rate: float, queries: int) -> DpEvent:
    """``queries`` LimitedDomain token queries, each on a fresh Poisson subsample of the
    generation data (DP-OPT Algorithm 1)."""
    check_count(queries, "queries")
    return SelfComposedEvent(PoissonSampledEvent(sample_rate, LimitedDomainEvent(epsilon0, delta0)), queries)


def selection_event(epsilon: float) -> DpEvent:
    """DP-argmax over candidate prompts: Gumbel noise on validation correct-counts (monotone)."""
    return ExponentialEvent(epsilon, monotone=True)


def run_event(generation: DpEvent, selection: DpEvent) -> DpEvent:
    """Generation and selection use disjoint data: the run costs the larger of the two."""
    return ParallelEvent((generation, selection))
