"""Prefect tasks: thin wrappers over ``tasks.data`` and ``tasks.stages``.

Results are paths and numbers. The partition task persists its result under a cache key built
from the data config, the seed, the input files and the state folder — not from run ids — so
re-running a config reuses its partition. Training tasks retry only on transient errors and
charge the ledger under a key of (flow run, method), so a retry never charges twice.
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from . import stages
from .config import DataConfig
from .data import partition_dataset, partition_key
from .errors import user_errors

GPU_TAG = "gpu"


def transient_only(task, task_run, state) -> bool:
    """Retry on infrastructure failures, never on bad input or an exhausted budget."""
    try:
        state.result()
    except (*user_errors(), ValueError, KeyError, TypeError, AssertionError):
        return False
    except Exception:  # noqa: BLE001 - e.g. OSError, CUDA OOM, a lost worker
        return True
    return False


def dask_task_runner(dask):
    """The one DaskTaskRunner of every fan-out (an audit's shadows, a sweep's variants), from a
    ``DaskConfig``: an existing scheduler at ``address``, else a local cluster of ``n_workers``
    processes with ``threads_per_worker`` threads each, one device per worker
    (:mod:`tasks.dask_devices`: ``dask.devices``, else the visible GPUs in turn)."""
    from prefect_dask import DaskTaskRunner

    from .dask_devices import DEVICES_ENV

    if dask.address:
        return DaskTaskRunner(address=dask.address)
    return DaskTaskRunner(cluster_class="distributed.LocalCluster", cluster_kwargs={
        "n_workers": dask.n_workers, "threads_per_worker": dask.threads_per_worker, "processes": True,
        "dashboard_address": None, "preload": ["tasks.dask_devices"],
        "env": {DEVICES_ENV: ",".join(dask.devices or [])}})


def _data_config(data_config: DataConfig | dict) -> DataConfig:
    """The ``data:`` block as the flow parsed it (a dict, from an older caller, is parsed)."""
    return data_config if isinstance(data_config, DataConfig) else DataConfig.model_validate(data_config)


def _partition_cache_key(context, parameters) -> str:
    """Prefect keeps this key in its database: an HMAC under the installation secret of the partition's
    key (which hashes the source files' sizes and times), so that it confirms nothing about them."""
    import hashlib
    import hmac

    from .state import installation_secret

    cfg, private_dir = _data_config(parameters["data_config"]), parameters["private_dir"]
    key = partition_key(cfg, parameters["seed"], parameters["data_root"], private_dir)
    folder = str(Path(private_dir).resolve())
    return "partition-" + hmac.new(installation_secret(private_dir), f"{key}\0{folder}".encode(),
                                   hashlib.sha256).hexdigest()[:32]


@task(name="partition-data", cache_key_fn=_partition_cache_key, persist_result=True,
      retries=2, retry_delay_seconds=1, retry_condition_fn=transient_only)
def partition_task(data_config: DataConfig | dict, seed: int, private_dir: str, data_root: str | None) -> dict:
    part = partition_dataset(_data_config(data_config), seed, private_dir, data_root)
    # no sizes: Prefect's logs reach its server, and the released sizes are published only beside
    # the dp charge that covers them (the exact ones never leave private/)
    get_run_logger().info("partition %s ready (data.partition %s; its source's records key %s)",
                          part.dataset, part.fingerprint[:12], part.source_key[:12])
    # the result Prefect persists (under its home, outside private/): where the partition is, never
    # its sizes; the flow reads the partition itself (exact sizes included) from its manifest
    return {"dataset": part.dataset, "directory": part.directory, "fingerprint": part.fingerprint,
            "source_key": part.source_key}


def progress_reporter(name: str):
    """Progress of a stage in Prefect (a progress artifact and a log line every report): steps
    only. Training losses are exact statistics of private data and never reach Prefect."""
    logger = get_run_logger()
    artifacts: dict = {}

    def report(step: int, total: int, *_ignored, stage: str | None = None) -> None:
        """``stage``: a public name of a later part of the same task (DP-OPT's leakage audit), its own bar."""
        label = f"{name} {stage}" if stage else name
        frac = step / max(total, 1)
        if label not in artifacts:
            artifacts[label] = create_progress_artifact(0.0, description=f"{label} progress")
        update_progress_artifact(artifacts[label], progress=100.0 * frac)
        logger.info("%s: step %d/%d (%.0f%%)", label, step, total, 100 * frac)

    return report


@task(name="prepare", task_run_name="prepare-{method}", tags=[GPU_TAG],
      retries=1, retry_delay_seconds=2, retry_condition_fn=transient_only)
def prepare_task(ctx: stages.StageContext, method: str) -> dict:
    """The method's public-data preparation (POST: the cached student)."""
    from .methods import get_method

    started = time.perf_counter()
    out = get_method(method).mechanism.prepare(ctx, progress=progress_reporter(f"{method}:prepare"))
    return {**out, "prepare_s": out.get("compute_s", time.perf_counter() - started)}


@task(name="train-prompt", task_run_name="train-{method}", tags=[GPU_TAG],
      retries=1, retry_delay_seconds=2, retry_condition_fn=transient_only)
def train_task(ctx: stages.StageContext, method: str, prepared: dict, plan=None) -> dict:
    """The method through the one lifecycle (reserve → train → store → commit → publish) under
    the flow's ``plan`` (``privacy.plan.RunPlan``, computed once by the flow). A retry reuses the
    reservation of the same (flow run, method): it never charges twice."""
    from .lifecycle import run_method

    return run_method(ctx, method, prepared, progress=progress_reporter, plan=plan)


@task(name="evaluate", task_run_name="evaluate-{name}", tags=[GPU_TAG],
      retries=1, retry_delay_seconds=2, retry_condition_fn=transient_only)
def evaluate_task(ctx: stages.StageContext, prompt_path: str | None, name: str, guarantee: str,
                  models: dict | None = None) -> dict:
    out = stages.evaluate_stage(ctx, prompt_path, name, guarantee, models)
    get_run_logger().info("%s: test accuracy %s", name, {k: round(v, 4) for k, v in out["per_model"].items()})
    return out


@task(name="evaluate-endpoint", task_run_name="evaluate-{name}-endpoint", retries=1, retry_delay_seconds=5,
      retry_condition_fn=transient_only)
def endpoint_task(ctx: stages.StageContext, prompt_path: str, name: str, endpoint: dict) -> dict:
    out = stages.endpoint_evaluate_stage(ctx, prompt_path, name, endpoint)
    get_run_logger().info("%s on %s: test accuracy %.4f", name, endpoint["alias"], out["accuracy"])
    return out


@task(name="loss-mia", task_run_name="loss-mia-{name}", tags=[GPU_TAG],
      retries=1, retry_delay_seconds=2, retry_condition_fn=transient_only)
def loss_mia_task(ctx: stages.StageContext, prompt_path: str | None, name: str, guarantee: str,
                  model: str | None = None) -> dict:
    out = stages.loss_mia_stage(ctx, prompt_path, name, guarantee, model)
    m = out["metrics"]
    if not m:  # an exactly empty split: no attack
        get_run_logger().info("%s: loss MIA not run (audit statistic, not DP: a split holds no row)", name)
        return out
    get_run_logger().info("%s: loss MIA AUC %.3f [%.3f, %.3f] (audit statistic, not DP)", name, m["mia.loss.auc"],
                          m["mia.loss.auc_low"], m["mia.loss.auc_high"])
    return out
