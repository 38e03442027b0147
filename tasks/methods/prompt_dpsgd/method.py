"""prompt_dpsgd (PromptDPSGD): a soft prompt trained with DP-SGD — Poisson sampling, per-example
clipping, Gaussian noise σ·C — on the frozen local model; σ calibrated to the target ε."""

from __future__ import annotations

from ...schema import DPSGDConfig
from .. import register_method
from ..base import Method, MethodPlan, Trained, dp_unless_debug


@register_method
class PromptDPSGD(Method):
    name = "prompt_dpsgd"
    config_class = DPSGDConfig
    label = "prompt tuning (DP-SGD)"
    unit_level = True  # Poisson sampling of units, one clipped gradient per unit (models.dp_prompt_training)

    @classmethod
    def contract_test_config(cls):
        return {"n_tokens": 2, "epochs": 1, "batch_size": 8}

    def guarantee(self, cfg):
        return dp_unless_debug(cfg)

    def selection_grid(self, cfg):
        """Learning rate × epochs around the quickstart's (lr 0.05, 2 epochs): 6 candidates."""
        return [{"lr": lr, "epochs": epochs} for lr in (0.01, 0.05, 0.2) for epochs in (1.0, 3.0)]

    def plan(self, cfg, n_train, delta):
        from ...methodkit.training import dpsgd_event, dpsgd_params, dpsgd_settings

        settings = dpsgd_settings(self.settings(cfg), n_train, cfg.privacy.target_epsilon, delta,
                                  cfg.data.privacy_unit)
        guarantee = self.guarantee(cfg)
        return MethodPlan(self.name, guarantee, n_train, delta,
                          event=dpsgd_event(settings) if guarantee == "dp" else None,
                          params={**dpsgd_params(settings), **self.extra_params(cfg)}, settings=settings,
                          note=self.note(cfg, guarantee))

    def extra_params(self, cfg) -> dict:
        """Params a subclass logs beside the DP-SGD ones."""
        return {}

    def note(self, cfg, guarantee) -> str:
        return "" if guarantee == "dp" else ("debug_seeded_dp_randomness: the DP noise is derivable from the "
                                             "logged seed; no guarantee")

    def train(self, mctx, plan, rows, progress=None):
        from ...methodkit.training import dpsgd_event, fit_soft_prompt

        cfg = mctx.cfg
        result = fit_soft_prompt(cfg, self.settings(cfg), cfg.models.local, rows, mctx.seed,
                                 dp=plan.settings, randomness=mctx.randomness, progress=progress)
        metrics = {"train.steps": result.steps}
        return Trained(result.prompt, dpsgd_event(plan.settings) if plan.guarantee == "dp" else None,
                       result.steps, metrics, result.history)
