"""Test-session environment: Prefect, MLflow and PrivPrompt state in a temporary folder, set
before Prefect is imported (prefect_test_harness does not isolate result storage: NOTES.md)."""

import os
import tempfile
from pathlib import Path

import pytest

_SESSION_DIR = Path(tempfile.mkdtemp(prefix="privprompt-tests-"))
os.environ["PRIVPROMPT_HOME"] = str(_SESSION_DIR / "state")
os.environ["PREFECT_HOME"] = str(_SESSION_DIR / "prefect")
os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = str(_SESSION_DIR / "prefect" / "storage")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "180"
os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
os.environ["DO_NOT_TRACK"] = "true"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.pop("MLFLOW_TRACKING_URI", None)

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def prefect_harness():
    """One Prefect test server for the whole session (each one costs 11-15 s)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture(scope="session")
def sst2_dir():
    if not (SHARED_DATA / "sst2" / "train.jsonl").is_file():
        pytest.skip("../shared/data/sst2 is not available")
    return SHARED_DATA / "sst2"
