"""A state's new MLflow store seeded from the migrated empty template (tasks/record.py)."""

import os
import stat
from pathlib import Path

from mlflow import __version__ as mlflow_version

from tasks.record import TEMPLATE_ENV, client
from tasks.state import state_paths


def test_a_new_store_is_a_private_copy_of_the_template_and_opens_as_mlflows_own(tmp_path, monkeypatch):
    template = Path(os.environ[TEMPLATE_ENV])  # the test run's (tests/conftest.py): made once per run
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    paths = [state_paths(str(tmp_path / name)).create() for name in ("one", "two")]
    runs = []
    for p in paths:
        mlflow = client(p)
        assert p.mlflow_db.is_file() and stat.S_IMODE(p.mlflow_db.stat().st_mode) == 0o600
        assert mlflow.get_experiment("0").name == "Default"  # the template has none: MLflow made it on opening
        exp_id = mlflow.create_experiment("x", artifact_location=(p.artifacts / "x").as_uri())
        runs.append(mlflow.create_run(exp_id).info.run_id)
        assert not [f for f in os.listdir(p.root) if f.endswith(".tmp")]  # no temporary copy left
    # one template; the stores are separate files, each with its own run only
    assert [f.name for f in template.iterdir() if not f.name.startswith(".")] == [
        f"mlflow-{mlflow_version}-empty.db"]
    assert paths[0].mlflow_db.stat().st_ino != paths[1].mlflow_db.stat().st_ino
    for p, run_id in zip(paths, runs):
        mlflow = client(p)
        assert [r.info.run_id for r in mlflow.search_runs([mlflow.get_experiment_by_name("x").experiment_id])] == [run_id]


def test_an_existing_store_is_never_replaced(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    p = state_paths(str(tmp_path / "s")).create()
    run_id = client(p).create_run("0").info.run_id
    assert client(p).get_run(run_id).info.run_id == run_id



def test_a_new_prefect_home_starts_from_the_prefect_template_unless_prefect_is_pointed_elsewhere(tmp_path, monkeypatch):
    from tasks.state import PREFECT_TEMPLATE_ENV, configure_environment

    template = tmp_path / "prefect-template.db"
    template.write_bytes(b"migrated prefect database")
    monkeypatch.setenv(PREFECT_TEMPLATE_ENV, str(template))
    for k in ("PREFECT_API_URL", "PREFECT_SERVER_DATABASE_CONNECTION_URL", "PREFECT_API_DATABASE_CONNECTION_URL"):
        monkeypatch.delenv(k, raising=False)
    for k in ("PREFECT_HOME", "PREFECT_RESULTS_LOCAL_STORAGE_PATH"):  # configure_environment sets them
        monkeypatch.setenv(k, os.environ.get(k, ""))
    fresh = state_paths(str(tmp_path / "fresh"))
    configure_environment(fresh)
    db = fresh.prefect_home / "prefect.db"
    assert db.read_bytes() == b"migrated prefect database" and stat.S_IMODE(db.stat().st_mode) == 0o600
    db.write_bytes(b"this home's own database")
    configure_environment(fresh)  # an existing database is kept
    assert db.read_bytes() == b"this home's own database"
    assert not [f for f in os.listdir(fresh.prefect_home) if f.endswith(".tmp")]

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")  # a server of its own: nothing copied
    elsewhere = state_paths(str(tmp_path / "elsewhere"))
    configure_environment(elsewhere)
    assert not (elsewhere.prefect_home / "prefect.db").exists()
