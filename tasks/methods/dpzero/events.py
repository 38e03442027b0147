"""DPZero's privacy event."""

from __future__ import annotations

from privacy.events import DpEvent, dpsgd_event


def dpzero_event(sample_rate: float, noise_multiplier: float, steps: int) -> DpEvent:
    """``steps`` DPZero steps: Gaussian noise on a clipped scalar (the two-point difference),
    on a Poisson subsample. The sensitivity is the clip bound, so the event is the same
    subsampled Gaussian as DP-SGD's, with the noise multiplier relative to that bound."""
    return dpsgd_event(sample_rate, noise_multiplier, steps)
