"""The one method flow: any registered method, the same graph for all of them.

    partition → plan (δ and the published method's plan, once) → prepare all (public data only,
    cached) → preflight (every check that needs no private data) → baselines (each through the
    lifecycle → evaluate → loss MIA) → the published method through the lifecycle (reserve →
    train → commit → post-process → publish) → evaluate (other models, endpoints, the method's
    variants) → loss MIA → [audit flow] → record (budget record, plots, tables, metrics).

One MLflow parent run per flow run, a child run per training / evaluation / audit task. The
flow knows no method by name: everything method-specific comes from the registry; what the
parent run shows is assembled by :class:`tasks.pipeline.RunReport`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from prefect import flow, get_run_logger

from flows.parent_run import parent_run
from tasks import pipeline, statement
from tasks.config import ParsedConfig, PrivPromptConfig, load_config, parse_config
from tasks.charge import check_budget, refusals_to_operator, resolve_partition
from tasks.method_checks import guarantee_of
from tasks.methods import MethodSpec
from tasks.outcome import RunOutcome
from tasks.preflight import preflight
from tasks.run_plan import plan_for
from tasks.prefect_tasks import (endpoint_task, evaluate_task, loss_mia_task, partition_task, prepare_task,
                                 train_task)
from tasks.stages import StageContext, model_alias
from tasks.data import partition_notes
from tasks.state import default_data_root, operator_note


def partition(cfg, paths, data_root) -> dict:
    args = dict(data_config=cfg.data, seed=cfg.seed,
                private_dir=str(paths.private), data_root=data_root)
    part = partition_task(**args)
    manifest = Path(part["directory"]) / "manifest.json"
    if not manifest.is_file() or not part.get("source_key"):  # cached, but files were removed or are stale
        part = partition_task.with_options(refresh_cache=True)(**args)
        manifest = Path(part["directory"]) / "manifest.json"
    # the partition as written under private/ (the task's persisted result holds no size)
    return json.loads(manifest.read_text())


def tell_operator(paths, cfg, part) -> None:
    """What the partition left out or holds few of: exact counts, for the operator's terminal only."""
    for line in partition_notes(cfg.data, part):
        operator_note(paths, line)


def run_baseline(ctx: StageContext, rec: pipeline.RunReport, method: MethodSpec, out: RunOutcome) -> None:
    """A baseline's prompt: evaluated, and attacked with the loss MIA."""
    name = method.name
    acc = evaluate_task(ctx, out.prompt_path, name, out.guarantee)
    model = method.extras.published_model(ctx.cfg, {})
    mia = (loss_mia_task(ctx, out.prompt_path, name, out.guarantee, model)
           if pipeline.runs_loss_mia(ctx.cfg, method, out) else None)
    rec.baseline(method, out, acc, mia)


def evaluate_published(ctx: StageContext, rec: pipeline.RunReport, published: RunOutcome, prepared: dict) -> None:
    """The published prompt on its model (+ test-split diagnostics), every other target model, and
    every endpoint."""
    cfg, method = ctx.cfg, rec.method
    acc = evaluate_task(ctx, published.prompt_path, cfg.method, published.guarantee)
    rec.evaluated(acc, method.extras.published_model(cfg, prepared))
    if published.prompt_path is not None:  # test-split statistics of the prompt (flatness)
        rec.diagnostics(method.extras.diagnostics(ctx, published.prompt_path, ctx.method_context(prepared)))
    for other in cfg.models.evaluate_on:
        out = evaluate_task(ctx, published.prompt_path, f"{cfg.method}@{model_alias(other)}", published.guarantee,
                            {"target": other})
        rec.other_model(model_alias(other), out["target"], out["compute_s"])
    for endpoint in cfg.models.endpoints:
        out = endpoint_task(ctx, published.prompt_path, cfg.method, endpoint.model_dump())
        rec.other_model(endpoint.alias, out["accuracy"], out["compute_s"])


def door_inputs(ctx: StageContext, name: str, prepared: dict | None, prepared_by: dict) -> tuple[StageContext, dict]:
    """(context, ``prepare`` output) method ``name`` trains with: for a run method the output the flow
    checked (the door skips those checks), else ``prepared`` or a fresh ``prepare``, which the door checks."""
    if prepared is None:
        prepared = prepared_by[name] if name in prepared_by else prepare_task(ctx, name)
    return (ctx if prepared is prepared_by.get(name) else dataclasses.replace(ctx, preflighted=())), prepared


def publish_statement(summary: dict) -> None:
    """The flow run's markdown artifact in Prefect: ε with its unit, δ and accountant, the test
    accuracies, released scores, warnings and the registered model (what the MLflow run's description
    says; public numbers only: :func:`tasks.statement.run_markdown`)."""
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(markdown=statement.run_markdown(summary), key="privprompt-run",
                             description="privacy statement (ε, unit, δ, accountant) and result of this run")


def parsed_config(config: dict | str | PrivPromptConfig, overrides: list[str] | None = None) -> PrivPromptConfig:
    """The one parse of a flow's config: a parsed config as it is (a sweep's variant, parsed when
    the sweep validated it), a dict parsed here, or a YAML file's path (deployments) loaded with
    its ``overrides``."""
    if isinstance(config, PrivPromptConfig):
        return config
    return load_config(config, overrides) if isinstance(config, str) else parse_config(config)


@flow(name="method", log_prints=False)
def method_flow(config: dict | str | ParsedConfig, overrides: list[str] | None = None) -> dict:
    """``config``: a parsed config, a config dict, or the path of a YAML config (deployments);
    parsed once, here, and passed to every task as it is (frozen)."""
    cfg = parsed_config(config, overrides)
    with parent_run(cfg, "method", cfg.method, guarantee_of(cfg),
                    params={"privacy.dataset_epsilon_cap": cfg.privacy.dataset_epsilon_cap}) as run:
        part = partition(cfg, run.paths, default_data_root(cfg.data_root))
        # the ledger dataset its source is charged to (by its records; refused when they lie in several
        # registered datasets), before anything is tagged, registered or reserved. Which one it is depends
        # on the records: said on the operator's terminal only, never into Prefect or MLflow
        with refusals_to_operator(run.paths, charged_elsewhere=False):
            part, charged = resolve_partition(run.paths.open_ledger(), part)
        if charged:
            operator_note(run.paths, charged)
        ctx = StageContext.for_run(cfg, run.paths, part, run.parent.run_id, run.flow_run_id)
        tell_operator(run.paths, cfg, ctx.part)
        plan = pipeline.plan_run(ctx, run.parent)  # δ, every run's plan and method, once: validated before any work
        method = plan.methods[cfg.method]
        with refusals_to_operator(run.paths, charged_elsewhere=charged is not None):
            check_budget(ctx, plan.plans, plan.delta)  # the ledger's answer before any baseline or evaluation
        # every method's public-data preparation, then every check that needs no private data, BEFORE
        # any method reserves budget or reads a private row: a config mistake spends nothing
        prepared_by = {name: prepare_task(ctx, name) for name in cfg.run_methods}
        preflight(cfg, prepared_by)
        ctx = dataclasses.replace(ctx, preflighted=tuple(cfg.run_methods))  # the door checks none of them again
        rec, trained, plans = pipeline.RunReport(cfg, method, run.parent), {}, dict(plan.plans)

        def run_method(name: str, prepared: dict | None = None) -> RunOutcome:
            if name not in plans:  # a method a variant asks for (POST's Full PT): planned once, here
                plans[name] = plan_for(cfg, name, ctx.part.sizes, plan.delta)
            checked, prepared = door_inputs(ctx, name, prepared, prepared_by)
            trained[name] = train_task(checked, name, prepared, plans[name])
            return trained[name]

        for name in cfg.run_methods[:-1]:  # baselines first, the published method last
            run_baseline(ctx, rec, plan.methods[name], run_method(name, prepared_by[name]))
        prepared = prepared_by[cfg.method]
        rec.prepared(prepared)
        published = run_method(cfg.method, prepared)
        rec.trained(published)
        evaluate_published(ctx, rec, published, prepared)
        variants = method.extras.variants(ctx, published, prepared, run_method)
        rec.variant_results(variants, [evaluate_task(ctx, v.prompt_path, v.name, v.guarantee, {"target": v.model})
                                       for v in variants], trained)
        rec.points_and_runtime(published)
        if pipeline.runs_loss_mia(cfg, method, published):
            model = method.extras.published_model(cfg, prepared)
            rec.loss_mia(loss_mia_task(ctx, published.prompt_path, cfg.method, published.guarantee, model))
        rec.released(published, plan)
        if cfg.audit.enabled and published.prompt_path is None:  # no prompt published (fallback): none to audit
            get_run_logger().warning("audit skipped: the run published no prompt")
        elif cfg.audit.enabled:  # (a split of no row: the audit flow does not run its attacks and says so)
            from flows.audit import run_audit

            rec.audited(run_audit(pipeline.audit_target(ctx, published, prepared), cfg.audit, cfg))
        run.summary.update(rec.record(ctx, published, plan))
    publish_statement(run.summary)
    get_run_logger().info("run record: %s", json.dumps({k: float(f"{v:.4g}") for k, v in rec.metrics.items()}))
    for warning in run.summary.get("warnings", []):
        get_run_logger().warning(warning)
    return run.summary
