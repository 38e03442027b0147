"""dp_fewshot's privacy events, from the generic ones of ``privacy.events``."""

from __future__ import annotations

from privacy.events import DpEvent, GaussianEvent, SelfComposedEvent
from privacy.validation import check_count


def generation_event(noise_multiplier: float, tokens: int) -> DpEvent:
    """One (label, demonstration) group's ``tokens`` queries, each the Gaussian mechanism at σ =
    ``noise_multiplier`` relative to the sum's L2 sensitivity √2 (``distribution_vote``). The groups
    use disjoint rows (parallel composition), so this is the run's event."""
    check_count(tokens, "tokens", minimum=1)
    return SelfComposedEvent(GaussianEvent(noise_multiplier), tokens)
