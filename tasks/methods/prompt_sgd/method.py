"""prompt_sgd: non-private soft-prompt tuning (a baseline and an upper bound; no guarantee)."""

from __future__ import annotations

from ...schema import PromptTuningConfig
from .. import register_method
from ..base import Method, MethodPlan, Trained


@register_method
class PromptSGD(Method):
    name = "prompt_sgd"
    config_class = PromptTuningConfig
    label = "prompt tuning (non-private)"

    @classmethod
    def contract_test_config(cls):
        return {"n_tokens": 2, "epochs": 1, "batch_size": 8}

    def guarantee(self, cfg):
        return "none"

    def plan(self, cfg, n_train, delta):
        return MethodPlan(self.name, "none", n_train, delta,
                          note=f"{self.name} has no formal privacy guarantee: nothing was published but "
                               "metrics, and its prompt stays under private/")

    def train(self, mctx, plan, rows, progress=None):
        from ...methodkit.training import fit_soft_prompt, nonprivate_steps

        cfg = mctx.cfg
        result = fit_soft_prompt(cfg, self.settings(cfg), cfg.models.local, rows, mctx.seed, progress=progress,
                                 steps=nonprivate_steps(self.settings(cfg), plan.n_train))
        return Trained(result.prompt, None, result.steps, {"train.steps": result.steps}, result.history)
