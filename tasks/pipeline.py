"""What a method flow assembles from its tasks' results, the same for every method: the run's
plan (δ and the published method's plan, once), how a baseline's or a variant's numbers are named
on the parent run, the privacy–utility points, the cross-model and runtime tables, the budget
record and the summary the flow returns.

:class:`RunReport` collects as the flow's tasks return (in the flow's order, which is the order
of the parent's metrics, the runtime table and the compute summary) and writes the parent run's
record once, at the end (:meth:`RunReport.record`). The flow itself (``flows/method_flow.py``)
only calls tasks in order and hands their results here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import plots, report, statement
from .methods.base import run_label
from .stages import model_alias

if TYPE_CHECKING:
    from .config import PrivPromptConfig
    from .outcome import RunOutcome
    from privacy.plan import RunPlan

    from .methods.base import MethodSpec, Variant
    from .record import RunRecord
    from .stages import StageContext


# ---- names on the parent run (../shared/RUN_RECORD.md) ----------------------------------------

def labelled(guarantee: str, reads_private: bool) -> bool:
    """Whether a baseline's (or variant's) numbers must be labelled as audit statistics on the
    parent: it read private training data without a DP guarantee of its own (``none``, ``ldp``).
    Such numbers are shown only as ``audit.baseline.<name>.<metric>``; a baseline that reads no
    private training data (zero-shot), or one with its own DP spend in the ledger, keeps
    ``test.accuracy.<name>`` (../shared/RUN_RECORD.md)."""
    return reads_private and guarantee != "dp"


def baseline_name(name: str, metric: str, audit: bool) -> str:
    """The parent's name of baseline ``name``'s ``metric`` (``test.accuracy``, ``mia.loss.auc``)."""
    if audit or metric != "test.accuracy":  # an attack on training records is an audit statistic whatever it attacks
        return f"audit.baseline.{name}.{metric}"
    return f"test.accuracy.{name}"


def audit_label(metrics: dict[str, float]) -> dict[str, float]:
    """Audit statistics of private data under ``audit.*`` / ``mia.*`` whatever a method named them."""
    return {k if k.startswith(("audit.", "mia.")) else f"audit.{k}": v for k, v in metrics.items()}


def point(name: str, accuracy: float, outcome: RunOutcome | None, label: str | None = None) -> dict:
    """One method's point of the privacy–utility plot."""
    if outcome is None or outcome.prompt_path is None and outcome.guarantee == "none":
        return {"method": label or name, "accuracy": accuracy, "epsilon": None, "guarantee": "no training"}
    eps = outcome.epsilon
    return {"method": label or name, "accuracy": accuracy, "epsilon": eps,
            "guarantee": "no DP" if eps is None else "dp"}


def variant_point(v: Variant, accuracy: float) -> dict:
    return {"method": v.label or v.name, "accuracy": accuracy, "epsilon": v.epsilon,
            "guarantee": "dp" if v.epsilon is not None else ("no training" if v.prompt_path is None else "no DP")}


def cross_model_table(cross: dict[str, float]) -> str:
    """The published prompt's test accuracy on every target model (``tables/cross_model.md``)."""
    return "| model | test accuracy |\n|---|---:|\n" + "".join(f"| {k} | {v:.4f} |\n" for k, v in cross.items())


# ---- the run's plan, once --------------------------------------------------------------------

@dataclass(frozen=True)
class FlowPlan:
    """The flow's plans, computed once before any work (``tasks.run_plan.plan_for``) and handed to
    the tasks: δ of the run, each run method's :class:`privacy.plan.RunPlan` and the method that
    runs it (its spec, or its selection: ``tasks.selected.method_for``), resolved once."""

    delta: float
    plans: dict
    method: str
    methods: dict = field(default_factory=dict)
    # what the parent publishes of the plan once the published method's run has committed its
    # charge (the released sizes for a dp run, and q = B/ñ, steps, σ: functions of them)
    published_params: dict = field(default_factory=dict)

    @property
    def plan(self) -> "RunPlan":
        """The published method's plan."""
        return self.plans[self.method]


def plan_run(ctx: StageContext, parent: RunRecord) -> FlowPlan:
    """The run's δ and every run method's plan (pure: validates the settings before any work),
    the published method's first, on the parent's tags and params; an audit that cannot run is
    refused here, before any training."""
    from privacy.plan import thawed

    from .run_plan import plan_for, resolve_delta
    from .selected import method_for

    cfg, part = ctx.cfg, ctx.partition
    methods = {name: method_for(cfg, name) for name in cfg.run_methods}
    sizes = ctx.part.sizes  # the released sizes (never the exact ones: tasks.data.ReleasedSizes)
    delta = resolve_delta(cfg, sizes.n_for_delta)
    plan = plan_for(cfg, cfg.method, sizes, delta)
    parent.set_tags({"dataset.fingerprint": ctx.part.published_key, "data.partition": part["fingerprint"],
                     "method.label": run_label(methods[cfg.method], cfg)})
    # δ only (a 1-2-5 rounding of 0.1/(ñ + 3σ), fixed by the partition's one draw): the released
    # sizes and what the plan derives from them (q = B/ñ, steps, σ) wait for the charge that covers
    # their release — a run refused before it (the audit pool, a preflight check, the budget) has
    # published none of them (RunReport.released logs them)
    parent.log_params({"privacy.target_delta": delta, "selection.enabled": cfg.selection.enabled})
    if cfg.audit.enabled:
        from .audit import check_pool_size

        check_pool_size(ctx.part, cfg.audit)
    plans = {name: plan if name == cfg.method else plan_for(cfg, name, sizes, delta) for name in cfg.run_methods}
    return FlowPlan(delta, plans, cfg.method, methods=methods,
                    published_params={**(sizes.params() if plan.guarantee == "dp" else {}), **thawed(plan.params)})


def runs_loss_mia(cfg: PrivPromptConfig, method: "MethodSpec", outcome: RunOutcome) -> bool:
    """Whether the flow attacks ``method``'s prompt with the loss-threshold MIA."""
    return cfg.mia.enabled and outcome.prompt_path is not None and method.traits.supports_loss_mia


def audit_target(ctx: StageContext, published: RunOutcome, prepared: dict):
    """The audit flow's view of the published method's run."""
    from .audit import AuditTarget

    spend = published.spend or {}
    # the canaries are single records: a record-level run charged per person is audited against its
    # per-record ε (the tighter claim; its per-person charge is larger)
    claimed = spend.get("epsilon_per_record", spend.get("epsilon"))
    return AuditTarget(config=ctx.config, partition=ctx.partition, prompt_path=published.prompt_path,
                       method=ctx.cfg.method, epsilon=claimed, delta=spend.get("delta"),
                       run_id=ctx.parent_run_id, flow_run_id=ctx.flow_run_id, state_dir=ctx.state_dir,
                       prepared={k: v for k, v in prepared.items() if k != "tags"})


# ---- the run's record, collected as the tasks return -------------------------------------------

def variants_table(method: MethodSpec, accuracies: dict[str, float], published: RunOutcome,
                   variants: list[Variant]) -> str:
    """The published method beside its variants (POST's table: Full ZS, Compressed PT, Direct
    Transfer, Full PT): test accuracy and what each one's privacy is."""
    def privacy(guarantee: str, epsilon: float | None, prompt_path: str | None) -> str:
        if prompt_path is None:
            return "-"  # no prompt: nothing learnt from private data
        if guarantee == "none":
            return "none (upper bound)" if published.guarantee != "none" else "none"
        return f"ε={epsilon:.2f}" if epsilon is not None else guarantee

    rows = ["| method | test accuracy | privacy |", "|---|---:|---|"]
    for v in variants:
        if v.name in accuracies:
            rows.append(f"| {v.label or v.name} | {accuracies[v.name]:.4f} | {privacy(v.guarantee, v.epsilon, v.prompt_path)} |")
    if method.name in accuracies:
        rows.append(f"| {method.label or method.name} | {accuracies[method.name]:.4f} | "
                    f"{privacy(published.guarantee, published.epsilon, 'its own')} |")
    return "\n".join(rows) + "\n"


@dataclass
class RunReport:
    """The parent run's metrics, points, tables and summary of one method flow run."""

    cfg: PrivPromptConfig
    method: MethodSpec
    parent: RunRecord
    metrics: dict[str, float] = field(default_factory=dict)
    points: list[dict] = field(default_factory=list)
    compute: dict[str, float] = field(default_factory=dict)  # seconds of model work per stage (the rest is orchestration)
    runtime: dict[str, float | str] = field(default_factory=dict)
    accuracies: dict[str, float] = field(default_factory=dict)
    cross: dict[str, float] = field(default_factory=dict)  # the published prompt on every target (Table 3)
    variants: list = field(default_factory=list)
    audit: dict | None = None

    @property
    def stage_names(self) -> dict[str, str]:
        return dict(self.method.traits.stage_names)

    def baseline(self, method: MethodSpec, outcome: RunOutcome, acc: dict, mia: dict | None) -> None:
        """A baseline's training, evaluation and (when run) loss MIA."""
        name = method.name
        self.compute[f"train:{name}"] = outcome.compute["train"]
        self.compute[f"evaluate:{name}"] = acc["compute_s"]
        audit = labelled(outcome.guarantee, method.traits.reads_private)
        self.metrics[baseline_name(name, "test.accuracy", audit)] = acc["target"]
        self.points.append(point(name, acc["target"], outcome))
        if mia is not None:
            self.compute[f"mia:{name}"] = mia["compute_s"]
            if "mia.loss.auc" in mia["metrics"]:  # (absent when the attack did not run: an exactly empty split)
                self.metrics[baseline_name(name, "mia.loss.auc", True)] = mia["metrics"]["mia.loss.auc"]

    def prepared(self, prepared: dict) -> None:
        """The published method's public-data preparation, on the parent."""
        if prepared.get("tags"):
            self.parent.set_tags(prepared["tags"])
        self.parent.log_json({k: v for k, v in prepared.items() if k != "tags"}, "method/prepared.json")
        if "prepare" in self.stage_names:
            self.runtime[self.stage_names["prepare"]] = "cached" if prepared.get("cached") else prepared["prepare_s"]

    def trained(self, published: RunOutcome) -> None:
        """The published method's training: its counts, and its audit statistics labelled."""
        audit_metrics = published.audit_metrics
        self.metrics.update({k: v for k, v in published.train_metrics.items() if k not in audit_metrics})
        self.metrics.update(audit_label(audit_metrics))
        sel = self.cfg.selection
        hidden = {"train"} if sel.enabled and sel.mode == "random_stopping" else set()  # its time grows with K
        for stage in ("train", "post_process"):
            if stage in published.compute and stage not in hidden:
                self.runtime[self.stage_names.get(stage, stage)] = published.compute[stage]

    def evaluated(self, acc: dict, model: str) -> None:
        """The published prompt's test accuracy on the method's own model (and its per-model aliases)."""
        self.compute[f"evaluate:{self.cfg.method}"] = acc["compute_s"]
        self.accuracies[self.cfg.method] = acc["target"]
        self.metrics["test.accuracy"] = acc["target"]
        self.metrics.update({f"test.accuracy.{alias}": v for alias, v in acc["per_model"].items()})
        self.metrics.update(acc.get("by_class") or {})
        self.cross[model_alias(model)] = acc["target"]

    def diagnostics(self, diag: dict) -> None:
        """Test-split statistics of the published prompt (flatness)."""
        self.metrics.update(diag.get("metrics", {}))
        for artifact, fig in diag.get("figures", {}).items():
            self.parent.log_figure(fig, artifact)
            plots.close(fig)

    def other_model(self, alias: str, accuracy: float, compute_s: float) -> None:
        """The published prompt on another target model (``models.evaluate_on``) or an endpoint."""
        self.compute[f"evaluate:{self.cfg.method}@{alias}"] = compute_s
        self.cross[alias] = self.metrics[f"test.accuracy.{alias}"] = accuracy

    def variant_results(self, variants: list[Variant], evaluated: list[dict],
                        trained: dict[str, RunOutcome]) -> None:
        """The method's variants, each evaluated (``trained``: the ones that trained, a non-private
        upper bound); then every point of the plot and the runtime of each stage."""
        self.variants = list(variants)
        for v, out in zip(variants, evaluated):
            if v.name in trained:
                self.runtime[v.name] = trained[v.name].compute["train"]
            self.compute[f"evaluate:{v.name}"] = out["compute_s"]
            # a variant trained on private data without DP (POST's full_pt) is a labelled audit statistic
            audit = labelled(v.guarantee, v.prompt_path is not None)
            self.accuracies[v.name] = self.metrics[baseline_name(v.name, "test.accuracy", audit)] = out["target"]

    def points_and_runtime(self, published: RunOutcome) -> None:
        """The published method's and its variants' points, and the runtime of each stage."""
        self.points.append(point(self.cfg.method, self.accuracies[self.cfg.method], published,
                                 self.method.label or None))
        self.points += [variant_point(v, self.accuracies[v.name]) for v in self.variants]
        self.compute.update({f"{k}": v for k, v in self.runtime.items() if isinstance(v, float)})
        if self.stage_names:
            self.metrics.update({f"runtime.{k}_s": v for k, v in self.runtime.items() if isinstance(v, float)})

    def loss_mia(self, mia: dict) -> None:
        """The published prompt's loss-threshold MIA (audit statistics)."""
        self.compute[f"mia:{self.cfg.method}"] = mia["compute_s"]
        self.metrics.update(mia["metrics"])
        if mia["roc_plot"]:  # (none when the attack did not run: an exactly empty split)
            self.parent.log_file(mia["roc_plot"], "plots")

    def released(self, published: RunOutcome, run_plan: FlowPlan) -> None:
        """The published method's spend on the parent, the plan's parameters (the released sizes
        among them: its charge is committed now), and its output when the publish rule allows."""
        self.parent.log_params(run_plan.published_params)
        if published.guarantee == "dp":
            spend = published.spend
            self.metrics.update({"privacy.epsilon": spend["epsilon"], "privacy.delta": spend["delta"],
                                 "privacy.epsilon_rdp": spend["epsilon_rdp"]})
            if spend.get("epsilon_per_record") is not None:  # charged per person (group privacy): the per-record ε
                self.metrics["privacy.epsilon_per_record"] = spend["epsilon_per_record"]
            if published.params.get("privacy.guarantee_epsilon") is not None:  # the proven bound (privacy/plan.py)
                self.metrics["privacy.guarantee_epsilon"] = published.params["privacy.guarantee_epsilon"]
        if published.published:
            self.parent.log_file(published.prompt_path, "prompt")  # the DP output: published
            if published.source_prompt_path != published.prompt_path:
                self.parent.log_file(published.source_prompt_path, "prompt/source")

    def audited(self, audited: dict) -> None:
        self.compute["audit"] = audited["wall_s"]
        self.metrics.update(audited["metrics"])
        self.audit = audited

    def observe_speeds(self, ctx: StageContext, published: RunOutcome, run_plan: FlowPlan) -> None:
        """Each run method's seconds per example on this machine, for the next plans' time estimates
        (``tasks.estimate.record_observed``): its training time over planned steps × expected batch,
        its evaluation over the released test size (per record under a person unit, as the plan
        counts them). Advisory: a failure here never fails the run."""
        from . import estimate as est

        cfg, sizes = self.cfg, ctx.part.sizes
        per_person = getattr(sizes, "unit", "record") != "record"
        rows = float(cfg.data.max_records_per_unit or 0) if per_person else 1.0
        if not rows or not sizes.n_test:
            return
        try:
            cache = est.state_cache(ctx.paths.root)  # what a plan on this state folder reads
            for name, plan in run_plan.plans.items():
                method = run_plan.methods.get(name)
                if method is None or "selection" in plan.settings:  # a selection's trials: no one shape
                    continue
                train = published.compute.get("train") if name == cfg.method else self.compute.get(f"train:{name}")
                evaluate = self.compute.get(f"evaluate:{name}")
                steps, batch = plan.settings.get("steps"), plan.settings.get("expected_batch")
                source = method.extras.source_model(cfg, {})
                train_s = train / (float(steps) * float(batch) * rows) if train and steps and batch else None
                eval_s = evaluate / (sizes.n_test * rows) if evaluate else None
                est.record_observed(name, source, cfg.models.max_length, batch or est.PROBE_BATCH,
                                    cfg.models.eval_batch_size, cfg.models.placement_of(source), train_s, eval_s,
                                    cache)
        except Exception:  # noqa: BLE001 - the estimate is advisory
            return

    def record(self, ctx: StageContext, published: RunOutcome, run_plan: FlowPlan) -> dict[str, Any]:
        """Write the parent's record (budget record, plot, tables, metrics); returns the summary's
        fields."""
        cfg, parent = self.cfg, self.parent
        if len(self.cross) > 1:
            parent.log_text(cross_model_table(self.cross), "tables/cross_model.md")
        budget = report.budget_record(cfg, ctx.part, ctx.paths, published, run_plan.plan.note, [], parent.run_id)
        parent.log_json(budget, "privacy/budget.json")
        report.log_privacy_utility(parent, self.points, f"{cfg.data.name}: test accuracy by method", cfg.data.charge_unit)
        if self.variants:
            parent.log_text(variants_table(self.method, self.accuracies, published, self.variants),
                            "tables/accuracy.md")
        if self.runtime:
            parent.log_text(report.runtime_table(self.runtime), "tables/runtime.md")
        parent.log_metrics(self.metrics)
        self.observe_speeds(ctx, published, run_plan)
        summary: dict[str, Any] = {} if self.audit is None else {"audit": self.audit}
        summary.update({"metrics": self.metrics, "budget": budget, "guarantee": published.guarantee,
                        "compute_seconds": self.compute, "runtime": self.runtime, "accuracy": self.accuracies,
                        "published": budget["published"], "dataset": cfg.data.name, "unit": cfg.data.charge_unit,
                        "accountant": budget.get("accountant"), "registered_model": published.registered_model,
                        "method": cfg.method})
        summary["warnings"] = self.warnings(published)
        if summary["warnings"]:
            parent.set_tags({"warning": " | ".join(summary["warnings"])})
        # the run page's description, read at the top of the MLflow UI: ε with its unit and δ
        parent.set_tags({"mlflow.note.content": statement.run_markdown(summary)})
        if published.registered_model:  # its card again, now with the run's test numbers and warnings
            from .model_card import write_card
            from .registry_model import resolve_version

            write_card(parent.mlflow, resolve_version(parent.mlflow, published.registered_model))
        return summary

    def warnings(self, published: RunOutcome) -> list[str]:
        """The run summary's warnings (also the parent's ``warning`` tag and the report): the released
        comparison with no prompt on the holdout (a fallback, a loss published anyway, an inconclusive
        one: :meth:`released_comparison`); a published DP prompt whose test accuracy is below no prompt's on the same test split (``zero_shot`` run
        beside it: both already published; tag ``result.below_no_prompt``); a selection whose published
        prompt's RELEASED holdout score is below the released "no prompt" reference (with
        ``selection.fallback_to_no_prompt: false``), whose best trial was dropped for no prompt for that
        reason (both DP outputs: tasks/selection.py), or some of whose candidates failed (a count)."""
        from .selection import below_no_prompt, failed_note, fallback_note

        notes = [self.released_comparison(published), self.below_no_prompt_on_test(published)]
        if self.cfg.selection.enabled:
            notes += [below_no_prompt(published.train_metrics),
                      fallback_note(published.train_metrics, published.params.get("selection.best_trial")),
                      failed_note(published.train_metrics)]
        return [n for n in notes if n is not None]

    def released_comparison(self, published: RunOutcome) -> str | None:
        """The line about the run's released comparison with no prompt on the holdout (tasks/no_prompt.py:
        it fell back to no prompt, it lost and was published anyway, or it is inconclusive), its tags on
        the parent (``result.fallback_to_no_prompt`` / ``result.below_no_prompt``)."""
        from .no_prompt import note

        line, tags = note(published.train_metrics)
        if tags:
            self.parent.set_tags(tags)
        return line

    def below_no_prompt_on_test(self, published: RunOutcome) -> str | None:
        """The warning when the published prompt scores below a no-prompt reference on the test split
        (a method's declared ``ReferenceAccuracy``, run beside it as a baseline: ``zero_shot`` with
        ``methods.zero_shot.enabled``); None when it does not, or when none ran."""
        from .comparison import report_declarations
        from .methods.base import ReferenceAccuracy

        acc = self.metrics.get("test.accuracy")
        if published.guarantee != "dp" or published.prompt_path is None or acc is None:
            return None
        refs = [r for r in report_declarations()[1] if isinstance(r, ReferenceAccuracy)]
        worse = [(r.key, self.metrics[f"test.accuracy.{r.key}"]) for r in refs
                 if self.metrics.get(f"test.accuracy.{r.key}", -1.0) > acc]
        if not worse:
            return None
        self.parent.set_tags({"result.below_no_prompt": "true"})
        name, ref = worse[0]
        return (f"the published prompt's test accuracy {acc:.4f} is below no prompt's {ref:.4f} ({name}, the "
                "same test split): the model without a prompt serves better; do not deploy this prompt")
