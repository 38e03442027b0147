"""dp_lora: private LoRA (Hu et al. 2021; the route Hanke et al. 2024 measure as the strongest at
ε = 8): rank-r adapters on the frozen local model's attention projections (PEFT's target modules
for the architecture, or ``target_modules``), trained with DP-SGD — Poisson sampling of records
(or of units under a person unit, one clipped gradient per unit), per-example clipping of the
whole adapter's gradient, one Gaussian draw σ·C per logical step, σ calibrated to the target ε.
The plan, the events and the accountant are DP-SGD's (the toolkit's
:class:`~tasks.methodkit.prompt_methods.SoftPromptDPSGD`), over the adapters' flat vector instead
of a prompt's. Published as a PEFT LoRA adapter and as the registered pyfunc; the adapter changes
the backbone's layers, so it is tied to that backbone (``privprompt retarget`` refuses it).

``lora_sgd`` is the same adapter trained without DP: the ceiling a private LoRA is compared with."""

from __future__ import annotations

from dataclasses import replace

from pydantic import Field

from ...errors import ConfigError
from ...methodkit.prompt_methods import DPSGD_TRAITS, SoftPromptDPSGD
from ...methodkit.training import fit_nonprivate, fit_soft_prompt, trained_metrics
from ...schema import Block
from .. import register_method
from ..base import MethodPlan, MethodSpec, Trained, Traits, check_classifier, settings_of

__all__ = ["DP_LORA", "LORA_SGD", "LoRAConfig"]


class LoRAConfig(Block):
    """LoRA adapters on ``models.local``, trained with DP-SGD (``dp_lora``) or without (``lora_sgd``)."""

    enabled: bool = Field(False, description="run as a baseline beside the published method")
    r: int = Field(8, gt=0, description="the adapters' rank")
    alpha: float = Field(16.0, gt=0, description="LoRA's α: the update B·A·x is scaled by α / r")
    target_modules: list[str] | None = Field(None, description="the linear layers adapted, matched by name as PEFT "
                                             "matches them; default PEFT's for the architecture (BERT / MiniLM: "
                                             "query, value; Llama: q_proj, v_proj; GPT-2: c_attn)")
    lr: float = Field(0.002, gt=0, description="Adam's learning rate")
    epochs: float = Field(2.0, gt=0)
    batch_size: int = Field(64, gt=0, description="(expected) batch size")
    max_grad_norm: float = Field(1.0, gt=0, description="per-example clipping norm C (noise std σ·C)")


def lora_shape(block: LoRAConfig) -> dict:
    """The ``PromptTrainingConfig`` fields of the adapters ``block`` describes."""
    return {"lora_r": block.r, "lora_alpha": block.alpha,
            "lora_targets": tuple(block.target_modules) if block.target_modules else None}


def lora_params(block: LoRAConfig) -> dict:
    return {"lora.r": block.r, "lora.alpha": block.alpha,
            "lora.target_modules": ",".join(block.target_modules) if block.target_modules else "peft default"}


def check_lora(cfg, mechanism) -> None:
    """The classifier of ``models.local`` builds, it is the model the adapters are used on, and they
    find their target layers, each called batch-first (a public probe: per-example clipping needs it)."""
    from models.prompts.lora import check_batch_first, lora_layout

    from ...methodkit.classifiers import classifier_for

    name = mechanism.spec.name
    if cfg.models.target_name != cfg.models.local:
        raise ConfigError(f"methods.{name}: a LoRA is trained on and used with models.local "
                          f"({cfg.models.local}); models.target ({cfg.models.target}) must be unset or the same")
    if any(m != cfg.models.local for m in cfg.models.evaluate_on):
        raise ConfigError(f"methods.{name}: a LoRA fits models.local only; models.evaluate_on must be empty")
    check_classifier(cfg, cfg.models.local, "models.local", 0)
    block = settings_of(cfg, mechanism)
    clf = classifier_for(cfg, cfg.models.local)
    try:
        check_batch_first(clf, lora_layout(clf.backbone.model, block.r, block.alpha, block.target_modules))
    except ValueError as exc:
        raise ConfigError(f"methods.{name}: {exc}") from None


class DPLoRA(SoftPromptDPSGD):
    """DP-SGD on the adapters: the soft prompt's plan and accounting, a LoRA trained."""

    def extra_params(self, cfg) -> dict:
        return lora_params(settings_of(cfg, self))

    def preflight(self, cfg, prepared):
        check_lora(cfg, self)

    def train(self, mctx, plan, rows, progress=None):
        from ...methodkit.training import dpsgd_event

        cfg = mctx.cfg
        block = settings_of(cfg, self)
        result = fit_soft_prompt(cfg, block, cfg.models.local, rows, mctx.seed, dp=plan.settings,
                                 randomness=mctx.randomness, progress=progress, kind="lora", shape=lora_shape(block))
        return Trained(result.prompt, dpsgd_event(plan.settings) if plan.guarantee == "dp" else None, result.steps,
                       trained_metrics(result), result.history)


class LoRASGD(DPLoRA):
    """lora_sgd: the adapters trained without DP (no guarantee)."""

    def guarantee(self, cfg):
        return "none"

    def plan(self, cfg, n_train, delta, epsilon=None):
        name = self.spec.name
        return MethodPlan(name, "none", n_train, delta, params=self.extra_params(cfg),
                          note=f"{name} has no formal privacy guarantee: nothing was published but metrics, "
                               "and its adapter stays under private/")

    def train(self, mctx, plan, rows, progress=None):
        cfg = mctx.cfg
        block = settings_of(cfg, self)
        result = fit_nonprivate(cfg, block, cfg.models.local, rows, mctx.seed, plan.n_train, progress=progress,
                                kind="lora", shape=lora_shape(block))
        return Trained(result.prompt, None, result.steps, trained_metrics(result), result.history)


# DP-SGD's traits; the grid: Adam learning rates for adapters (smaller than a prompt's) × epochs
LORA_TRAITS = replace(DPSGD_TRAITS,
                      selection_grid=[{"lr": lr, "epochs": e} for lr in (0.0005, 0.002, 0.005) for e in (1.0, 3.0)],
                      test_settings={"r": 2, "epochs": 1, "batch_size": 8})

DP_LORA = register_method(MethodSpec(name="dp_lora", config_class=LoRAConfig, mechanism=DPLoRA(), prompt_kind="lora",
                                     label="LoRA (DP-SGD)", traits=LORA_TRAITS))
LORA_SGD = register_method(MethodSpec(name="lora_sgd", config_class=LoRAConfig, mechanism=LoRASGD(), prompt_kind="lora",
                                      label="LoRA (non-private)", traits=Traits(test_settings=LORA_TRAITS.test_settings)))
