"""Sweep flow: one method flow run per variant of a config (``sweep:`` block) and per seed
(``seeds:``), then a summary run that puts them side by side (privacy–utility and leakage plots,
a table) and, over seeds, gives each variant's mean ± standard deviation."""

from __future__ import annotations

from prefect import flow, get_run_logger

from flows.parent_run import parent_run
from flows.prompt_tuning import prompt_tuning_flow
from tasks import plots
from tasks.config import load_config, parse_config, sweep_variants, variant_group

COLUMNS = ("privacy.epsilon", "test.accuracy", "mia.loss.auc", "mia.lira.auc", "mia.lira.tpr_at_1pct_fpr",
           "audit.epsilon_lower_bound",
           # POST's comparison (absent for the other methods)
           "test.accuracy.full_zs", "test.accuracy.full_pt", "test.accuracy.compressed_pt",
           "test.accuracy.direct_transfer")


def short_name(column: str) -> str:
    return {"test.accuracy": "accuracy", "privacy.epsilon": "epsilon"}.get(
        column, column.removeprefix("test.accuracy.").removeprefix("mia.").removeprefix("audit."))[:14]


def present_columns(rows: list[dict]) -> list[str]:
    """The columns of ``COLUMNS`` that at least one run reports."""
    return [c for c in COLUMNS if any(r.get(c) is not None for r in rows)]


def seed_groups(rows: list[dict]) -> list[dict]:
    """Per variant (its label without the seed): n, and mean / sample std of every column over
    the seeds that produced it (std 0 for one seed; None where no run has the column)."""
    import numpy as np

    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(variant_group(row["variant"]), []).append(row)
    out = []
    for name, members in groups.items():
        g = {"group": name, "n": len(members), "seeds": [m.get("seed") for m in members]}
        for c in COLUMNS:
            values = np.array([m[c] for m in members if m.get(c) is not None], float)
            g[c] = {"mean": float(values.mean()) if len(values) else None,
                    "std": float(values.std(ddof=1)) if len(values) > 1 else (0.0 if len(values) else None),
                    "n": int(len(values))}
        out.append(g)
    return out


def summary_table(rows: list[dict], groups: list[dict]) -> str:
    columns = present_columns(rows)
    lines = ["| variant | run | " + " | ".join(columns) + " |", "|---|---|" + "---:|" * len(columns)]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['mlflow_run_id'][:8]} | "
                     + " | ".join("-" if r.get(c) is None else f"{r[c]:.4f}" for c in columns) + " |")
    if any(g["n"] > 1 for g in groups):
        lines += ["", "Mean ± sample standard deviation over seeds:", "",
                  "| variant | seeds | " + " | ".join(columns) + " |", "|---|---|" + "---:|" * len(columns)]
        for g in groups:
            lines.append(f"| {g['group']} | {g['n']} | " + " | ".join(
                "-" if g[c]["mean"] is None else f"{g[c]['mean']:.4f} ± {g[c]['std']:.4f}" for c in columns) + " |")
    return "\n".join(lines) + "\n"


@flow(name="sweep", log_prints=False)
def sweep_flow(config: dict | str, overrides: list[str] | None = None) -> dict:
    cfg = load_config(config, overrides) if isinstance(config, str) else parse_config(config)
    variants = sweep_variants(cfg)  # every variant validated before anything runs
    logger = get_run_logger()
    with parent_run(cfg, "sweep", "sweep", "none", tags={"sweep.variants": len(variants)}, params={
            "privacy.target_delta": cfg.privacy.target_delta or "default: min(1e-5, 1/(10 n_train))"}) as run:
        paths, record = run.paths, run.parent
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
                   "privacy.guarantee": variant.guarantee, "seed": variant.seed}
            row.update({k: out["metrics"].get(k) for k in COLUMNS})
            rows.append(row)
            fingerprint = out.get("budget", {}).get("dataset.fingerprint")
            if fingerprint:
                record.set_tags({"dataset.fingerprint": fingerprint})
        groups = seed_groups(rows)
        record.log_json(rows, "sweep/results.json")
        record.log_json(groups, "sweep/groups.json")
        record.log_text(summary_table(rows, groups), "tables/sweep.md")
        if cfg.seeds:
            record.log_params({"sweep.seeds": ",".join(map(str, cfg.seeds))})
        points = [{"method": r["variant"], "accuracy": r["test.accuracy"], "epsilon": r["privacy.epsilon"],
                   "guarantee": "no DP"} for r in rows]
        fig = plots.privacy_utility_plot(points, f"{cfg.data.name}: test accuracy by variant")
        record.log_figure(fig, "plots/privacy_utility.png")
        plots.close(fig)
        if any(r.get("mia.lira.auc") is not None for r in rows):
            fig = plots.leakage_plot(rows, f"{cfg.data.name}: membership inference by variant")
            record.log_figure(fig, "plots/leakage.png")
            plots.close(fig)
    return {"flow_run_id": run.flow_run_id, "mlflow_run_id": record.run_id, "experiment": cfg.experiment_name,
            "method": "sweep", "variants": rows, "groups": groups, "metrics": {}}
