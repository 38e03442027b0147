"""Soft-prompt tuning flow (PromptDPSGD and its baselines) writing the shared run record.

DAG: partition → [zero-shot eval] → [prompt_sgd → eval → loss MIA] → prompt_dpsgd → eval → loss MIA.
One MLflow parent run per flow run, a child run per training / evaluation / audit task.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import flow, get_run_logger

from privacy.ledger import Ledger

from flows.parent_run import parent_run
from tasks import plots
from tasks.config import TUNING_METHODS, load_config, parse_config
from tasks.errors import ConfigError
from tasks.prefect_tasks import evaluate_task, loss_mia_task, partition_task, train_task
from tasks.stages import StageContext, resolve_delta
from tasks.state import default_data_root


def _partition(cfg, paths, data_root) -> dict:
    args = dict(data_config=cfg.data.model_dump(mode="json"), seed=cfg.seed,
                private_dir=str(paths.private), data_root=data_root)
    part = partition_task(**args)
    if not (Path(part["directory"]) / "manifest.json").is_file():  # cached, but files were removed
        part = partition_task.with_options(refresh_cache=True)(**args)
    return part


@flow(name="prompt-tuning", log_prints=False)
def prompt_tuning_flow(config: dict | str, overrides: list[str] | None = None) -> dict:
    """``config``: a validated config dict, or the path of a YAML config (deployments)."""
    cfg = load_config(config, overrides) if isinstance(config, str) else parse_config(config)
    if cfg.method not in TUNING_METHODS:
        raise ConfigError(f"method {cfg.method!r} has its own flow; run it with `privprompt run`")
    data_root = default_data_root(cfg.data_root)
    logger = get_run_logger()
    with parent_run(cfg, "prompt_tuning", cfg.method, cfg.guarantee,
                    params={"privacy.dataset_epsilon_cap": cfg.privacy.dataset_epsilon_cap}) as run:
        paths, parent, flow_run_id, summary = run.paths, run.parent, run.flow_run_id, run.summary
        part = _partition(cfg, paths, data_root)
        delta = resolve_delta(cfg, part["n_train"])
        parent.set_tags({"dataset.fingerprint": part["fingerprint"]})
        parent.log_params({"privacy.target_delta": delta, "data.n_train": part["n_train"],
                           "data.n_holdout": part["n_holdout"], "data.n_test": part["n_test"]})
        if cfg.audit.enabled:  # an audit that cannot run is refused before any training
            from tasks.audit import check_pool_size
            from tasks.data import Partition

            check_pool_size(Partition(**part), cfg.audit)
        ctx = StageContext(config=cfg.model_dump(mode="json"), state_dir=str(paths.root), partition=part,
                           parent_run_id=parent.run_id, flow_run_id=flow_run_id)

        metrics: dict[str, float] = {}
        points: list[dict] = []
        compute: dict[str, float] = {}  # seconds of model work per stage (the rest is orchestration)
        if cfg.methods.zero_shot.enabled:
            out = evaluate_task(ctx, None, "zero_shot", "none")
            metrics["test.accuracy.zero_shot"] = out["target"]
            compute["evaluate:zero_shot"] = out["compute_s"]
            points.append({"method": "zero_shot", "accuracy": out["target"], "epsilon": None,
                           "guarantee": "no training"})

        # baselines first, the published method last
        methods = [m for m in TUNING_METHODS if getattr(cfg.methods, m).enabled and m != cfg.method]
        published = None
        for method in methods + [cfg.method]:
            info = train_task(ctx, method)
            guarantee = "dp" if info["private"] else "none"
            accs = evaluate_task(ctx, info["prompt_path"], method, guarantee)
            compute.update({f"train:{method}": info["compute_s"], f"evaluate:{method}": accs["compute_s"]})
            mia = loss_mia_task(ctx, info["prompt_path"], method, guarantee) if cfg.mia.enabled else None
            if mia is not None:
                compute[f"mia:{method}"] = mia["compute_s"]
            eps = info["spend"]["epsilon"] if info["private"] else None
            points.append({"method": method, "accuracy": accs["target"], "epsilon": eps, "guarantee": "no DP"})
            if method != cfg.method:
                metrics[f"test.accuracy.{method}"] = accs["target"]
                if mia is not None:
                    metrics[f"baseline.{method}.mia.loss.auc"] = mia["metrics"]["mia.loss.auc"]
                continue
            published = info
            metrics["test.accuracy"] = accs["target"]
            metrics.update({f"test.accuracy.{alias}": v for alias, v in accs["per_model"].items()})
            if mia is not None:
                metrics.update(mia["metrics"])
                parent.log_file(mia["roc_plot"], "plots")
            if info["private"]:
                spend = info["spend"]
                metrics.update({"privacy.epsilon": spend["epsilon"], "privacy.delta": spend["delta"],
                                "privacy.epsilon_rdp": spend["epsilon_rdp"]})
                parent.log_params(info["params"])
                parent.log_file(info["prompt_path"], "prompt")  # the DP output: published
                parent.log_file(info["training_curve"], "plots")

        if cfg.audit.enabled:
            from flows.audit import run_audit
            from tasks.audit import AuditTarget

            spend = published.get("spend") or {}
            target = AuditTarget(config=ctx.config, partition=part, prompt_path=published["prompt_path"],
                                 method=cfg.method, epsilon=spend.get("epsilon"), delta=spend.get("delta"),
                                 run_id=parent.run_id, flow_run_id=flow_run_id, state_dir=str(paths.root))
            audited = run_audit(target, cfg.audit)
            compute["audit"] = audited["wall_s"]
            metrics.update(audited["metrics"])
            summary["audit"] = audited

        ledger_row = Ledger(paths.ledger).dataset(part["fingerprint"])
        budget = {"dataset": cfg.data.name, "dataset.fingerprint": part["fingerprint"],
                  "privacy.guarantee": cfg.guarantee,
                  "ledger": {k: ledger_row[k] for k in ("epsilon_cap", "delta", "spent_epsilon",
                                                        "remaining_epsilon", "nonprivate_uses")}}
        if published["private"]:
            spend = published["spend"]
            budget.update({"accountant": spend["accountant"], "total": spend,
                           "stages": [{"stage": cfg.method, "event": published["event"], **spend}]})
        else:
            budget.update({"total": None, "stages": [],
                           "note": f"{cfg.method} has no formal privacy guarantee: nothing was published "
                                   "but metrics, and its prompt stays under private/"})
        parent.log_json(budget, "privacy/budget.json")
        fig = plots.privacy_utility_plot(points, f"{cfg.data.name}: test accuracy by method")
        parent.log_figure(fig, "plots/privacy_utility.png")
        plots.close(fig)
        parent.log_metrics(metrics)
        summary.update({"metrics": metrics, "budget": budget, "compute_seconds": compute,
                        "published": {k: published[k] for k in ("method", "prompt_path", "private")}})
    logger.info("run record: %s", json.dumps({k: float(f"{v:.4g}") for k, v in metrics.items()}))
    return summary
