"""A private selection of a method's settings, as a method: ``selected(method)`` is the method's
spec with the :class:`Selection` mechanism (``plan``, ``train``, ``post_process``, ``preflight``), so
the lifecycle runs it through the same door as any method and never asks whether a run selects.

* ``plan(cfg, n_train, delta, epsilon)``: every candidate's training calibrated together so that
  the whole mechanism — K trials (or every candidate once) with noisy holdout scores, one winner —
  spends the method's share ``epsilon`` (``tasks.selection.plan_selection``);
* ``train``: the trials on the training rows, scored on the holdout (``uses_validation``), the
  mechanism's event (``tasks.selection.train_selection``);
* what the run publishes of the winner (by name, from released numbers only) is the release
  kind's (``tasks.releases.SelectionRelease``).
"""

from __future__ import annotations

from dataclasses import replace

from . import selection
from .errors import ConfigError
from .methods import get_method
from .methods.base import Mechanism, MethodSpec, budget


def announce(line: str) -> None:
    """A public progress line of the selection (start and end only: tasks/selection.py)."""
    try:
        from prefect import get_run_logger

        get_run_logger().info(line)
    except Exception:  # noqa: BLE001 - outside a flow (tests, audit shadows): nowhere to say it
        pass


class Selection(Mechanism):
    """The mechanism of ``method`` with its settings chosen privately on the holdout
    (``selection: {enabled: true}``)."""

    def __init__(self, method: MethodSpec):
        self.method = method

    def __repr__(self) -> str:
        return f"Selection({self.method.name})"

    def guarantee(self, cfg):
        return self.method.mechanism.guarantee(cfg)

    def preflight(self, cfg, prepared) -> None:
        """The method's checks under its base settings and under every candidate's: one with more
        prompt positions than the model holds would train, and one long record would fail its trial —
        a published failed-candidate count decided by one record."""
        own = self.method.mechanism
        own.preflight(cfg, prepared)
        for c in selection.candidates_of(cfg, self.method):
            if c.zero_shot:
                continue
            try:
                own.preflight(selection.apply_settings(cfg, self.method.name, c.config), prepared)
            except ConfigError as exc:
                raise ConfigError(f"selection candidate {c.name!r}: {exc}") from None

    def plan(self, cfg, n_train: int, delta: float, epsilon: float | None = None):
        try:
            return selection.plan_selection(self.method, cfg, n_train, delta, budget(cfg, epsilon))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def train(self, mctx, plan, rows, progress=None):
        return selection.train_selection(self.method, mctx, plan, rows, mctx.private_dir / "selection.log",
                                         announce=announce)

    def post_process(self, mctx, plan, prompt, progress=None):
        return self.method.mechanism.post_process(mctx, plan, prompt, progress=progress)


def selected(method: MethodSpec) -> MethodSpec:
    """``method`` with its settings selected: its declaration, with the traits of a selection — dp
    under every candidate (check_selection_config); its release in the run's plan: the trials and
    the noisy holdout scores, one mechanism; "no prompt" among its candidates (no second comparison);
    the trials scored on the holdout — and the :class:`Selection` mechanism."""
    return replace(method, mechanism=Selection(method),
                   traits=replace(method.traits, always_dp=True, release="selection", compares_with_no_prompt=True,
                                  uses_validation=True))


def method_for(cfg, name: str) -> MethodSpec:
    """What runs method ``name`` of ``cfg``: the registered method, or its :func:`selected` form when
    its settings are selected (the published method under ``selection:``)."""
    method = get_method(name)
    return selected(method) if selection.applies(cfg, name) else method
