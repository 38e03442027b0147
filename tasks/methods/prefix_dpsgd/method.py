"""prefix_dpsgd: DP prefix tuning (Li & Liang's prefixes, per-layer keys and values; the white-box
base of Privacy-Flat): Poisson sampling, per-example clipping of the whole prefix's gradient,
Gaussian noise σ·C, σ calibrated to the target ε — the soft prompt's DP-SGD path on a prefix
(the toolkit's :class:`~tasks.methodkit.prompt_methods.PrefixDPSGDMethod`). ``prefix_sgd``: the
same prefix trained without DP."""

from __future__ import annotations

from ...methodkit.prompt_methods import PrefixDPSGDConfig, PrefixDPSGDMethod
from dataclasses import replace

from .. import register_method
from ..base import MethodPlan, Trained

__all__ = ["PrefixDPSGD", "PrefixDPSGDConfig", "PrefixSGD"]


@register_method
class PrefixDPSGD(PrefixDPSGDMethod):
    """The soft prompt's DP-SGD plan and accounting (``prompt_dpsgd``'s), on a prefix."""

    name = "prefix_dpsgd"
    config_class = PrefixDPSGDConfig
    label = "prefix tuning (DP-SGD)"


def nonprivate_label(cfg) -> str:
    """The non-private prefix is the ladder's upper rung: ``prefix_nonprivate``."""
    return "prefix_nonprivate"


@register_method
class PrefixSGD(PrefixDPSGD):
    """prefix_sgd: non-private prefix tuning (the upper bound of the Privacy-Flat comparison; no guarantee)."""

    name = "prefix_sgd"
    config_class = PrefixDPSGDConfig
    label = "prefix tuning (non-private)"
    report = replace(PrefixDPSGD.report, run_label=nonprivate_label)

    def guarantee(self, cfg):
        return "none"

    def plan(self, cfg, n_train, delta, epsilon=None):
        return MethodPlan(self.name, "none", n_train, delta, params=self.extra_params(cfg),
                          note=f"{self.name} has no formal privacy guarantee: nothing was published but metrics, "
                               "and its prefix stays under private/")

    def train(self, mctx, plan, rows, progress=None):
        from ...methodkit.training import fit_nonprivate

        cfg = mctx.cfg
        result = fit_nonprivate(cfg, self.settings(cfg), cfg.models.local, rows, mctx.seed, plan.n_train,
                                progress=progress, kind="prefix")
        return Trained(result.prompt, None, result.steps, {"train.steps": result.steps}, result.history)
