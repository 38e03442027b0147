"""Audit flow: how much does a published prompt leak?

Loss-threshold, LiRA (online / offline, K shadow prompts trained by the audited method itself
on random halves of an audit pool) and Min-K% attacks, plus the one-run canary audit. Shadows
are a mapped task on a ``DaskTaskRunner``: a local cluster by default, an existing scheduler when
``audit.dask.address`` is set. Runs inside a method flow (``audit:`` block) or on a finished run
(``privprompt audit RUN_ID``); results go to the audited run's record and to an ``audit`` child run.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import flow, get_run_logger, task, unmapped
from prefect.runtime import flow_run


from tasks.attacks import needs_shadows
from tasks.audit import (AuditFailure, AuditTarget, attack_metrics, audit_dir, build_pool, canary_audit,
                         check_audit, has_empty_side, train_shadow, write_results)
from tasks.config import AuditConfig, ParsedAuditConfig, ParsedConfig, PrivPromptConfig
from tasks.prefect_tasks import GPU_TAG, dask_task_runner, transient_only
from tasks.record import RunRecord, client
from tasks.state import make_private_dir, open_private, state_paths


def read_target(target_file: str, cfg: PrivPromptConfig | None = None) -> AuditTarget:
    """The audit's target from its private file (its partition's exact sizes and charged dataset
    key never are a flow or task parameter), with its config as the flow parsed it (when given)."""
    target = AuditTarget(**json.loads(Path(target_file).read_text()))
    if cfg is not None:
        target.__dict__["cfg"] = cfg  # the parsed config (AuditTarget.cfg is a cached property): not parsed again
    return target


@task(name="audit-pool", retries=1, retry_condition_fn=transient_only)
def pool_task(target_file: str, cfg: PrivPromptConfig, acfg: AuditConfig, directory: str, seed: int) -> dict:
    return build_pool(read_target(target_file, cfg), acfg, Path(directory), seed)


@task(name="shadow", task_run_name="shadow-{index}", tags=[GPU_TAG], retries=1, retry_condition_fn=transient_only)
def shadow_task(target_file: str, cfg: PrivPromptConfig, acfg: AuditConfig, pool: dict, index: int,
                audit_run_id: str) -> dict:
    import torch

    torch.set_num_threads(acfg.dask.threads_per_worker)  # one worker per core, not oversubscribed
    out = train_shadow(read_target(target_file, cfg), acfg, pool, index, audit_run_id)
    get_run_logger().info("shadow %d: %d steps in %.1f s", index, out["steps"], out["compute_s"])
    return out


@flow(name="audit", log_prints=False)
def audit_flow(target_file: str, audit_config: dict | ParsedAuditConfig, config: ParsedConfig | None = None) -> dict:
    """``audit_config``: the audit block (parsed already, or a dict parsed here); ``config``: the
    audited run's config as its caller parsed it (else parsed here from the target, once). Both go
    to the tasks as they are: nothing parses them again."""
    # the target (its partition's exact sizes, the charged dataset key) stays in a private file:
    # a flow's parameters are stored on the Prefect server
    t = read_target(target_file, config)
    acfg = audit_config if isinstance(audit_config, AuditConfig) else AuditConfig.model_validate(audit_config)
    cfg = t.cfg
    logger = get_run_logger()
    sizes = check_audit(t, acfg)  # before any training
    paths = state_paths(t.state_dir)
    audit_id = str(flow_run.get_id())
    mlflow = client(paths)  # the tracking DB exists (the audited run is in it) before fan-out
    audit_run = RunRecord(mlflow, t.run_id).child("audit", {
        "method": t.method, "stage": "audit", "privacy.guarantee": "none", "prefect.flow_run_id": audit_id})
    if has_empty_side(t.part):  # no member or no non-member to pool: not run, and said
        audit_run.set_tags({"audit.not_run": "a split holds no row"})
        audit_run.end(ok=True)
        logger.warning("audit not run (audit statistic, not DP): a split holds no row")
        return {"metrics": {}, "canary": None, "audit_run_id": audit_run.run_id}
    try:
        paths.open_ledger().record_nonprivate(
            t.part.dataset_key, f"{audit_id}:audit",
            f"membership audit of run {t.run_id}: {acfg.shadows} shadow prompts and attack statistics (not DP)")
        audit_run.log_params({"audit.shadows": acfg.shadows, "audit.pool_members": sizes["n_members"],
                              "audit.pool_nonmembers": sizes["n_nonmembers"], "audit.attacks": ",".join(acfg.attacks),
                              "audit.dask": acfg.dask.address or f"local:{acfg.dask.n_workers}x{acfg.dask.threads_per_worker}",
                              # membership of a unit (a person: all their records) or of a record
                              "audit.membership": "units" if t.part.unit != "record" else "records"})
        directory = audit_dir(t, audit_id)
        seed = cfg.seed + 4242
        pool = pool_task(target_file, cfg, acfg, str(directory), seed)
        shadows = []
        if needs_shadows(acfg.attacks):  # an attack that compares with shadow prompts (LiRA)
            futures = shadow_task.map(unmapped(target_file), unmapped(cfg), unmapped(acfg), unmapped(pool),
                                      list(range(acfg.shadows)), unmapped(audit_run.run_id))
            shadows = [f.result() for f in futures]
        metrics, details = attack_metrics(t, acfg, pool, [s["scores_path"] for s in shadows], directory, seed)
        canary = canary_audit(t, acfg)
        out = write_results(t, audit_run, metrics, details, canary, shadows)
        audit_run.end(ok=True)
        headline = {k: round(v, 4) for k, v in out.items() if k.endswith(".auc") or k == "audit.epsilon_lower_bound"}
        logger.info("audit of %s: %s", t.run_id, headline)
        return {"metrics": out, "canary": canary, "audit_run_id": audit_run.run_id}
    except AuditFailure as err:
        audit_run.set_tags({"audit.failure": str(err)[:240]})
        audit_run.end(ok=False)
        raise
    except BaseException:
        audit_run.end(ok=False)
        raise


def run_audit(target: AuditTarget, acfg: AuditConfig, cfg: PrivPromptConfig | None = None) -> dict:
    """Run the audit flow (as a subflow when called from a flow) on its Dask task runner; ``cfg``:
    the target's config as the caller parsed it (default ``target.cfg``). The result has ``wall_s``,
    the audit's wall time (shadows run in parallel: not a sum of their work)."""
    import time

    import uuid

    started = time.perf_counter()
    paths = state_paths(target.state_dir)
    folder = make_private_dir(paths.private / "audit-targets")
    target_file = folder / f"{uuid.uuid4().hex}.json"
    with open_private(target_file, "w") as handle:
        handle.write(json.dumps(target.to_dict()))
    try:
        out = audit_flow.with_options(task_runner=dask_task_runner(acfg.dask))(
            str(target_file), acfg, cfg if cfg is not None else target.cfg)
    finally:
        target_file.unlink(missing_ok=True)
        paths.tighten()  # what the shadows' workers wrote with their umask
    return {**out, "wall_s": time.perf_counter() - started}


@flow(name="audit-finished-run", log_prints=False)
def audit_run_flow(run_id: str, shadows: int | None = None, state_dir: str | None = None) -> dict:
    """Audit a finished run by its MLflow run id (a deployment: ``prefect.yaml``); runs where the
    run's private partition is."""
    target, acfg = target_from_run(run_id, state_dir, shadows)
    return run_audit(target, acfg)


def _find_prompt(directory: Path, method: str) -> Path | None:
    hits = sorted(p for p in directory.glob(f"{method}.*") if p.suffix in (".safetensors", ".json"))
    return hits[0] if hits else None


def _artifact(mlflow, run_id: str, path: str, what: str) -> str:
    """A local copy of the run's artifact ``path``; its absence is an ``AuditError``."""
    from mlflow.exceptions import MlflowException

    from tasks.audit import AuditError

    try:
        return mlflow.download_artifacts(run_id, path)
    except (MlflowException, OSError):
        raise AuditError(f"run {run_id} has no {what} artifact ({path})") from None


def _audited_run(mlflow, run_id: str, paths):
    """The MLflow run to audit: a method run of a registered method with a partition."""
    from mlflow.exceptions import MlflowException

    from tasks.audit import AuditError
    from tasks.methods import registered_methods

    try:
        run = mlflow.get_run(run_id)
    except MlflowException:
        raise AuditError(f"no MLflow run {run_id!r} in {paths.root}") from None
    tags = run.data.tags
    if tags.get("method") not in registered_methods() or "dataset.fingerprint" not in tags:
        raise AuditError(f"run {run_id} ({tags.get('mlflow.runName', '?')}) is not a prompt-tuning run: "
                         "no method run with a prompt to audit")
    return run


def _private_partition(paths, run_id: str, tags: dict) -> dict:
    """The run's partition from its manifest under private/, resolved to the ledger dataset its
    source is charged to (perhaps another registered dataset holding its records: the run's tag
    names the source only), found in the local ledger by its records."""
    from tasks.audit import AuditError
    from tasks.charge import refusals_to_operator, resolve_partition

    wanted = tags.get("data.partition", tags["dataset.fingerprint"])
    partition = None
    for manifest in (paths.private / "partitions").glob("*/manifest.json"):
        data = json.loads(manifest.read_text())
        if data["fingerprint"] == wanted:
            partition = data
            break
    if partition is None:
        raise AuditError(f"run {run_id}: its private partition (data.partition {wanted[:12]}) is not under "
                         f"{paths.private}; audits run where the private data is")
    with refusals_to_operator(paths, charged_elsewhere=False):  # records in several datasets: said to the operator
        partition, _ = resolve_partition(paths.open_ledger(), partition)
    return partition


def _audited_prompt(mlflow, paths, run_id: str, tags: dict, method: str) -> Path:
    """The run's prompt: its published artifact (dp), else the non-private prompt kept next to the
    private data (never published)."""
    from tasks.audit import AuditError

    if tags.get("privacy.guarantee") == "dp":
        found = _find_prompt(Path(_artifact(mlflow, run_id, "prompt", "published prompt")), method)
        if found is None:
            raise AuditError(f"run {run_id} has no published prompt artifact (prompt/{method}.*)")
        return found
    directory = paths.private / "runs" / tags.get("prefect.flow_run_id", "?")
    found = _find_prompt(directory, method) if directory.is_dir() else None
    if found is None:
        raise AuditError(f"run {run_id} has no prompt artifact to audit (non-private run; looked in {directory})")
    return found


def target_from_run(run_id: str, state_dir: str | None = None, shadows: int | None = None, check: bool = True):
    """(AuditTarget, AuditConfig) of a finished MLflow run; every problem is an ``AuditError``
    raised before any training. The run's config is parsed once, here. ``check=False``: without the
    membership audit's own checks (its pool's size, no selection), for the canary audit alone
    (``privprompt promote``), which scores the planted canaries and trains nothing."""
    import yaml

    from tasks.config import parse_config

    paths = state_paths(state_dir)
    mlflow = client(paths)
    run = _audited_run(mlflow, run_id, paths)
    tags, metrics = run.data.tags, run.data.metrics
    method = tags["method"]
    config = yaml.safe_load(open(_artifact(mlflow, run_id, "config.yaml", "config.yaml")).read())
    config["state_dir"] = str(paths.root)
    cfg = parse_config(config)
    prepared = json.loads(open(_artifact(mlflow, run_id, "method/prepared.json", "prepared-stage")).read())
    partition = _private_partition(paths, run_id, tags)
    found = _audited_prompt(mlflow, paths, run_id, tags, method)
    acfg = (cfg.audit.model_copy(update={"enabled": True}) if shadows is None else  # a CLI's shadows: validated
            AuditConfig.model_validate({**cfg.audit.model_dump(), "enabled": True, "shadows": shadows}))
    target = AuditTarget(config=cfg.model_dump(mode="json"), partition=partition, prompt_path=str(found),
                         method=method, delta=metrics.get("privacy.delta"),
                         # single-record canaries: a record-level run charged per person is audited per record
                         epsilon=metrics.get("privacy.epsilon_per_record", metrics.get("privacy.epsilon")),
                         run_id=run_id, flow_run_id=tags.get("prefect.flow_run_id", ""), state_dir=str(paths.root),
                         prepared=prepared)
    target.__dict__["cfg"] = cfg  # the config parsed above (AuditTarget.cfg is a cached property)
    if check:
        check_audit(target, acfg)
    return target, acfg
