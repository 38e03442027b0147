"""prefix_dpsgd: DP prefix tuning (Li & Liang's prefixes, per-layer keys and values; the white-box
base of Privacy-Flat): Poisson sampling, per-example clipping of the whole prefix's gradient,
Gaussian noise σ·C, σ calibrated to the target ε — the soft prompt's DP-SGD path on a prefix."""

from __future__ import annotations

from ..schema import DPSGDConfig
from . import register_method
from .base import Method, MethodPlan, Trained, dp_unless_debug


class PrefixDPSGDConfig(DPSGDConfig):
    """DP-SGD prefix tuning: ``n_tokens`` prefix positions at every attention layer."""


@register_method
class PrefixDPSGD(Method):
    name = "prefix_dpsgd"
    config_class = PrefixDPSGDConfig
    prompt_kind = "prefix"
    label = "prefix tuning (DP-SGD)"

    def guarantee(self, cfg):
        return dp_unless_debug(cfg)

    def plan(self, cfg, n_train, delta):
        from .soft_prompt import dpsgd_event, dpsgd_params, dpsgd_settings

        settings = dpsgd_settings(self.settings(cfg), n_train, cfg.privacy.target_epsilon, delta)
        guarantee = self.guarantee(cfg)
        return MethodPlan(self.name, guarantee, n_train, delta,
                          event=dpsgd_event(settings) if guarantee == "dp" else None,
                          params={**dpsgd_params(settings), **self.extra_params(cfg)}, settings=settings,
                          note=self.note(cfg, guarantee))

    def extra_params(self, cfg) -> dict:
        return {"prefix.n_tokens": self.settings(cfg).n_tokens}

    def note(self, cfg, guarantee) -> str:
        return "" if guarantee == "dp" else ("debug_seeded_dp_randomness: the DP noise is derivable from the "
                                             "logged seed; no guarantee")

    def flat_options(self, mctx, plan, rows, progress=None) -> dict:
        """Privacy-Flat's additions to the DP step: {"flat": FlatOptions, "init_prompt": tensor,
        "metrics": publishable counts, "history": private records}; {} for plain DP prefix tuning."""
        return {}

    def train(self, mctx, plan, rows, progress=None):
        from .soft_prompt import dpsgd_event, fit_soft_prompt

        cfg = mctx.cfg
        extra = self.flat_options(mctx, plan, rows, progress)
        result = fit_soft_prompt(cfg, self.settings(cfg), cfg.models.local, rows, mctx.seed, dp=plan.settings,
                                 randomness=mctx.randomness, progress=progress, kind="prefix",
                                 flat=extra.get("flat"), init_prompt=extra.get("init_prompt"))
        metrics = {"train.steps": result.steps, "train.empty_batches": result.empty_batches,
                   **extra.get("metrics", {})}
        return Trained(result.prompt, dpsgd_event(plan.settings) if plan.guarantee == "dp" else None,
                       result.steps, metrics, extra.get("history", []) + result.history)
