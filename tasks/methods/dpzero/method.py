"""dpzero: black-box DP soft-prompt tuning with two-point zeroth-order estimates (DPZero; the
black-box setting of Privacy-Flat §3.3): only losses are queried. Each step releases one noised
sum of clipped scalars on a Poisson subsample — the subsampled Gaussian event of DP-SGD, with σ
calibrated to the target ε (``events.py``)."""

from __future__ import annotations

import math

from pydantic import ConfigDict, Field

from ...schema import Block
from .. import register_method
from ..base import Mechanism, MethodPlan, MethodSpec, Report, Trained, Traits, budget, dp_unless_debug, settings_of


class DPZeroConfig(Block):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    enabled: bool = Field(False, description="run as a baseline beside the published method")
    n_tokens: int = Field(10, gt=0)
    init: str | None = Field(None, description="words to initialise the prompt from")
    batch_size: int = Field(64, gt=0, description="expected Poisson batch size")
    epochs: float = Field(1.0, gt=0, description="expected passes over the data (steps = epochs / q)")
    steps: int | None = Field(None, gt=0, description="number of steps (overrides epochs)")
    lr: float = Field(1e-3, gt=0)
    mu: float = Field(1e-3, gt=0, description="perturbation scale of the two-point estimate")
    clip: float = Field(1.0, gt=0, description="C: bound on each example's two-point difference")
    regularizer: bool = Field(False, description="Privacy-Flat's λ‖w − w_nor‖₂ to a non-privately trained copy "
                                                 "(reads private data without noise: no guarantee)")
    lam: float = Field(0.01, gt=0, alias="lambda", description="λ of the regulariser")
    nor_epochs: float = Field(1.0, gt=0, description="epochs of the non-private copy w_nor")


def run_label(cfg) -> str:
    """DPZero with the w_nor regulariser is named apart (it has no guarantee)."""
    return "dpzero+regularizer" if cfg.methods.dpzero.regularizer else "dpzero"


class DPZero(Mechanism):
    def guarantee(self, cfg):
        return "none" if settings_of(cfg, self).regularizer else dp_unless_debug(cfg)

    def plan(self, cfg, n_train, delta, epsilon=None):
        from privacy import accountant as acct

        from .events import dpzero_event

        block = settings_of(cfg, self)
        q = min(1.0, block.batch_size / n_train)
        steps = block.steps or max(1, math.ceil(block.epochs / q))
        sigma = acct.calibrate_noise_multiplier(budget(cfg, epsilon), delta, q, steps)
        settings = {"sample_rate": q, "steps": steps, "noise_multiplier": sigma, "expected_batch": q * n_train}
        guarantee = self.guarantee(cfg)
        return MethodPlan(self.spec.name, guarantee, n_train, delta,
                          event=dpzero_event(q, sigma, steps) if guarantee == "dp" else None,
                          params={"dpzero.sample_rate": q, "dpzero.noise_multiplier": sigma, "dpzero.steps": steps,
                                  "dpzero.clip": block.clip, "dpzero.mu": block.mu, "dpzero.lr": block.lr,
                                  "flat.regularizer": block.regularizer,
                                  "flat.lambda": block.lam if block.regularizer else None,
                                  **({"dpzero.sampled": "units"} if cfg.data.user_unit else {})},
                          settings=settings,
                          note="DPZero with the w_nor regulariser reads private data without noise: no formal "
                               "guarantee" if block.regularizer else "")

    def train(self, mctx, plan, rows, progress=None):
        import torch

        from models.soft_prompt import SoftPrompt

        from ...methodkit.classifiers import classifier_for, label_indices
        from ...methodkit.training import unit_tensor
        from .events import dpzero_event
        from .training import DPZeroConfig as ModelConfig
        from .training import physical_batch, train_dpzero

        cfg, block = mctx.cfg, settings_of(mctx.cfg, self)
        clf = classifier_for(cfg, cfg.models.local)
        enc = clf.encode(rows.texts, max_length=cfg.models.max_length)
        y = label_indices(rows.labels, cfg.data.labels)
        init = SoftPrompt.init_from_vocab(clf.backbone, block.init or block.n_tokens, n_tokens=block.n_tokens,
                                          seed=mctx.seed).weight.detach()
        s = plan.settings
        regularizer = None
        if block.regularizer:  # Privacy-Flat's cross-model pull to w_nor, added to the noised update
            from ...methodkit.training import cross_model_pull, nonprivate_copy

            w_nor = nonprivate_copy(mctx, clf, init, rows, block, "soft", block.nor_epochs)
            regularizer = lambda w: cross_model_pull(w, w_nor, block.lam)  # noqa: E731
        sample, noise = mctx.randomness.torch_generators()
        result = train_dpzero(clf, enc, y, init, ModelConfig(
            steps=s["steps"], sample_rate=s["sample_rate"], noise_multiplier=s["noise_multiplier"],
            clip=block.clip, mu=block.mu, lr=block.lr, expected_batch=s.get("expected_batch"),
            physical_batch_size=physical_batch(cfg, clf, init)), sample_generator=sample, noise_generator=noise,
            direction_generator=torch.Generator().manual_seed(mctx.seed), progress=progress,
            regularizer=regularizer, **unit_tensor(cfg, rows))
        if result.steps != s["steps"]:
            raise RuntimeError(f"DPZero took {result.steps} steps, {s['steps']} were accounted")
        event = dpzero_event(s["sample_rate"], s["noise_multiplier"], s["steps"]) if plan.guarantee == "dp" else None
        return Trained(result.prompt, event, result.steps,
                       {"train.steps": result.steps}, result.history)


DPZERO = register_method(MethodSpec(
    name="dpzero", config_class=DPZeroConfig, mechanism=DPZero(), label="DPZero (black-box)",
    # Poisson sampling of units, one clipped two-point difference per unit; its learning rate around
    # the default 1e-3: 3 candidates
    traits=Traits(unit_level=True, neighbour_statistics=("clipped_difference_sum",),
                  selection_grid=[{"lr": lr} for lr in (3e-4, 1e-3, 3e-3)],
                  test_settings={"n_tokens": 2, "batch_size": 8, "steps": 3}),
    report=Report(run_label=run_label)))
