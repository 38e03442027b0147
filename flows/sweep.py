"""Sweep flow: one method flow run per variant of a config (``sweep:`` block) and per seed
(``seeds:``), then a summary run that puts them side by side (privacy–utility and leakage plots,
a table) and, over seeds, gives each variant's mean ± standard deviation."""

from __future__ import annotations

from prefect import flow, get_run_logger, task

from flows.parent_run import parent_run
from flows.method_flow import method_flow, parsed_config
from tasks import plots
from tasks.comparison import mean_std
from tasks.config import ParsedConfig, PrivPromptConfig, sweep_variants, variant_group
from tasks.errors import ConfigError
from tasks.method_checks import guarantee_of
from tasks.planning import format_plan, plan_runs
from tasks.prefect_tasks import dask_task_runner
from tasks.charge import refusals_to_operator
from tasks.state import config_state_paths, operator_note

COLUMNS = ("privacy.epsilon", "privacy.epsilon_per_record", "test.accuracy", "mia.loss.auc", "mia.lira.auc",
           "mia.lira.tpr_at_1pct_fpr", "audit.epsilon_lower_bound")


def _baseline_accuracy(key: str) -> bool:
    """``audit.baseline.<m>.test.accuracy``: a baseline trained on private data without DP
    (an audit statistic, RUN_RECORD.md)."""
    return key.startswith("audit.baseline.") and key.endswith(".test.accuracy")


def _accuracy_column(key: str) -> bool:
    return key.startswith("test.accuracy.") or _baseline_accuracy(key)


def columns_of(rows: list[dict]) -> list[str]:
    """COLUMNS plus every ``test.accuracy.<variant>`` a run reports (a method's variants and
    baselines that read no private data, e.g. POST's Compressed PT, zero-shot) and every
    ``audit.baseline.<m>.test.accuracy`` (baselines trained on private data without DP, labelled):
    no method's names are listed here."""
    extra = sorted({k for r in rows for k in r if _accuracy_column(k) and k not in COLUMNS})
    return list(COLUMNS) + extra


def short_name(column: str) -> str:
    if _baseline_accuracy(column):
        return ("audit:" + column.removeprefix("audit.baseline.").removesuffix(".test.accuracy"))[:14]
    return {"test.accuracy": "accuracy", "privacy.epsilon": "epsilon", "privacy.epsilon_per_record": "eps/record"}.get(
        column, column.removeprefix("test.accuracy.").removeprefix("mia.").removeprefix("audit."))[:14]


def present_columns(rows: list[dict]) -> list[str]:
    """The columns that at least one run reports."""
    return [c for c in columns_of(rows) if any(r.get(c) is not None for r in rows)]


def seed_groups(rows: list[dict]) -> list[dict]:
    """Per variant (its label without the seed): n, and mean / sample std of every column over
    the seeds that produced it (std 0 for one seed; None where no run has the column):
    :func:`tasks.comparison.mean_std`, the one place these are computed."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(variant_group(row["variant"]), []).append(row)
    out = []
    for name, members in groups.items():
        g = {"group": name, "n": len(members), "seeds": [m.get("seed") for m in members]}
        for c in columns_of(rows):
            stats = mean_std(m.get(c) for m in members)
            mean, std, n = stats if stats is not None else (None, None, 0)
            g[c] = {"mean": mean, "std": std, "n": n}
        out.append(g)
    return out


def privacy_cells(row: dict) -> tuple[str, str]:
    """(δ, unit) of a variant's ε: what each ε of the sweep's table is stated for ('-' without one)."""
    from tasks.statement import unit_phrase

    if row.get("privacy.epsilon") is None:
        return "-", "-"
    delta = row.get("privacy.delta")
    return ("-" if delta is None else f"{delta:.3g}"), unit_phrase(row.get("unit"))


def summary_table(rows: list[dict], groups: list[dict]) -> str:
    columns = present_columns(rows)
    lines = ["| variant | run | " + " | ".join(columns) + " | δ | unit |",
             "|---|---|" + "---:|" * len(columns) + "---:|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['mlflow_run_id'][:8]} | "
                     + " | ".join("-" if r.get(c) is None else f"{r[c]:.4f}" for c in columns)
                     + " | " + " | ".join(privacy_cells(r)) + " |")
    if any(g["n"] > 1 for g in groups):
        lines += ["", "Mean ± sample standard deviation over seeds:", "",
                  "| variant | seeds | " + " | ".join(columns) + " |", "|---|---|" + "---:|" * len(columns)]
        for g in groups:
            lines.append(f"| {g['group']} | {g['n']} | " + " | ".join(
                "-" if g[c]["mean"] is None else f"{g[c]['mean']:.4f} ± {g[c]['std']:.4f}" for c in columns) + " |")
    return "\n".join(lines) + "\n"


def finished_run(mlflow, experiment: str, digest: str):
    """The newest FINISHED parent run of config hash ``digest`` in ``experiment`` (or None)."""
    exp = mlflow.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = mlflow.search_runs([exp.experiment_id], f"tags.`config.hash` = '{digest}' and attributes.status = 'FINISHED'",
                              order_by=["attributes.start_time DESC"], max_results=5)
    runs = [r for r in runs if "mlflow.parentRunId" not in r.data.tags and r.data.tags.get("flow") != "sweep"]
    return runs[0] if runs else None


def _row(label: str, variant, run_id: str, metrics: dict, resumed: bool) -> dict:
    row = {"variant": label, "method": variant.method, "mlflow_run_id": run_id,
           "privacy.guarantee": guarantee_of(variant), "seed": variant.seed, "resumed": resumed,
           "privacy.delta": metrics.get("privacy.delta"), "unit": variant.data.charge_unit}
    row.update({k: metrics.get(k) for k in COLUMNS})
    row.update({k: v for k, v in metrics.items() if _accuracy_column(k)})
    return row


def variant_run_name(cfg: PrivPromptConfig, label: str) -> str:
    """A variant's flow run name: ``<method> · <dataset> · <its settings>``."""
    return f"{cfg.method} · {cfg.data.name} · {label}"


@task(name="sweep-variant", task_run_name="variant-{label}")
def variant_task(vcfg: PrivPromptConfig, label: str, threads: int) -> dict:
    """One variant's method flow, on a Dask worker (a nested flow run of the sweep): its config
    as the sweep parsed it (pickled to the worker, not parsed again)."""
    import torch

    torch.set_num_threads(threads)  # one worker per core, not oversubscribed
    # (its parameter is the parsed config itself: a worker's Prefect cannot rebuild the flow's parameter
    # model for it, and there is nothing left to validate)
    out = method_flow.with_options(flow_run_name=variant_run_name(vcfg, label), validate_parameters=False)(vcfg)
    return {k: out[k] for k in ("mlflow_run_id", "metrics", "budget")}


def run_in_parallel(items: list[tuple[str, PrivPromptConfig]], dcfg) -> dict[str, dict]:
    """Variants as tasks on a DaskTaskRunner (a local cluster of processes, or ``dcfg.address``)."""
    @flow(name="sweep-variants", task_runner=dask_task_runner(dcfg), log_prints=False)
    def variants_flow(items):
        futures = {label: variant_task.submit(vcfg, label, dcfg.threads_per_worker) for label, vcfg in items}
        return {label: f.result() for label, f in futures.items()}

    return variants_flow(items)


def pending_variants(variants: list[tuple[str, PrivPromptConfig]], paths) -> tuple[dict, list, dict]:
    """(each variant's FINISHED run of its config hash or None, the variants left to run, their
    budget plan). Over a dataset's cap nothing runs: refused before any training, and before any
    MLflow run exists."""
    from tasks.config import config_hash
    from tasks.record import client

    mlflow = client(paths) if paths.mlflow_db.is_file() else None
    done = {label: finished_run(mlflow, v.experiment_name, config_hash(v)) if mlflow else None for label, v in variants}
    todo = [(label, v) for label, v in variants if done[label] is None]
    # which dataset a variant's source is charged to depends on its records: the plan's dataset rows
    # and notes, and every refusal naming one, reach the operator's terminal only
    with refusals_to_operator(paths, charged_elsewhere=True):
        budget = plan_runs(todo, paths) if todo else {"runs": [], "datasets": {}, "fits": True}
    if budget["datasets"]:
        operator_note(paths, "the sweep's budget plan:\n" + format_plan(budget))
    if not budget["fits"]:
        # no plan number or dataset here: the numbers derive from the released sizes, and Prefect keeps
        # this message (the flow run's state) while no run is charged for the release
        raise ConfigError("the sweep's planned runs exceed a dataset's privacy budget: nothing ran and nothing was "
                          "reserved; the operator's terminal and `privprompt plan CONFIG` show the plan")
    return done, todo, budget


def run_variants(cfg: PrivPromptConfig, variants, done: dict, todo: list, run) -> list[dict]:
    """Every variant's row: a FINISHED run's as it was, else a method flow run of its parsed config
    (with ``sweep_dask``, the variants without an audit as Dask tasks first)."""
    logger, record = get_run_logger(), run.parent

    def vconfig(variant: PrivPromptConfig) -> PrivPromptConfig:
        return variant.model_copy(update={"state_dir": str(run.paths.root)})  # a path: nothing to validate

    # with sweep_dask, variants without an audit run as Dask tasks (an audit starts its own
    # cluster, which cannot start inside a Dask worker: audited variants run here, serially)
    parallel = {}
    if cfg.sweep_dask is not None:
        items = [(label, vconfig(v)) for label, v in todo if not v.audit.enabled]
        if items:
            logger.info("sweep: %d variants on Dask (%s)", len(items),
                        cfg.sweep_dask.address or f"local cluster, {cfg.sweep_dask.n_workers} workers")
            parallel = run_in_parallel(items, cfg.sweep_dask)
    rows = []
    for label, variant in variants:
        previous = done[label]
        if previous is not None:
            logger.info("sweep variant %s: FINISHED before as run %s, not run again", label, previous.info.run_id)
            rows.append(_row(label, variant, previous.info.run_id, previous.data.metrics, True))
            continue
        if label in parallel:
            out = parallel[label]
        else:
            logger.info("sweep variant %s", label)
            out = method_flow.with_options(flow_run_name=variant_run_name(variant, label))(vconfig(variant))
        record.mlflow.set_tag(out["mlflow_run_id"], "sweep.variant", label)
        rows.append(_row(label, variant, out["mlflow_run_id"], out["metrics"], False))
        fingerprint = out.get("budget", {}).get("dataset.fingerprint")
        if fingerprint:
            record.set_tags({"dataset.fingerprint": fingerprint})
    return rows


def log_summary(record, cfg: PrivPromptConfig, variants, rows: list[dict], budget: dict) -> list[dict]:
    """The sweep's parent run: results, seed groups, the table, the budget plan, the privacy–utility
    and leakage plots and the report of its runs. Returns the seed groups."""
    from tasks.comparison import log_report, parent_runs

    groups = seed_groups(rows)
    record.log_json(rows, "sweep/results.json")
    record.log_json(groups, "sweep/groups.json")
    record.log_text(summary_table(rows, groups), "tables/sweep.md")
    record.log_text(format_plan(budget, datasets=False) + "\n", "sweep/budget_plan.txt")
    if cfg.seeds:
        record.log_params({"sweep.seeds": ",".join(map(str, cfg.seeds))})
    points = [{"method": r["variant"], "accuracy": r["test.accuracy"], "epsilon": r["privacy.epsilon"],
               "guarantee": "no DP"} for r in rows]
    fig = plots.privacy_utility_plot(points, f"{cfg.data.name}: test accuracy by variant", cfg.data.charge_unit)
    record.log_figure(fig, "plots/privacy_utility.png")
    plots.close(fig)
    if any(r.get("mia.lira.auc") is not None for r in rows):
        fig = plots.leakage_plot(rows, f"{cfg.data.name}: membership inference by variant")
        record.log_figure(fig, "plots/leakage.png")
        plots.close(fig)
    ids = {r["mlflow_run_id"] for r in rows}
    report_rows = [r for e in {v.experiment_name for _, v in variants}
                   for r in parent_runs(record.mlflow, e) if r["run_id"] in ids]
    log_report(record, report_rows, f"{cfg.data.name}: privacy–utility by method")
    return groups


@flow(name="sweep", log_prints=False)
def sweep_flow(config: dict | str | ParsedConfig, overrides: list[str] | None = None) -> dict:
    """Every variant (``sweep:`` list and ``grid:`` product) × seed as one method flow run.
    Resumable: a variant whose validated config already has a FINISHED run is not run again.
    The budget of what remains to run is planned up front; over a cap, nothing runs."""
    cfg = parsed_config(config, overrides)
    variants = sweep_variants(cfg)  # every variant parsed (once) and validated before anything runs
    done, todo, budget = pending_variants(variants, config_state_paths(cfg))
    # the plan once it fits: its runs are charged (each run's ε composes the sizes' release)
    get_run_logger().info("budget plan (%d to run, %d finished before):\n%s", len(todo), len(variants) - len(todo),
                          format_plan(budget, datasets=False))
    with parent_run(cfg, "sweep", "sweep", "none", tags={"sweep.variants": len(variants)}, params={
            "privacy.target_delta": cfg.privacy.target_delta or "default: the method's"}) as run:
        rows = run_variants(cfg, variants, done, todo, run)
        groups = log_summary(run.parent, cfg, variants, rows, budget)
    return {"flow_run_id": run.flow_run_id, "mlflow_run_id": run.parent.run_id, "experiment": cfg.experiment_name,
            "method": "sweep", "variants": rows, "groups": groups, "metrics": {}}
