"""The one method flow: any registered method, the same DAG for all of them.

    partition → prepare (public data only, cached) → [baselines: each through the lifecycle →
    evaluate → loss MIA] → the published method through the lifecycle (reserve → train → commit
    → post-process → publish) → evaluate (+ the method's variants) → loss MIA → [audit flow] →
    budget record, plots, tables.

One MLflow parent run per flow run, a child run per training / evaluation / audit task. The
flow knows no method by name: everything method-specific comes from the registry.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import flow, get_run_logger

from flows.parent_run import parent_run
from tasks import report
from tasks.config import load_config, parse_config
from tasks.lifecycle import RunOutcome, preflight, resolve_delta
from tasks.methods import get_method
from tasks.prefect_tasks import (endpoint_task, evaluate_task, loss_mia_task, partition_task, prepare_task,
                                 train_task)
from tasks.stages import model_alias
from tasks.stages import StageContext
from tasks.state import default_data_root


def partition(cfg, paths, data_root) -> dict:
    args = dict(data_config=cfg.data.model_dump(mode="json"), seed=cfg.seed,
                private_dir=str(paths.private), data_root=data_root)
    part = partition_task(**args)
    manifest = Path(part["directory"]) / "manifest.json"
    if not manifest.is_file() or "dataset_key" not in part:  # cached, but files were removed or are stale
        part = partition_task.with_options(refresh_cache=True)(**args)
    return part


def _point(name: str, accuracy: float, info: RunOutcome | None, label: str | None = None) -> dict:
    if info is None or info.prompt_path is None and info.guarantee == "none":
        return {"method": label or name, "accuracy": accuracy, "epsilon": None, "guarantee": "no training"}
    eps = info.epsilon
    return {"method": label or name, "accuracy": accuracy, "epsilon": eps,
            "guarantee": "no DP" if eps is None else "dp"}


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


@flow(name="method", log_prints=False)
def method_flow(config: dict | str, overrides: list[str] | None = None) -> dict:
    """``config``: a validated config dict, or the path of a YAML config (deployments)."""
    cfg = load_config(config, overrides) if isinstance(config, str) else parse_config(config)
    method = get_method(cfg.method)
    logger = get_run_logger()
    with parent_run(cfg, "method", cfg.method, cfg.guarantee,
                    params={"privacy.dataset_epsilon_cap": cfg.privacy.dataset_epsilon_cap}) as run:
        paths, parent, flow_run_id, summary = run.paths, run.parent, run.flow_run_id, run.summary
        part = partition(cfg, paths, default_data_root(cfg.data_root))
        delta = resolve_delta(cfg, part["n_train"])
        plan = method.plan(cfg, part["n_train"], delta)  # pure: validates the settings before any work
        parent.set_tags({"dataset.fingerprint": part["dataset_key"], "data.partition": part["fingerprint"],
                         "method.label": method.run_label(cfg)})
        parent.log_params({"privacy.target_delta": delta, "data.n_train": part["n_train"],
                           "data.n_holdout": part["n_holdout"], "data.n_test": part["n_test"], **plan.params})
        if cfg.audit.enabled:  # an audit that cannot run is refused before any training
            from tasks.audit import check_pool_size
            from tasks.data import Partition

            check_pool_size(Partition(**part), cfg.audit)
        ctx = StageContext(config=cfg.model_dump(mode="json"), state_dir=str(paths.root), partition=part,
                           parent_run_id=parent.run_id, flow_run_id=flow_run_id)

        metrics: dict[str, float] = {}
        points: list[dict] = []
        compute: dict[str, float] = {}  # seconds of model work per stage (the rest is orchestration)
        runtime: dict[str, float | str] = {}
        stage_names = getattr(method, "stage_names", {})
        results: dict[str, RunOutcome] = {}

        def run_method(name: str, prepared: dict | None = None) -> RunOutcome:
            prepared = prepared if prepared is not None else prepare_task(ctx, name)
            info = train_task(ctx, name, prepared)
            results[name] = info
            return info

        # every method's public-data preparation, then every check that needs no private data
        # (models, label words, templates, endpoints: what `privprompt plan` checks too), BEFORE any
        # method reserves budget or reads a private row: a config mistake spends nothing
        prepared_by = {name: prepare_task(ctx, name) for name in cfg.run_methods}
        preflight(cfg, prepared_by)

        # baselines first, the published method last
        for name in cfg.run_methods[:-1]:
            info = run_method(name, prepared_by[name])
            compute[f"train:{name}"] = info.compute["train"]
            model = get_method(name).published_model(cfg, {})
            acc = evaluate_task(ctx, info.prompt_path, name, info.guarantee)
            compute[f"evaluate:{name}"] = acc["compute_s"]
            audit = labelled(info.guarantee, get_method(name).reads_private_data(cfg))
            metrics[baseline_name(name, "test.accuracy", audit)] = acc["target"]
            points.append(_point(name, acc["target"], info))
            if cfg.mia.enabled and info.prompt_path is not None and get_method(name).supports_loss_mia:
                mia = loss_mia_task(ctx, info.prompt_path, name, info.guarantee, model)
                compute[f"mia:{name}"] = mia["compute_s"]
                metrics[baseline_name(name, "mia.loss.auc", True)] = mia["metrics"]["mia.loss.auc"]

        prepared = prepared_by[cfg.method]
        if prepared.get("tags"):
            parent.set_tags(prepared["tags"])
        parent.log_json({k: v for k, v in prepared.items() if k != "tags"}, "method/prepared.json")
        if "prepare" in stage_names:
            runtime[stage_names["prepare"]] = "cached" if prepared.get("cached") else prepared["prepare_s"]
        published = run_method(cfg.method, prepared)
        audit_metrics = published.audit_metrics
        metrics.update({k: v for k, v in published.train_metrics.items() if k not in audit_metrics})
        metrics.update(audit_label(audit_metrics))  # counts of the training, and labelled audit statistics
        for stage in ("train", "post_process"):
            if stage in published.compute:
                runtime[stage_names.get(stage, stage)] = published.compute[stage]
        model = method.published_model(cfg, prepared)
        acc = evaluate_task(ctx, published.prompt_path, cfg.method, published.guarantee)
        compute[f"evaluate:{cfg.method}"] = acc["compute_s"]
        accuracies = {cfg.method: acc["target"]}
        metrics["test.accuracy"] = acc["target"]
        metrics.update({f"test.accuracy.{alias}": v for alias, v in acc["per_model"].items()})
        if published.prompt_path is not None:  # test-split statistics of the prompt (flatness)
            from tasks import plots
            from tasks.methods import MethodContext
            from tasks.randomness import for_config

            diag = method.diagnostics(ctx, published.prompt_path,
                                      MethodContext(cfg, paths, prepared, for_config(cfg), cfg.seed, ctx.output_dir))
            metrics.update(diag.get("metrics", {}))
            for artifact, fig in diag.get("figures", {}).items():
                parent.log_figure(fig, artifact)
                plots.close(fig)
        cross = {model_alias(model): acc["target"]}  # the published prompt on every target (Table 3)
        for other in cfg.models.evaluate_on:
            out = evaluate_task(ctx, published.prompt_path, f"{cfg.method}@{model_alias(other)}",
                                published.guarantee, {"target": other})
            compute[f"evaluate:{cfg.method}@{model_alias(other)}"] = out["compute_s"]
            cross[model_alias(other)] = metrics[f"test.accuracy.{model_alias(other)}"] = out["target"]
        for endpoint in cfg.models.endpoints:
            out = endpoint_task(ctx, published.prompt_path, cfg.method, endpoint.model_dump())
            compute[f"evaluate:{cfg.method}@{endpoint.alias}"] = out["compute_s"]
            cross[endpoint.alias] = metrics[f"test.accuracy.{endpoint.alias}"] = out["accuracy"]
        if len(cross) > 1:
            parent.log_text("| model | test accuracy |\n|---|---:|\n" + "".join(
                f"| {k} | {v:.4f} |\n" for k, v in cross.items()), "tables/cross_model.md")
        variants = method.variants(ctx, published, prepared, run_method)
        for v in variants:
            if v.name in results:  # a variant that trained (a non-private upper bound)
                runtime[v.name] = results[v.name].compute["train"]
            out = evaluate_task(ctx, v.prompt_path, v.name, v.guarantee, {"target": v.model})
            compute[f"evaluate:{v.name}"] = out["compute_s"]
            # a variant trained on private data without DP (POST's full_pt) is a labelled audit statistic
            audit = labelled(v.guarantee, v.prompt_path is not None)
            accuracies[v.name] = metrics[baseline_name(v.name, "test.accuracy", audit)] = out["target"]
        points += [_point(cfg.method, acc["target"], published, method.label or None)]
        points += [{"method": v.label or v.name, "accuracy": accuracies[v.name], "epsilon": v.epsilon,
                    "guarantee": "dp" if v.epsilon is not None else ("no training" if v.prompt_path is None else "no DP")}
                   for v in variants]
        compute.update({f"{k}": v for k, v in runtime.items() if isinstance(v, float)})
        if stage_names:
            metrics.update({f"runtime.{k}_s": v for k, v in runtime.items() if isinstance(v, float)})
        if cfg.mia.enabled and published.prompt_path is not None and method.supports_loss_mia:
            mia = loss_mia_task(ctx, published.prompt_path, cfg.method, published.guarantee, model)
            compute[f"mia:{cfg.method}"] = mia["compute_s"]
            metrics.update(mia["metrics"])
            parent.log_file(mia["roc_plot"], "plots")
        if published.guarantee == "dp":
            spend = published.spend
            metrics.update({"privacy.epsilon": spend["epsilon"], "privacy.delta": spend["delta"],
                            "privacy.epsilon_rdp": spend["epsilon_rdp"]})
        if published.published:
            parent.log_file(published.prompt_path, "prompt")  # the DP output: published
            if published.source_prompt_path != published.prompt_path:
                parent.log_file(published.source_prompt_path, "prompt/source")

        if cfg.audit.enabled:
            from flows.audit import run_audit
            from tasks.audit import AuditTarget

            spend = published.spend or {}
            target = AuditTarget(config=ctx.config, partition=part, prompt_path=published.prompt_path,
                                 method=cfg.method, epsilon=spend.get("epsilon"), delta=spend.get("delta"),
                                 run_id=parent.run_id, flow_run_id=flow_run_id, state_dir=str(paths.root),
                                 prepared={k: v for k, v in prepared.items() if k != "tags"})
            audited = run_audit(target, cfg.audit)
            compute["audit"] = audited["wall_s"]
            metrics.update(audited["metrics"])
            summary["audit"] = audited

        from tasks.data import Partition

        budget = report.budget_record(cfg, Partition(**part), paths, published, plan.note, [], parent.run_id)
        parent.log_json(budget, "privacy/budget.json")
        report.log_privacy_utility(parent, points, f"{cfg.data.name}: test accuracy by method")
        for name, table in method.tables(accuracies, published, variants).items():
            parent.log_text(table, f"tables/{name}.md")
        if runtime:
            parent.log_text(report.runtime_table(runtime), "tables/runtime.md")
        parent.log_metrics(metrics)
        summary.update({"metrics": metrics, "budget": budget, "guarantee": published.guarantee, "compute_seconds": compute, "runtime": runtime,
                        "accuracy": accuracies,
                        "published": budget["published"]})
    logger.info("run record: %s", json.dumps({k: float(f"{v:.4g}") for k, v in metrics.items()}))
    return summary
