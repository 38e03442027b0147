"""The mechanisms and declarations several method packages share (nothing is registered here: a
package registers its own :class:`~tasks.methods.base.MethodSpec`, with its name, config block and
label):

* :class:`SoftPromptDPSGD` — a soft prompt trained with DP-SGD on the frozen local model (Poisson
  sampling of examples or units, per-example clipping, Gaussian noise σ·C, σ calibrated to the
  target ε): ``prompt_dpsgd``, and below :class:`PrefixDPSGDMethod`;
* :class:`PrefixDPSGDMethod` — the same DP-SGD path on a prefix (Li & Liang's per-layer keys and
  values), with flatness diagnostics of the published prefix on the test split and the report
  sections they feed: ``prefix_dpsgd`` / ``prefix_sgd`` and Privacy-Flat, which adds its step
  hooks through :meth:`PrefixDPSGDMethod.step_additions`;
* :class:`NonPrivateSoftPrompt` — non-private soft-prompt tuning (a baseline and upper bound,
  no guarantee), registered as ``prompt_sgd``; POST's Full PT runs it through the lifecycle.
"""

from __future__ import annotations

from pydantic import Field

from ..methods.base import (Extras, Mechanism, MethodPlan, Report, ReportArtifact, ReportMetric, SummaryColumn, Trained,
                            Traits, budget, dp_unless_debug, settings_of)
from ..schema import DPSGDConfig


# DP-SGD's traits: Poisson sampling of units, one clipped gradient per unit
# (models.dp_prompt_training); its selection grid: learning rate × epochs around the quickstart's
# (lr 0.05, 2 epochs)
DPSGD_TRAITS = Traits(unit_level=True, neighbour_statistics=("clipped_gradient_sum",),
                      selection_grid=[{"lr": lr, "epochs": epochs} for lr in (0.01, 0.05, 0.2) for epochs in (1.0, 3.0)],
                      test_settings={"n_tokens": 2, "epochs": 1, "batch_size": 8})


class SoftPromptDPSGD(Mechanism):
    """DP-SGD soft-prompt tuning: its plan (σ for the target ε over the released n), training and
    accounting, with the settings of its spec's block (a ``DPSGDConfig``)."""

    def guarantee(self, cfg):
        return dp_unless_debug(cfg)

    def plan(self, cfg, n_train, delta, epsilon=None):
        from .training import dpsgd_event, dpsgd_params, dpsgd_settings

        settings = dpsgd_settings(settings_of(cfg, self), n_train, budget(cfg, epsilon), delta,
                                  cfg.data.privacy_unit)
        guarantee = self.guarantee(cfg)
        return MethodPlan(self.spec.name, guarantee, n_train, delta,
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
        from .training import dpsgd_event, fit_soft_prompt, trained_metrics

        cfg = mctx.cfg
        result = fit_soft_prompt(cfg, settings_of(cfg, self), cfg.models.local, rows, mctx.seed,
                                 dp=plan.settings, randomness=mctx.randomness, progress=progress)
        metrics = trained_metrics(result)
        return Trained(result.prompt, dpsgd_event(plan.settings) if plan.guarantee == "dp" else None,
                       result.steps, metrics, result.history)


# ---- what the prefix methods add to the comparison report (tasks/comparison.py reads it) -----------

def flatness_figure(rows: list[dict], title: str = "flatness of the published prompts (test split)"):
    """Test loss along a random and an adversarial direction (Privacy-Flat Figures 1, 3), the
    mean over runs per method label; None when no run logged flatness curves."""
    from ..plots import plt

    rows = [r for r in rows if r.get("flatness")]
    if not rows:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(9.2, 3.6), sharey=True)
    for ax, kind in zip(axes, ("random", "adversarial")):
        for label in sorted({r["method"] for r in rows}):
            curves = [r["flatness"] for r in rows if r["method"] == label]
            keys = sorted(k for k in curves[0] if k.startswith(f"flatness.{kind}.r"))
            xs = [int(k.rsplit(".r", 1)[1]) / 100 for k in keys]
            ys = [sum(c[k] for c in curves if k in c) / len(curves) for k in keys]
            ax.plot(xs, ys, marker="o", label=f"{label} (n={len(curves)})")
        ax.set_xlabel("perturbation ‖v‖ / ‖w‖")
        ax.set_title(f"{kind} direction", fontsize=9)
    axes[0].set_ylabel("test loss (test split)")
    axes[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def adversarial_loss_at_30(row: dict) -> float | None:
    """A run's test loss at 0.3‖w‖ along the adversarial direction (None where not logged)."""
    return row.get("flatness", {}).get("flatness.adversarial.r30")


def dp_prefix_label(cfg) -> str:
    """Every run of DP prefix tuning is one rung of the Privacy-Flat ladder: ``dp_prefix``."""
    return "dp_prefix"


class PrefixDPSGDConfig(DPSGDConfig):
    """DP-SGD prefix tuning: ``n_tokens`` prefix positions at every attention layer."""

    flatness_examples: int = Field(256, ge=0, description="test examples of the flatness diagnostics (loss "
                                                            "along two directions; 0: none)")


# what the prefix methods add to the comparison report: their flatness curves
PREFIX_REPORT = Report(metrics=(ReportMetric("flatness", prefix="flatness."),),
                       sections=(SummaryColumn("test loss, adversarial 0.3‖w‖", adversarial_loss_at_30),
                                 ReportArtifact("report/flatness.png", flatness_figure)),
                       run_label=dp_prefix_label)


class PrefixDPSGDMethod(SoftPromptDPSGD):
    """The soft prompt's DP-SGD plan and accounting, on a prefix: whole-prefix per-example
    clipping, with the settings of its spec's block (a :class:`PrefixDPSGDConfig`). A subclass may
    add to the DP step (:meth:`step_additions`) and check the model's shape (:meth:`check_model`);
    its spec declares ``prompt_kind="prefix"``, :data:`PREFIX_REPORT` and :func:`prefix_extras`."""

    def extra_params(self, cfg) -> dict:
        return {"prefix.n_tokens": settings_of(cfg, self).n_tokens}

    def preflight(self, cfg, prepared) -> None:
        """Before any budget is reserved (and in ``privprompt plan``): the classifier builds, and the
        local model takes prefixes (a model without self-attention key/value projections, or sharing
        them across layers, is refused here)."""
        from models.prompts.prefix import prefix_shape
        from models.backbones import load_backbone

        from ..errors import ConfigError

        super().preflight(cfg, prepared)
        try:
            shape = prefix_shape(load_backbone(cfg.models.local, seed=cfg.seed,
                                               placement=cfg.models.placement_of(cfg.models.local)).model,
                                 settings_of(cfg, self).n_tokens)
        except ValueError as e:
            raise ConfigError(f"methods.{self.spec.name}: {e}") from None
        self.check_model(cfg, shape[0])

    def check_model(self, cfg, n_layers: int) -> None:
        """Settings checked against the model (before any budget is reserved)."""

    def step_additions(self, mctx, plan, rows, progress=None) -> dict:
        """Additions to the DP step (Privacy-Flat's): {"hooks": [DPStepHook], "init_prompt": tensor,
        "metrics": publishable counts, "history": private records}; {} for plain DP prefix tuning."""
        return {}

    def train(self, mctx, plan, rows, progress=None):
        from .training import dpsgd_event, fit_soft_prompt, trained_metrics

        cfg = mctx.cfg
        extra = self.step_additions(mctx, plan, rows, progress)
        result = fit_soft_prompt(cfg, settings_of(cfg, self), cfg.models.local, rows, mctx.seed, dp=plan.settings,
                                 randomness=mctx.randomness, progress=progress, kind="prefix",
                                 hooks=extra.get("hooks", ()), init_prompt=extra.get("init_prompt"))
        metrics = {**trained_metrics(result), **extra.get("metrics", {})}
        return Trained(result.prompt, dpsgd_event(plan.settings) if plan.guarantee == "dp" else None,
                       result.steps, metrics, extra.get("history", []) + result.history)


def prefix_extras(name: str, report: Report = PREFIX_REPORT, **more) -> Extras:
    """The prefix methods' extra: flatness of the published prefix on the TEST split (never training
    rows) — loss along a random and an adversarial direction, and Definition 1's sharpness
    (Privacy-Flat Figures 1, 3) — with ``methods.<name>.flatness_examples`` test rows, titled with the
    run's label under ``report``; ``more``: the method's other extras."""
    def diagnostics(ctx, prompt_path, mctx) -> dict:
        cfg = mctx.cfg
        examples = getattr(cfg.methods, name).flatness_examples
        if not examples:
            return {}
        label = report.run_label(cfg) if report.run_label is not None else name
        return prefix_flatness(cfg, ctx.part.test_path, prompt_path, label, examples)

    return Extras(diagnostics=diagnostics, **more)


def prefix_flatness(cfg, test_path: str, prompt_path: str, label: str, examples: int = 256) -> dict:
    """``flatness.*`` metrics and ``plots/flatness.png`` of the prefix at ``prompt_path`` on
    ``examples`` rows of the test split."""
    import numpy as np

    from models.landscape import flatness_curves

    from ..plots import plt
    from ..prompts import load_prompt_file
    from .classifiers import classifier_for, encode_split

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


NON_PRIVATE_SOFT_PROMPT = "prompt_sgd"  # the name tasks/methods/prompt_sgd/ registers it under


class NonPrivateSoftPrompt(Mechanism):
    """Non-private soft-prompt tuning (a baseline and an upper bound; no guarantee): the toolkit's
    non-private trainer on ``models.local`` with the settings of ``methods.prompt_sgd``.
    ``tasks/methods/prompt_sgd/`` registers it as :data:`NON_PRIVATE_SOFT_PROMPT`; POST's Full PT
    runs it through the lifecycle by this mechanism (so the lifecycle records its non-private use
    of the private rows in the ledger, as for any run), never by another package's name."""

    def guarantee(self, cfg):
        return "none"

    def plan(self, cfg, n_train, delta, epsilon=None):
        name = self.spec.name
        return MethodPlan(name, "none", n_train, delta,
                          note=f"{name} has no formal privacy guarantee: nothing was published but "
                               "metrics, and its prompt stays under private/")

    def train(self, mctx, plan, rows, progress=None):
        from .training import fit_nonprivate, trained_metrics

        cfg = mctx.cfg
        result = fit_nonprivate(cfg, settings_of(cfg, self), cfg.models.local, rows, mctx.seed, plan.n_train,
                                progress=progress)
        return Trained(result.prompt, None, result.steps, trained_metrics(result), result.history)
