"""prefix_dpsgd: DP prefix tuning (Li & Liang's prefixes, per-layer keys and values; the white-box
base of Privacy-Flat): Poisson sampling, per-example clipping of the whole prefix's gradient,
Gaussian noise σ·C, σ calibrated to the target ε — the soft prompt's DP-SGD path on a prefix
(the toolkit's :class:`~tasks.methodkit.prompt_methods.PrefixDPSGDMethod`). ``prefix_sgd``: the
same prefix trained without DP."""

from __future__ import annotations

from dataclasses import replace

from ...methodkit.prompt_methods import (DPSGD_TRAITS, PREFIX_REPORT, PrefixDPSGDConfig, PrefixDPSGDMethod,
                                         prefix_extras)
from ...methodkit.training import fit_nonprivate, trained_metrics
from .. import register_method
from ..base import MethodPlan, MethodSpec, Trained, settings_of

__all__ = ["PREFIX_DPSGD", "PREFIX_SGD", "PrefixDPSGDConfig", "PrefixSGD"]

PREFIX_DPSGD = register_method(MethodSpec(
    name="prefix_dpsgd", config_class=PrefixDPSGDConfig, mechanism=PrefixDPSGDMethod(), prompt_kind="prefix",
    label="prefix tuning (DP-SGD)", traits=DPSGD_TRAITS, report=PREFIX_REPORT, extras=prefix_extras("prefix_dpsgd")))


def nonprivate_label(cfg) -> str:
    """The non-private prefix is the ladder's upper rung: ``prefix_nonprivate``."""
    return "prefix_nonprivate"


class PrefixSGD(PrefixDPSGDMethod):
    """prefix_sgd: non-private prefix tuning (the upper bound of the Privacy-Flat comparison; no guarantee)."""

    def guarantee(self, cfg):
        return "none"

    def plan(self, cfg, n_train, delta, epsilon=None):
        name = self.spec.name
        return MethodPlan(name, "none", n_train, delta, params=self.extra_params(cfg),
                          note=f"{name} has no formal privacy guarantee: nothing was published but metrics, "
                               "and its prefix stays under private/")

    def train(self, mctx, plan, rows, progress=None):
        cfg = mctx.cfg
        result = fit_nonprivate(cfg, settings_of(cfg, self), cfg.models.local, rows, mctx.seed, plan.n_train,
                                progress=progress, kind="prefix")
        return Trained(result.prompt, None, result.steps, trained_metrics(result), result.history)


_NONPRIVATE_REPORT = replace(PREFIX_REPORT, run_label=nonprivate_label)
PREFIX_SGD = register_method(MethodSpec(
    name="prefix_sgd", config_class=PrefixDPSGDConfig, mechanism=PrefixSGD(), prompt_kind="prefix",
    label="prefix tuning (non-private)", traits=DPSGD_TRAITS, report=_NONPRIVATE_REPORT,
    extras=prefix_extras("prefix_sgd", _NONPRIVATE_REPORT)))
