"""prefix_dpsgd: DP prefix tuning (Li & Liang's prefixes, per-layer keys and values; the white-box
base of Privacy-Flat): Poisson sampling, per-example clipping of the whole prefix's gradient,
Gaussian noise σ·C, σ calibrated to the target ε — the soft prompt's DP-SGD path on a prefix."""

from __future__ import annotations

from pydantic import Field

from ...schema import DPSGDConfig
from .. import register_method
from ..base import MethodPlan, Trained
from ..prompt_dpsgd.method import PromptDPSGD


class PrefixDPSGDConfig(DPSGDConfig):
    """DP-SGD prefix tuning: ``n_tokens`` prefix positions at every attention layer."""

    flatness_examples: int = Field(256, ge=0, description="test examples of the flatness diagnostics (loss "
                                                            "along two directions; 0: none)")


@register_method
class PrefixDPSGD(PromptDPSGD):
    """The soft prompt's DP-SGD plan and accounting (``prompt_dpsgd``), on a prefix."""

    name = "prefix_dpsgd"
    config_class = PrefixDPSGDConfig
    prompt_kind = "prefix"
    label = "prefix tuning (DP-SGD)"

    def run_label(self, cfg):
        return "dp_prefix"

    def extra_params(self, cfg) -> dict:
        return {"prefix.n_tokens": self.settings(cfg).n_tokens}

    def preflight(self, cfg, prepared) -> None:
        """Before any budget is reserved (and in ``privprompt plan``): the classifier builds, and the
        local model takes prefixes (a model without self-attention key/value projections, or sharing
        them across layers, is refused here)."""
        from models.prompts.prefix import prefix_shape
        from models.backbones import load_backbone

        from ...errors import ConfigError

        super().preflight(cfg, prepared)
        try:
            shape = prefix_shape(load_backbone(cfg.models.local, seed=cfg.seed).model, self.settings(cfg).n_tokens)
        except ValueError as e:
            raise ConfigError(f"methods.{self.name}: {e}") from None
        self.check_model(cfg, shape[0])

    def prepare(self, ctx, progress=None) -> dict:
        """Nothing to prepare; the model checks of :meth:`preflight` (cached), as before any budget."""
        self.preflight(ctx.cfg, None)
        return {}

    def check_model(self, cfg, n_layers: int) -> None:
        """Settings checked against the model (before any budget is reserved)."""

    def diagnostics(self, ctx, prompt_path, mctx) -> dict:
        """Flatness of the published prefix on the TEST split (never training rows): loss along a
        random and an adversarial direction, and Definition 1's sharpness (Privacy-Flat Figures 1, 3)."""
        examples = self.settings(mctx.cfg).flatness_examples
        if not examples:
            return {}
        return prefix_flatness(mctx.cfg, ctx.part.test_path, prompt_path, self.run_label(mctx.cfg), examples)

    def step_additions(self, mctx, plan, rows, progress=None) -> dict:
        """Additions to the DP step (Privacy-Flat's): {"hooks": [DPStepHook], "init_prompt": tensor,
        "metrics": publishable counts, "history": private records}; {} for plain DP prefix tuning."""
        return {}

    def train(self, mctx, plan, rows, progress=None):
        from ...methodkit.training import dpsgd_event, fit_soft_prompt

        cfg = mctx.cfg
        extra = self.step_additions(mctx, plan, rows, progress)
        result = fit_soft_prompt(cfg, self.settings(cfg), cfg.models.local, rows, mctx.seed, dp=plan.settings,
                                 randomness=mctx.randomness, progress=progress, kind="prefix",
                                 hooks=extra.get("hooks", ()), init_prompt=extra.get("init_prompt"))
        metrics = {"train.steps": result.steps,
                   **extra.get("metrics", {})}
        return Trained(result.prompt, dpsgd_event(plan.settings) if plan.guarantee == "dp" else None,
                       result.steps, metrics, extra.get("history", []) + result.history)


def prefix_flatness(cfg, test_path: str, prompt_path: str, label: str, examples: int = 256) -> dict:
    import matplotlib.pyplot as plt
    import numpy as np

    from models.landscape import flatness_curves

    from ...prompts import load_prompt_file
    from ...methodkit.classifiers import classifier_for, encode_split

    clf = classifier_for(cfg, cfg.models.local)
    enc, y = encode_split(clf, test_path, cfg.data.labels, cfg.models.max_length, limit=examples,
                          rng=np.random.default_rng(cfg.seed))
    curves = flatness_curves(clf, enc, y, load_prompt_file(prompt_path), cfg.seed,
                             batch_size=cfg.models.eval_batch_size)
    metrics = {"flatness.sharpness": curves["sharpness"]}
    for kind in ("random", "adversarial"):
        metrics.update({f"flatness.{kind}.r{round(r * 100):02d}": v for r, v in zip(curves["radii"], curves[kind])})
    fig, ax = plt.subplots(figsize=(4.6, 3.4))
    for kind, style in (("random", "-"), ("adversarial", "--")):
        ax.plot(curves["radii"], curves[kind], style, marker="o", label=f"{kind} direction")
    ax.set_xlabel("perturbation ‖v‖ / ‖w‖")
    ax.set_ylabel(f"test loss ({len(y)} test examples)")
    ax.set_title(f"{label}: flatness (sharpness {curves['sharpness']:.4f})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return {"metrics": metrics, "figures": {"plots/flatness.png": fig}}


@register_method
class PrefixSGD(PrefixDPSGD):
    """prefix_sgd: non-private prefix tuning (the upper bound of the Privacy-Flat comparison; no guarantee)."""

    name = "prefix_sgd"
    config_class = PrefixDPSGDConfig
    label = "prefix tuning (non-private)"

    def guarantee(self, cfg):
        return "none"

    def run_label(self, cfg):
        return "prefix_nonprivate"

    def plan(self, cfg, n_train, delta):
        return MethodPlan(self.name, "none", n_train, delta, params=self.extra_params(cfg),
                          note=f"{self.name} has no formal privacy guarantee: nothing was published but metrics, "
                               "and its prefix stays under private/")

    def train(self, mctx, plan, rows, progress=None):
        from ...methodkit.training import fit_soft_prompt, nonprivate_steps

        cfg = mctx.cfg
        result = fit_soft_prompt(cfg, self.settings(cfg), cfg.models.local, rows, mctx.seed, progress=progress,
                                 kind="prefix", steps=nonprivate_steps(self.settings(cfg), plan.n_train))
        return Trained(result.prompt, None, result.steps, {"train.steps": result.steps}, result.history)
