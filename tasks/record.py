"""The run record of ../shared/RUN_RECORD.md, written through ``MlflowClient`` with explicit run
ids (MLflow's active run is thread-local: a task on another thread or worker that relied on it
would silently start a top-level run). Only numbers, names and DP outputs are logged here."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .state import StatePaths, seed_copy, tracking_uri
from .templates import MLFLOW_TEMPLATE_ENV as TEMPLATE_ENV

if TYPE_CHECKING:  # MLflow is imported where a record is written: `privprompt plan` never loads it
    from mlflow.tracking import MlflowClient


def client(paths: StatePaths) -> MlflowClient:
    """Tracking and Model Registry both at the state's store (a client given only a tracking URI
    takes the process-wide registry URI, which ``mlflow.set_registry_uri`` may point elsewhere)."""
    from mlflow.tracking import MlflowClient

    uri = tracking_uri(paths)
    if uri == f"sqlite:///{paths.mlflow_db}":
        seed_store(paths.mlflow_db)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def seed_store(db: Path) -> None:
    """Where ``$PRIVPROMPT_MLFLOW_TEMPLATE`` names a folder, a state's new local MLflow store starts
    as a copy of an empty, migrated one kept there (``mlflow-<version>-empty.db``, made once):
    MLflow otherwise runs its ~60 schema migrations on every new file, 5-9 s on 2 cores, which the
    test suite paid once per state folder. The template holds the schema only (no experiment:
    MLflow adds its default one, with this store's artifact root, when it opens the copy). The copy
    is 0600 and put in place only if no store is there (a hard link: never over one made
    meanwhile). Any failure leaves the store to MLflow, which makes it as it always has."""
    folder = os.environ.get(TEMPLATE_ENV)
    if not folder or db.exists() or not db.parent.is_dir():
        return
    try:
        seed_copy(_template(Path(folder)), db)
    except Exception:  # noqa: BLE001 - making the template failed: MLflow makes the store as before
        return


def _template(folder: Path) -> Path:
    import mlflow
    from mlflow.store.db.utils import _initialize_tables  # what SqlAlchemyStore runs on an empty database
    from sqlalchemy import create_engine

    path = folder / f"mlflow-{mlflow.__version__}-empty.db"
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".mlflow-", suffix=".db")
    os.close(fd)
    try:
        engine = create_engine(f"sqlite:///{tmp}")
        try:
            _initialize_tables(engine)
        finally:
            engine.dispose()
        os.replace(tmp, path)  # atomic: a concurrent maker's copy is as good
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def ensure_experiment(mlflow: MlflowClient, name: str, paths: StatePaths) -> str:
    exp = mlflow.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    # a local store keeps artifacts in the state folder; a tracking server (http[s]://, shared by a
    # team) chooses its own artifact store (--artifacts-destination), reachable from every machine
    remote = tracking_uri(paths).startswith(("http://", "https://"))
    location = None if remote else (paths.artifacts / name).resolve().as_uri()
    try:
        return mlflow.create_experiment(name, artifact_location=location)
    except Exception:  # noqa: BLE001 - created concurrently by another process
        exp = mlflow.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


class RunRecord:
    """One MLflow run (parent or child) addressed by id."""

    def __init__(self, mlflow: MlflowClient, run_id: str):
        self.mlflow = mlflow
        self.run_id = run_id

    @classmethod
    def create(cls, mlflow: MlflowClient, experiment_id: str, name: str, tags: dict[str, str],
               parent_run_id: str | None = None) -> "RunRecord":
        tags = {k: str(v) for k, v in tags.items()}
        tags["mlflow.runName"] = name
        if parent_run_id:
            tags["mlflow.parentRunId"] = parent_run_id
        run = mlflow.create_run(experiment_id, run_name=name, tags=tags)
        return cls(mlflow, run.info.run_id)

    def child(self, name: str, tags: dict[str, str]) -> "RunRecord":
        run = self.mlflow.get_run(self.run_id)
        return RunRecord.create(self.mlflow, run.info.experiment_id, name, tags, parent_run_id=self.run_id)

    def set_tags(self, tags: dict[str, object]) -> None:
        for k, v in tags.items():
            self.mlflow.set_tag(self.run_id, k, str(v))

    def log_params(self, params: dict[str, object]) -> None:
        from mlflow.entities import Param

        self.mlflow.log_batch(self.run_id, params=[Param(k, str(v)) for k, v in params.items()])

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """One batched write (a SQLite transaction per metric adds up over many child runs)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step or 0) for k, v in metrics.items() if v is not None]
        if batch:
            self.mlflow.log_batch(self.run_id, metrics=batch)

    def log_file(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.mlflow.log_artifact(self.run_id, str(path), artifact_path)

    def log_text(self, text: str, artifact_file: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            target = Path(tmp) / Path(artifact_file).name
            target.write_text(text)
            parent = str(Path(artifact_file).parent)
            self.log_file(target, None if parent in ("", ".") else parent)

    def log_json(self, data: object, artifact_file: str) -> None:
        self.log_text(json.dumps(data, indent=2, sort_keys=True, default=str), artifact_file)

    def log_figure(self, fig, artifact_file: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            target = Path(tmp) / Path(artifact_file).name
            fig.savefig(target, dpi=120, bbox_inches="tight")
            parent = str(Path(artifact_file).parent)
            self.log_file(target, None if parent in ("", ".") else parent)

    def end(self, ok: bool = True) -> None:
        from mlflow.entities import RunStatus

        status = RunStatus.to_string(RunStatus.FINISHED if ok else RunStatus.FAILED)
        self.mlflow.set_terminated(self.run_id, status=status)


# ---- runs left RUNNING by a process that died (kill -9, out of memory, power loss) ------------

OWNER_HOST = "privprompt.owner.host"
OWNER_PID = "privprompt.owner.pid"
OWNER_STARTED = "privprompt.owner.started"  # the owner process's start time: a reused pid is another process
SWEPT = "privprompt.swept"


def _host() -> str:
    import socket

    return socket.gethostname()


def _process_started(pid: int) -> float | None:
    """The start time of live process ``pid`` (seconds since the epoch); None when it is gone."""
    import psutil  # a dependency of peft and distributed (both required)

    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return process.create_time()
    except psutil.NoSuchProcess:
        return None


def owner_tags() -> dict[str, str]:
    """Tags naming the process that owns a parent run (host, pid, its start time), for
    :func:`sweep_dead_runs`."""
    pid = os.getpid()
    return {OWNER_HOST: _host(), OWNER_PID: str(pid), OWNER_STARTED: repr(_process_started(pid))}


def owner_is_gone(tags: dict[str, str]) -> bool | None:
    """Whether the process that owned a run (its :func:`owner_tags`) is gone: True / False on this
    host, None when the run belongs to another host or names no owner (then nobody here can tell)."""
    if tags.get(OWNER_HOST) != _host() or not tags.get(OWNER_PID):
        return None
    try:
        pid, started = int(tags[OWNER_PID]), float(tags.get(OWNER_STARTED, "nan"))
    except ValueError:
        return None
    now = _process_started(pid)
    return now is None or not abs(now - started) < 1.0  # nan (unknown start) compares False: gone


def sweep_dead_runs(mlflow: MlflowClient, by: str = "") -> list[str]:
    """Mark FAILED every parent run still RUNNING whose owner process on this host is gone (a run
    killed with SIGKILL never ends its MLflow run), and its child runs still RUNNING, each with
    the tag ``privprompt.swept`` saying why. Runs of other hosts, and runs without owner tags, are
    left alone. Every flow's parent run calls this before it starts (flows/parent_run.py).
    Returns the ids marked FAILED."""
    from mlflow.entities import RunStatus, ViewType

    experiments = [e.experiment_id for e in mlflow.search_experiments(view_type=ViewType.ALL)]
    if not experiments:
        return []
    running = "attributes.status = 'RUNNING'"
    dead = [r for r in mlflow.search_runs(experiments, f"{running} and tags.`{OWNER_HOST}` = '{_host()}'",
                                          run_view_type=ViewType.ALL, max_results=50_000)
            if owner_is_gone(r.data.tags)]
    swept = []
    for run in dead:
        children = mlflow.search_runs([run.info.experiment_id],
                                      f"{running} and tags.mlflow.parentRunId = '{run.info.run_id}'",
                                      run_view_type=ViewType.ALL, max_results=50_000)
        why = (f"its owner process {run.data.tags[OWNER_PID]} on {run.data.tags[OWNER_HOST]} ended without ending "
               f"the run (killed or crashed); marked FAILED at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
               + (f" by {by}" if by else ""))
        for r in [*children, run]:  # the children first: a parent swept half-way is swept again
            mlflow.set_tag(r.info.run_id, SWEPT, why)
            mlflow.set_terminated(r.info.run_id, status=RunStatus.to_string(RunStatus.FAILED))
            swept.append(r.info.run_id)
    return swept
