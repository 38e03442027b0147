"""Prefect tasks: thin wrappers over ``tasks.data`` and ``tasks.stages``.

Results are paths and numbers. The partition task persists its result under a cache key built
from the data config, the seed, the input files and the state folder — not from run ids — so
re-running a config reuses its partition. Training tasks retry only on transient errors and
charge the ledger under a key of (flow run, method), so a retry never charges twice.
"""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from privacy.ledger import BudgetExceededError

from . import stages
from .config import DataConfig
from .data import partition_dataset, partition_key
from .errors import PrivPromptError

GPU_TAG = "gpu"


def transient_only(task, task_run, state) -> bool:
    """Retry on infrastructure failures, never on bad input or an exhausted budget."""
    try:
        state.result()
    except (PrivPromptError, BudgetExceededError, ValueError, KeyError, TypeError, AssertionError):
        return False
    except Exception:  # noqa: BLE001 - e.g. OSError, CUDA OOM, a lost worker
        return True
    return False


def _partition_cache_key(context, parameters) -> str:
    cfg = DataConfig.model_validate(parameters["data_config"])
    key = partition_key(cfg, parameters["seed"], parameters["data_root"])
    return f"partition-{key}-{abs(hash(str(Path(parameters['private_dir']).resolve()))) % 10**8}"


@task(name="partition-data", cache_key_fn=_partition_cache_key, persist_result=True,
      retries=2, retry_delay_seconds=1, retry_condition_fn=transient_only)
def partition_task(data_config: dict, seed: int, private_dir: str, data_root: str | None) -> dict:
    part = partition_dataset(DataConfig.model_validate(data_config), seed, private_dir, data_root)
    get_run_logger().info("partition %s: %d train / %d holdout / %d test (fingerprint %s)",
                          part.dataset, part.n_train, part.n_holdout, part.n_test, part.fingerprint[:12])
    return part.to_dict()


def _progress_reporter(name: str):
    logger = get_run_logger()
    artifact = {"id": None}

    def report(step: int, total: int, loss: float | None) -> None:
        frac = step / max(total, 1)
        if artifact["id"] is None:
            artifact["id"] = create_progress_artifact(0.0, description=f"{name} training progress")
        update_progress_artifact(artifact["id"], progress=100.0 * frac)
        logger.info("%s: step %d/%d (%.0f%%)%s", name, step, total, 100 * frac,
                    "" if loss is None else f" batch loss {loss:.4f}")

    return report


@task(name="train-prompt", task_run_name="train-{method}", tags=[GPU_TAG],
      retries=1, retry_delay_seconds=2, retry_condition_fn=transient_only)
def train_task(ctx: stages.StageContext, method: str) -> dict:
    return stages.train_stage(ctx, method, progress=_progress_reporter(method))


@task(name="evaluate", task_run_name="evaluate-{name}", tags=[GPU_TAG],
      retries=1, retry_delay_seconds=2, retry_condition_fn=transient_only)
def evaluate_task(ctx: stages.StageContext, prompt_path: str | None, name: str, guarantee: str) -> dict:
    out = stages.evaluate_stage(ctx, prompt_path, name, guarantee)
    get_run_logger().info("%s: test accuracy %s", name, {k: round(v, 4) for k, v in out["per_model"].items()})
    return out


@task(name="loss-mia", task_run_name="loss-mia-{name}", tags=[GPU_TAG],
      retries=1, retry_delay_seconds=2, retry_condition_fn=transient_only)
def loss_mia_task(ctx: stages.StageContext, prompt_path: str | None, name: str, guarantee: str) -> dict:
    out = stages.loss_mia_stage(ctx, prompt_path, name, guarantee)
    m = out["metrics"]
    get_run_logger().info("%s: loss MIA AUC %.3f [%.3f, %.3f]", name, m["mia.loss.auc"],
                          m["mia.loss.auc_low"], m["mia.loss.auc_high"])
    return out
