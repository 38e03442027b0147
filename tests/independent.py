"""The independent accountant tests check ours against: dp-accounting's own events and PLD
accountant, with no code of ours in between."""

from __future__ import annotations

from privacy import events as ev


def to_dp_accounting(event):
    """The project's event as dp-accounting's (Gaussian trees: Gaussian, Poisson-subsampled,
    self-composed and composed events); anything else is a TypeError."""
    from dp_accounting import dp_event as dpe

    if isinstance(event, ev.GaussianEvent):
        return dpe.GaussianDpEvent(event.noise_multiplier)
    if isinstance(event, ev.PoissonSampledEvent):
        return dpe.PoissonSampledDpEvent(event.sampling_probability, to_dp_accounting(event.event))
    if isinstance(event, ev.SelfComposedEvent):
        return dpe.SelfComposedDpEvent(to_dp_accounting(event.event), event.count)
    if isinstance(event, ev.ComposedEvent):
        return dpe.ComposedDpEvent([to_dp_accounting(e) for e in event.events])
    raise TypeError(f"not a Gaussian tree: {event!r}")


def pld_epsilon(event, delta: float, grid: float = 1e-4) -> float:
    """ε at δ of ``event`` by dp-accounting's PLD accountant on a grid of ``grid``."""
    from dp_accounting.pld import pld_privacy_accountant

    return pld_privacy_accountant.PLDAccountant(value_discretization_interval=grid).compose(
        to_dp_accounting(event)).get_epsilon(delta)
