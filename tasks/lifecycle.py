"""The one privacy lifecycle every method runs through:

    plan (pure) → register dataset / check δ → reserve the plan's worst case (dp) or record the use
    (ldp / none) → read private rows → train → commit what was spent (≤ the reservation) →
    post-process (public data only) → publish.

Publish rule, in this one place: the output of a ``dp`` run goes to ``outputs/`` and MLflow;
every other output stays under ``private/``. Exact statistics of private data (training losses)
are written under ``private/`` only. A crash after the reservation keeps it spent.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from privacy import accountant as acct
from privacy import events as ev
from privacy.ledger import Ledger

from . import plots, randomness
from .data import Partition, read_partition_split
from .errors import ConfigError
from .methods import MethodContext, PrivateRows, get_method
from .prompts import save_prompt_file


# The publish rule: outputs of a formal guarantee — central DP, or local d_X privacy (the model
# only ever saw privatized inputs) — go to outputs/ and MLflow; everything else stays in private/.
PUBLISHED = ("dp", "ldp")


def resolve_delta(cfg, n_train: int, method_name: str | None = None) -> float:
    """δ of a run: the config's, else the published (or given) method's default."""
    if cfg.privacy.target_delta:
        return cfg.privacy.target_delta
    return get_method(method_name or cfg.method).default_delta(n_train)


def ensure_dataset(ledger: Ledger, part: Partition, cap: float, delta: float) -> dict:
    """Register the private source dataset in the ledger (keyed by its keyed source hash, so
    every run drawing from it composes against one cap). A lower cap in the config lowers the
    stored one (recorded); a higher cap is refused: raising a budget is a deliberate act. A run
    whose δ differs from the dataset's is refused (its ε would compose at another δ)."""
    from privacy.ledger import UnknownDatasetError

    key = part.dataset_key
    try:
        row = ledger.dataset(key)
    except UnknownDatasetError:
        return ledger.register_dataset(key, part.dataset, cap, delta)
    ledger.require_delta(key, delta)
    if cap < row["epsilon_cap"]:
        return ledger.register_dataset(key, row["name"], cap, row["delta"], allow_cap_change=True)
    if cap > row["epsilon_cap"] + 1e-12:
        raise ConfigError(
            f"privacy.dataset_epsilon_cap={cap:g} is above the cap ε={row['epsilon_cap']:g} already set for "
            f"dataset {part.dataset!r} (fingerprint {key[:12]}); caps are only lowered from a run")
    return row


def read_private_rows(part: Partition, validation: bool = False) -> PrivateRows:
    texts, labels = read_partition_split(part.train_path)
    rows = PrivateRows(texts, labels)
    if validation:
        rows.validation = PrivateRows(*read_partition_split(part.holdout_path))
    return rows


def _write_private_history(directory: Path, name: str, history: list[dict]) -> str | None:
    """Exact private statistics (per-step losses) stay local: a JSON file and a curve under private/."""
    if not history:
        return None
    path = directory / f"{name}_history.json"
    path.write_text(json.dumps(history))
    fig = plots.training_curve(history, f"{name}: batch loss (PRIVATE: exact statistic of private data)")
    fig.savefig(directory / f"{name}_training_curve.png", dpi=120, bbox_inches="tight")
    plots.close(fig)
    return str(path)


def run_method(ctx, name: str, prepared: dict, progress=None) -> dict:
    """Run method ``name`` through the lifecycle inside flow run ``ctx``; returns paths and numbers."""
    method = get_method(name)
    cfg, part, paths = ctx.cfg, ctx.part, ctx.paths
    delta = resolve_delta(cfg, part.n_train)  # the run's δ (its published method's): one δ per run
    plan = method.plan(cfg, part.n_train, delta)
    run_key = f"{ctx.flow_run_id}:{name}"
    ledger = Ledger(paths.ledger)
    ensure_dataset(ledger, part, cfg.privacy.dataset_epsilon_cap, delta)
    child = ctx.parent.child(name, {"method": name, "stage": "train", "privacy.guarantee": plan.guarantee})
    try:
        reservation = None
        if plan.reads_private:
            # before any private row is read: reserve the worst case, or record the use as what it is
            if plan.guarantee == "dp":
                reservation = ledger.reserve(part.dataset_key, run_key, plan.event,
                                             description=f"{name} flow run {ctx.flow_run_id}")
            elif plan.guarantee == "ldp":
                ledger.record_ldp(part.dataset_key, run_key, f"{name}: local d_X privacy, no (ε, δ) claim")
            else:
                ledger.record_nonprivate(part.dataset_key, run_key, f"{name}: {plan.note or 'no formal guarantee'}")
        rows = read_private_rows(part, method.uses_validation) if plan.reads_private else PrivateRows([], [])
        mctx = MethodContext(cfg, paths, prepared, randomness.for_config(cfg), cfg.seed,
                             ctx.output_dir if plan.guarantee in PUBLISHED else ctx.private_run_dir, part.dataset_key)
        started = time.perf_counter()
        trained = method.train(mctx, plan, rows, progress=progress(name) if progress else None)
        train_s = time.perf_counter() - started
        del rows
        info: dict = {"method": name, "guarantee": plan.guarantee, "private": plan.guarantee == "dp",
                      "params": plan.params, "steps": trained.steps, "compute": {"train": train_s},
                      "prompt_path": None, "source_prompt_path": None, "spend": None, "event": None}
        metrics = dict(trained.metrics)
        if plan.guarantee == "dp":
            if trained.event is None:
                raise RuntimeError(f"{name}: a dp plan's training returned no privacy event")
            ledger.commit(run_key, trained.event)  # refuses (after recording it) a spend above the reservation
            spend = acct.spend(trained.event, delta)
            info.update({"spend": spend.to_dict(), "event": ev.event_to_dict(trained.event),
                         "reserved_new": reservation.new})
            metrics.update({"privacy.epsilon": spend.epsilon, "privacy.delta": delta,
                            "privacy.epsilon_rdp": spend.epsilon_rdp})
        _write_private_history(ctx.private_run_dir, name, trained.history)
        if trained.audit_metrics:
            ledger.record_nonprivate(part.dataset_key, f"{run_key}:audit-statistics",
                                     f"{name}: audit statistics computed on private data (not DP): "
                                     + ", ".join(sorted(trained.audit_metrics)))
            metrics.update(trained.audit_metrics)
            info["audit_metrics"] = trained.audit_metrics
        info["train_metrics"] = dict(metrics)
        child.log_params(plan.params)
        child.log_metrics(metrics)
        if trained.prompt is not None:
            published = plan.guarantee in PUBLISHED  # the publish rule
            directory = ctx.output_dir if published else ctx.private_run_dir
            meta = {"method": name, "privacy.guarantee": plan.guarantee, "model": method.published_model(cfg, prepared)}
            if info["spend"] is not None:
                meta.update({"privacy.epsilon": f"{info['spend']['epsilon']:.6f}", "privacy.delta": f"{delta:.3g}",
                             "dataset.fingerprint": part.dataset_key})
            meta.update({k: str(v) for k, v in plan.params.items()})
            started = time.perf_counter()
            post = method.post_process(mctx, plan, trained.prompt, progress=progress(f"{name}:post") if progress else None)
            if post.prompt is not trained.prompt:
                info["compute"]["post_process"] = time.perf_counter() - started
                info["source_prompt_path"] = str(save_prompt_file(directory, f"{name}_source", trained.prompt, {
                    **meta, "model": prepared.get("student_dir", cfg.models.local), "stage": "train"}))
            info["prompt_path"] = str(save_prompt_file(directory, name, post.prompt, meta))
            if info["source_prompt_path"] is None:
                info["source_prompt_path"] = info["prompt_path"]
            if published:
                child.log_file(info["prompt_path"], "prompt")
            if post.child:
                log_post_child(ctx, post.child, plan.guarantee)
        child.end()
        info["published"] = plan.guarantee in PUBLISHED and info["prompt_path"] is not None
        return info
    except BaseException:
        child.end(ok=False)
        raise


def log_post_child(ctx, spec: dict, guarantee: str) -> None:
    run = ctx.parent.child(spec["name"], {**spec.get("tags", {}), "privacy.guarantee": guarantee})
    run.log_params(spec.get("params", {}))
    run.log_metrics(spec.get("metrics", {}))
    for metric, points in spec.get("series", {}).items():
        for step, value in points:
            run.log_metrics({metric: value}, step=step)
    run.end()


def shadow_prompt(config: dict, method_name: str, prepared: dict, state_dir: str, rows: PrivateRows,
                  shadow_seed: int):
    """An audit shadow: the audited method's own ``train`` + ``post_process`` on ``rows`` (pool
    rows), no ledger, no tracking (shadows are private working data). Returns (prompt, steps)."""
    from .config import parse_config
    from .state import state_paths

    cfg = parse_config(config)  # its seed stays: models and splits are the audited run's
    method = get_method(method_name)
    plan = method.plan(cfg, len(rows), resolve_delta(cfg, len(rows), method_name))
    mctx = MethodContext(cfg, state_paths(state_dir), prepared, randomness.for_shadow(cfg, shadow_seed), shadow_seed)
    trained = method.train(mctx, plan, rows)
    post = method.post_process(mctx, plan, trained.prompt)
    return post.prompt, trained.steps + post.steps
