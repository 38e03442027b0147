"""Test-session environment: Prefect, MLflow and PrivPrompt state in a temporary folder, set
before Prefect is imported (prefect_test_harness does not isolate result storage: NOTES.md)."""

import os
import tempfile
from pathlib import Path

import pytest

_SESSION_DIR = Path(tempfile.mkdtemp(prefix="privprompt-tests-"))
os.environ["PRIVPROMPT_HOME"] = str(_SESSION_DIR / "state")
os.environ["PREFECT_HOME"] = str(_SESSION_DIR / "prefect")
os.environ["PRIVPROMPT_HASH_CACHE"] = str(_SESSION_DIR / "folder_sha256.json")
# noise calibrations (pure functions of public numbers: privacy/calibration_cache.py) shared by every
# test of one run, in both workers: each toy config's σ is derived once, not in every flow test
_TEST_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID") or str(os.getpid())  # one id for both workers of a run
SHARED_ACCOUNTING_CACHE = str(Path(tempfile.gettempdir()) / f"privprompt-accounting-{_TEST_RUN}.json")
# every state folder's new MLflow store starts from one migrated empty database, made once per test
# run (both workers) instead of MLflow's schema migrations per state folder (tasks/record.py)
os.environ["PRIVPROMPT_MLFLOW_TEMPLATE"] = str(Path(tempfile.gettempdir()) / f"privprompt-mlflow-template-{_TEST_RUN}")
# and every new PREFECT_HOME of a CLI run (tasks/state.configure_environment) from a copy of the test
# Prefect server's database as it was right after its first start (migrated, blocks registered, no
# flow run yet: prefect_harness keeps it), instead of a first start's ~15 s more
os.environ["PRIVPROMPT_PREFECT_TEMPLATE"] = str(Path(tempfile.gettempdir()) / f"privprompt-prefect-template-{_TEST_RUN}.db")
os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = str(_SESSION_DIR / "prefect" / "storage")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "180"
os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
os.environ["DO_NOT_TRACK"] = "true"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.pop("MLFLOW_TRACKING_URI", None)
os.environ.pop("PRIVPROMPT_LEDGER_URL", None)  # each test's ledger is its state folder's file unless it says otherwise
os.environ.pop("PRIVPROMPT_TEAM_KEY_FILE", None)  # a team ledger's key is the state folder's key file unless a test says otherwise

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(autouse=True)
def _the_runs_shared_accounting_cache():
    """Every test starts with the test run's shared accounting cache (``SHARED_ACCOUNTING_CACHE``),
    whatever an earlier test's flow set (a flow enables its state folder's only when none is set,
    privacy/calibration_cache.py); tests of the cache itself set or remove it."""
    os.environ["PRIVPROMPT_ACCOUNTING_CACHE"] = SHARED_ACCOUNTING_CACHE
    yield


@pytest.fixture(scope="session")
def prefect_harness():
    """One Prefect test server for the whole session (each one costs 11-15 s)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        _keep_prefect_template()
        yield


def _keep_prefect_template() -> None:
    """A consistent copy (sqlite's backup) of the test server's database, before any flow ran in it,
    as the run's ``PRIVPROMPT_PREFECT_TEMPLATE`` (the first worker to get here makes it)."""
    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL

    from tasks.templates import backup_sqlite

    target = Path(os.environ["PRIVPROMPT_PREFECT_TEMPLATE"])
    url = PREFECT_SERVER_DATABASE_CONNECTION_URL.value()
    if target.exists() or not url.startswith("sqlite+aiosqlite:///"):
        return
    backup_sqlite(Path(url.removeprefix("sqlite+aiosqlite:///")), target)


@pytest.fixture(scope="session")
def sst2_dir():
    if not (SHARED_DATA / "sst2" / "train.jsonl").is_file():
        pytest.skip("../shared/data/sst2 is not available")
    return SHARED_DATA / "sst2"


def key_with_records_in_training(state_dir, data: dict, texts: list[str], labels: list[str]) -> bytes:
    """Write ``<state_dir>/secrets/installation.key``: the first of a fixed series of keys under
    which every given record (planted canaries) falls in the TRAINING split. Splits are keyed
    per-record hashes, so with a fresh random key a canary sits in the holdout some of the time
    and a leak test would test less; this makes the tests deterministic and always strong."""
    import hashlib

    from tasks.data import assign_splits
    from tasks.schema import DataConfig

    cfg = DataConfig(**data)
    for i in range(10_000):
        key = hashlib.sha256(f"privprompt-test-key-{i}".encode()).digest()
        train, _ = assign_splits(cfg, key, texts, labels)
        if train.all():
            break
    else:
        raise AssertionError("no test key puts every record in training")
    folder = Path(state_dir) / "secrets"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    (folder / "installation.key").write_bytes(key)
    (folder / "installation.key").chmod(0o600)
    return key
