"""Sweep flow: one prompt-tuning flow run per variant of a config (``sweep:`` block), then a
summary run that puts them side by side (privacy–utility and leakage plots, a table)."""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from flows.prompt_tuning import prompt_tuning_flow
from tasks import plots
from tasks.config import config_to_yaml, load_config, parse_config, sweep_variants
from tasks.record import RunRecord, client, ensure_experiment
from tasks.state import state_paths

COLUMNS = ("privacy.epsilon", "test.accuracy", "mia.loss.auc", "mia.lira.auc", "mia.lira.tpr_at_1pct_fpr",
           "audit.epsilon_lower_bound")


@flow(name="sweep", log_prints=False)
def sweep_flow(config: dict | str, overrides: list[str] | None = None) -> dict:
    cfg = load_config(config, overrides) if isinstance(config, str) else parse_config(config)
    variants = sweep_variants(cfg)  # every variant validated before anything runs
    paths = state_paths(cfg.state_dir).create()
    flow_run_id = str(flow_run.get_id())
    mlflow = client(paths)
    experiment_id = ensure_experiment(mlflow, cfg.experiment_name, paths)
    run = RunRecord.create(mlflow, experiment_id, f"sweep-{flow_run_id[:8]}", {
        "method": "sweep", "dataset": cfg.data.name, "model.local": cfg.models.local,
        "model.target": cfg.models.target_name, "privacy.guarantee": "none",
        "prefect.flow_run_id": flow_run_id, "flow": "sweep", "sweep.variants": len(variants)})
    logger = get_run_logger()
    try:
        run.log_params({"seed": cfg.seed, "privacy.target_epsilon": cfg.privacy.target_epsilon,
                        "privacy.target_delta": cfg.privacy.target_delta or "default: min(1e-5, 1/(10 n_train))"})
        run.log_text(config_to_yaml(cfg), "config.yaml")
        rows = []
        for label, variant in variants:
            logger.info("sweep variant %s", label)
            vcfg = variant.model_dump(mode="json")
            vcfg["state_dir"] = str(paths.root)
            method_flow = prompt_tuning_flow
            if variant.method == "post":
                from flows.post import post_flow as method_flow
            out = method_flow.with_options(flow_run_name=f"{variant.method}:{label}")(vcfg)
            row = {"variant": label, "method": variant.method, "mlflow_run_id": out["mlflow_run_id"],
                   "privacy.guarantee": variant.guarantee}
            row.update({k: out["metrics"].get(k) for k in COLUMNS})
            rows.append(row)
            fingerprint = out.get("budget", {}).get("dataset.fingerprint")
            if fingerprint:
                run.set_tags({"dataset.fingerprint": fingerprint})
        run.log_json(rows, "sweep/results.json")
        points = [{"method": r["variant"], "accuracy": r["test.accuracy"], "epsilon": r["privacy.epsilon"],
                   "guarantee": "no DP"} for r in rows]
        fig = plots.privacy_utility_plot(points, f"{cfg.data.name}: test accuracy by variant")
        run.log_figure(fig, "plots/privacy_utility.png")
        plots.close(fig)
        if any(r.get("mia.lira.auc") is not None for r in rows):
            fig = plots.leakage_plot(rows, f"{cfg.data.name}: membership inference by variant")
            run.log_figure(fig, "plots/leakage.png")
            plots.close(fig)
        run.end(ok=True)
        return {"flow_run_id": flow_run_id, "mlflow_run_id": run.run_id, "experiment": cfg.experiment_name,
                "method": "sweep", "variants": rows, "metrics": {}}
    except BaseException:
        run.end(ok=False)
        raise
