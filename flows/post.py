"""POST flow (Wang et al. 2024): distil the target into a small student (public text), DP
soft-prompt tuning on the student with the private data, transfer the prompt back to the target
with public data only, and compare on the private test split:

    partition → distil (cached, MLflow model registry) → prompt_dpsgd on the student →
    transfer (public only) → evaluate Full ZS / [Full PT] / Compressed PT / Direct Transfer / POST
    → loss MIA on the published POST prompt → [audit flow: LiRA shadows = DP tuning on the
    student + transfer, canary one-run ε bound].
"""

from __future__ import annotations

from prefect import flow, get_run_logger, task

from privacy.ledger import Ledger

from flows.parent_run import parent_run
from flows.prompt_tuning import _partition
from tasks import plots
from tasks.config import load_config, parse_config, with_models
from tasks.post import distill_stage, public_texts, transfer_stage
from tasks.prefect_tasks import GPU_TAG, _progress_reporter, evaluate_task, loss_mia_task, train_task, transient_only
from tasks.stages import StageContext, resolve_delta
from tasks.state import default_data_root

VARIANTS = ("full_zs", "full_pt", "compressed_pt", "direct_transfer", "post")


@task(name="distill", tags=[GPU_TAG], retries=1, retry_condition_fn=transient_only)
def distill_task(ctx: StageContext) -> dict:
    out = distill_stage(ctx, progress=_progress_reporter("distill"))
    get_run_logger().info("student %s (%s)", out["registered"], "cached" if out["cached"] else "distilled")
    return out


@task(name="transfer", tags=[GPU_TAG], retries=1, retry_condition_fn=transient_only)
def transfer_task(ctx: StageContext, student_dir: str, source_prompt_path: str) -> dict:
    texts = public_texts(ctx.cfg, ctx.paths.private)  # public data only: the task gets no private path
    return transfer_stage(ctx, student_dir, source_prompt_path, texts, progress=_progress_reporter("transfer"))


def _with_models(ctx: StageContext, local: str, target: str) -> StageContext:
    return StageContext(config=with_models(ctx.config, local, target), state_dir=ctx.state_dir, partition=ctx.partition,
                        parent_run_id=ctx.parent_run_id, flow_run_id=ctx.flow_run_id)


@flow(name="post", log_prints=False)
def post_flow(config: dict | str, overrides: list[str] | None = None) -> dict:
    cfg = load_config(config, overrides) if isinstance(config, str) else parse_config(config)
    logger = get_run_logger()
    teacher = cfg.models.target_name
    with parent_run(cfg, "post", "post", "dp", tags={"post.public": cfg.methods.post.public.name}, params={
            "post.student_layers": cfg.methods.post.distill.student_layers,
            "post.transfer_steps": cfg.methods.post.transfer.steps,
            "post.transfer_alpha": cfg.methods.post.transfer.alpha}) as run:
        paths, parent, flow_run_id, summary = run.paths, run.parent, run.flow_run_id, run.summary
        part = _partition(cfg, paths, default_data_root(cfg.data_root))
        parent.set_tags({"dataset.fingerprint": part["fingerprint"]})
        parent.log_params({"privacy.target_delta": resolve_delta(cfg, part["n_train"])})
        if cfg.audit.enabled:  # an audit that cannot run is refused before any training
            from tasks.audit import check_pool_size
            from tasks.data import Partition

            check_pool_size(Partition(**part), cfg.audit)
        ctx = StageContext(config=cfg.model_dump(mode="json"), state_dir=str(paths.root), partition=part,
                           parent_run_id=parent.run_id, flow_run_id=flow_run_id)
        ctx = _with_models(ctx, teacher, teacher)
        runtime: dict[str, float | str] = {}

        student = distill_task(ctx)
        runtime["distill"] = "cached" if student["cached"] else student["compute_s"]
        parent.set_tags({"model.local": student["student_dir"], "post.student": student["registered"]})
        on_student = _with_models(ctx, student["student_dir"], student["student_dir"])

        dp = train_task(on_student, "prompt_dpsgd")  # the only stage that reads private training data
        runtime["tune"] = dp["compute_s"]
        moved = transfer_task(ctx, student["student_dir"], dp["prompt_path"])
        runtime["transfer"] = moved["compute_s"]

        compute: dict[str, float] = {}  # seconds of model work per stage (the rest is orchestration)

        def evaluate(stage_ctx: StageContext, prompt_path: str | None, name: str, guarantee: str) -> float:
            out = evaluate_task(stage_ctx, prompt_path, name, guarantee)
            compute[f"evaluate:{name}"] = out["compute_s"]
            return out["target"]

        acc = {"full_zs": evaluate(ctx, None, "full_zs", "none"),
               "compressed_pt": evaluate(on_student, dp["prompt_path"], "compressed_pt", "dp"),
               "direct_transfer": evaluate(ctx, dp["prompt_path"], "direct_transfer", "dp"),
               "post": evaluate(ctx, moved["prompt_path"], "post", "dp")}
        if cfg.methods.post.full_pt:  # non-private tuning on the target: an upper bound, opt-in
            full = train_task(ctx, "prompt_sgd")
            runtime["full_pt"] = full["compute_s"]
            acc["full_pt"] = evaluate(ctx, full["prompt_path"], "full_pt", "none")
        compute.update({k: v for k, v in runtime.items() if isinstance(v, float)})

        spend = dp["spend"]
        metrics = {"privacy.epsilon": spend["epsilon"], "privacy.delta": spend["delta"],
                   "privacy.epsilon_rdp": spend["epsilon_rdp"], "test.accuracy": acc["post"]}
        metrics.update({f"test.accuracy.{k}": v for k, v in acc.items() if k != "post"})
        metrics.update({f"runtime.{k}_s": v for k, v in runtime.items() if isinstance(v, float)})
        if cfg.mia.enabled:
            mia = loss_mia_task(ctx, moved["prompt_path"], "post", "dp")
            compute["mia:post"] = mia["compute_s"]
            metrics.update(mia["metrics"])
            parent.log_file(mia["roc_plot"], "plots")
        if cfg.audit.enabled:  # LiRA shadows re-run DP tuning on the student + transfer (not distillation)
            from flows.audit import run_audit
            from tasks.audit import AuditTarget

            audited = run_audit(AuditTarget(
                config=ctx.config, partition=part, prompt_path=moved["prompt_path"], method="post",
                epsilon=dp["spend"]["epsilon"], delta=dp["spend"]["delta"], run_id=parent.run_id,
                flow_run_id=flow_run_id, state_dir=str(paths.root), student_dir=student["student_dir"]), cfg.audit)
            metrics.update(audited["metrics"])
            compute["audit"] = audited["wall_s"]
            summary["audit"] = audited
        parent.log_params(dp["params"])
        parent.log_file(moved["prompt_path"], "prompt")
        parent.log_file(dp["prompt_path"], "prompt/source")
        parent.log_file(dp["training_curve"], "plots")

        table = ["| method | test accuracy | privacy |", "|---|---:|---|"]
        names = {"full_zs": "Full ZS", "full_pt": "Full PT", "compressed_pt": "Compressed PT",
                 "direct_transfer": "Direct Transfer", "post": "POST"}
        for k in VARIANTS:
            if k in acc:
                privacy = "none (upper bound)" if k == "full_pt" else ("-" if k == "full_zs" else f"ε={spend['epsilon']:.2f}")
                table.append(f"| {names[k]} | {acc[k]:.4f} | {privacy} |")
        times = ["| stage | seconds |", "|---|---:|"] + [
            f"| {k} | {v if isinstance(v, str) else f'{v:.1f}'} |" for k, v in runtime.items()]
        parent.log_text("\n".join(table) + "\n", "tables/accuracy.md")
        parent.log_text("\n".join(times) + "\n", "tables/runtime.md")
        fig = plots.privacy_utility_plot(
            [{"method": names[k], "accuracy": acc[k], "epsilon": None if k in ("full_zs", "full_pt") else spend["epsilon"],
              "guarantee": "no DP" if k == "full_pt" else "no training"} for k in VARIANTS if k in acc],
            f"POST on {cfg.data.name} (public: {cfg.methods.post.public.name})")
        parent.log_figure(fig, "plots/privacy_utility.png")
        plots.close(fig)
        ledger_row = Ledger(paths.ledger).dataset(part["fingerprint"])
        budget = {"dataset": cfg.data.name, "dataset.fingerprint": part["fingerprint"], "privacy.guarantee": "dp",
                  "accountant": spend["accountant"], "total": spend,
                  "stages": [{"stage": "prompt_dpsgd (student)", "event": dp["event"], **spend},
                             {"stage": "distill", "note": "public data only: no privacy cost"},
                             {"stage": "transfer", "note": "public data and the DP prompt only: post-processing"}],
                  "ledger": {k: ledger_row[k] for k in ("epsilon_cap", "delta", "spent_epsilon", "remaining_epsilon")}}
        parent.log_json(budget, "privacy/budget.json")
        parent.log_metrics(metrics)
        summary.update({"metrics": metrics, "runtime": runtime, "accuracy": acc, "budget": budget,
                        "compute_seconds": compute})
    logger.info("POST: %s", {k: round(v, 4) for k, v in acc.items()})
    return summary
