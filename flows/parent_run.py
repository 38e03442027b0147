"""The parent run every flow opens (../shared/RUN_RECORD.md): the state folder, the MLflow
experiment, the parent run with the shared tags, params and ``config.yaml``, and the summary the
CLI prints. The run ends FINISHED when the flow's block completes and FAILED when it raises.

A process killed outright (SIGKILL, out of memory) ends neither: its runs stay RUNNING. So the
parent run carries its owner process (host, pid, start time) as tags, and every parent run, before
it starts, marks FAILED the runs of this host whose owner is gone (:func:`tasks.record.sweep_dead_runs`,
tag ``privprompt.swept``)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from prefect.runtime import flow_run

from tasks.config import PrivPromptConfig, config_family, config_hash, config_to_yaml
from tasks.record import RunRecord, client, ensure_experiment, owner_tags, sweep_dead_runs
from tasks.state import LEDGER_URL_ENV, StatePaths, config_state_paths


@dataclass
class FlowRun:
    cfg: PrivPromptConfig
    paths: StatePaths
    flow_run_id: str
    parent: RunRecord
    summary: dict  # what the flow returns: ids first, the flow adds its results


def device_description() -> str:
    """The device this run's models use (``PRIVPROMPT_DEVICE``, else CUDA when present, else CPU):
    ``cpu``, or ``cuda:0 (NVIDIA H100 80GB HBM3)`` with the GPU's name."""
    import torch

    from models.device import resolve_device

    device = resolve_device(None)
    if device.type == "cuda":
        try:
            return f"{device} ({torch.cuda.get_device_name(device)})"
        except (RuntimeError, AssertionError):  # a named device this machine lacks: the run fails on it
            return str(device)
    return str(device)


def run_title(cfg: PrivPromptConfig, method: str, guarantee: str) -> str:
    """``<method> · <dataset> · ε <target>``: the Prefect flow run's and the MLflow parent run's name,
    so both UIs' run lists say what each run was (public config only)."""
    if method == "sweep":  # its variants carry their own targets
        return f"sweep · {cfg.data.name}"
    budget = f"ε {cfg.privacy.target_epsilon:g}" if guarantee == "dp" else f"no ε ({guarantee})"
    return f"{method} · {cfg.data.name} · {budget}"


def name_flow_run(flow_run_id: str, name: str) -> None:
    """Rename the running Prefect flow run (it starts with a random name, before the config is
    parsed), unless its caller named it (a sweep's variant: ``flow_run_name``)."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is not None and context.flow is not None and context.flow.flow_run_name is not None:
        return
    try:
        with get_client(sync_client=True) as prefect:
            prefect.update_flow_run(flow_run_id, name=name)
    except Exception as exc:  # noqa: BLE001 - a name is a label: never a reason to stop a run
        import warnings

        warnings.warn(f"the flow run keeps its random name: {type(exc).__name__}: {exc}")


@contextmanager
def parent_run(cfg: PrivPromptConfig, flow: str, method: str, guarantee: str,
               tags: dict | None = None, params: dict | None = None) -> Iterator[FlowRun]:
    paths = config_state_paths(cfg).create()
    from privacy import calibration_cache

    calibration_cache.enable(paths.root)  # noise calibrations kept between runs (deployments too)
    if paths.ledger_setting:  # the config's ledger.url: this run's tasks and workers use it too
        os.environ[LEDGER_URL_ENV] = paths.ledger_setting
    flow_run_id = str(flow_run.get_id())
    mlflow = client(paths)
    try:  # runs left RUNNING by killed processes of this host: FAILED, with the reason
        sweep_dead_runs(mlflow, by=f"flow run {flow_run_id}")
    except Exception as exc:  # noqa: BLE001 - housekeeping must never stop a run
        import warnings

        warnings.warn(f"the sweep of runs left RUNNING by dead processes failed: {type(exc).__name__}: {exc}")
    experiment_id = ensure_experiment(mlflow, cfg.experiment_name, paths)
    parent_tags = {
        "method": method, "dataset": cfg.data.name, "model.local": cfg.models.local,
        "model.target": cfg.models.target_name, "privacy.guarantee": guarantee,
        "prefect.flow_run_id": flow_run_id, "flow": flow, "config.hash": config_hash(cfg),
        "config.family": config_family(cfg),
        "device": device_description(), **owner_tags(), **(tags or {})}
    title = run_title(cfg, method, guarantee)
    name_flow_run(flow_run_id, title)
    parent = RunRecord.create(mlflow, experiment_id, title, parent_tags)
    run = FlowRun(cfg, paths, flow_run_id, parent, {
        "flow_run_id": flow_run_id, "mlflow_run_id": parent.run_id, "method": method,
        "experiment": cfg.experiment_name, "device": parent_tags["device"]})
    try:
        # privacy.unit: every ε of this run is for adding or removing one such unit of the source:
        # `record`, or the field whose value identifies a person (data.privacy_unit); the field's
        # name only, never a value
        # A record-level run on a dataset of people (data.person_field) states its ε per person too
        # (privacy.unit = the field; charged by group privacy for data.max_records_per_unit records),
        # and says that its mechanism is per record (privacy.mechanism_unit)
        unit = {"data.max_records_per_unit": cfg.data.max_records_per_unit} \
            if cfg.data.max_records_per_unit is not None else {}
        if cfg.data.group_size:
            unit.update({"data.person_field": cfg.data.person_field, "privacy.mechanism_unit": "record"})
        parent.log_params({"privacy.target_epsilon": cfg.privacy.target_epsilon,
                           "privacy.unit": cfg.data.charge_unit, **unit, "seed": cfg.seed, **(params or {})})
        parent.log_text(config_to_yaml(cfg), "config.yaml")
        yield run
    except BaseException:
        parent.end(ok=False)
        raise
    finally:  # what libraries wrote under private/ with the caller's umask: 0600 (its folders are 0700)
        paths.tighten()
    parent.end(ok=True)
