"""A private selection of a method's settings, as a method: ``Selected(method)`` implements the
method protocol (``plan``, ``train``, ``post_process``, the rest delegated), so the lifecycle runs
it through the same door as any method and never asks whether a run selects.

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
from .methods.base import budget


def announce(line: str) -> None:
    """A public progress line of the selection (start and end only: tasks/selection.py)."""
    try:
        from prefect import get_run_logger

        get_run_logger().info(line)
    except Exception:  # noqa: BLE001 - outside a flow (tests, audit shadows): nowhere to say it
        pass


class Selected:
    """``method`` with its settings chosen privately on the holdout (``selection: {enabled: true}``)."""

    def __init__(self, method):
        self.method = method
        self.name = method.name
        # dp under every candidate (check_selection_config); its release in the run's plan: the trials
        # and the noisy holdout scores, one mechanism; "no prompt" is one of its candidates (no second
        # comparison); the trials are scored on the holdout
        self.traits = replace(method.traits, always_dp=True, release="selection", compares_with_no_prompt=True,
                              uses_validation=True)

    def __getattr__(self, item):  # everything else is the method's own
        return getattr(self.method, item)

    def __repr__(self) -> str:
        return f"Selected({self.method.name})"

    def preflight(self, cfg, prepared) -> None:
        """The method's checks under its base settings and under every candidate's: one with more
        prompt positions than the model holds would train, and one long record would fail its trial —
        a published failed-candidate count decided by one record."""
        self.method.preflight(cfg, prepared)
        for c in selection.candidates_of(cfg):
            if c.zero_shot:
                continue
            try:
                self.method.preflight(selection.apply_settings(cfg, self.name, c.config), prepared)
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
        return self.method.post_process(mctx, plan, prompt, progress=progress)


def method_for(cfg, name: str):
    """What runs method ``name`` of ``cfg``: the registered method, or it wrapped in
    :class:`Selected` when its settings are selected (the published method under ``selection:``)."""
    method = get_method(name)
    return Selected(method) if selection.applies(cfg, name) else method
