"""The CLI end to end on a tiny model (its own file, so that its run and test_flow.py's flow run can
go to different test workers): the ids and headline, planted canaries never leaving private/, the
ledger listing the spend, bad input as one line without a traceback."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tests.conftest import key_with_records_in_training

from tests.pipeline.test_flow import CANARIES, _config, _mlflow, _toy_dataset

REPO = Path(__file__).resolve().parents[2]


# ---- the CLI, end to end, with planted canaries ------------------------------------------------

def _cli(args, env_extra, cwd, timeout=600):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-m", "privprompt_cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def cli_run(sst2_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    data = _toy_dataset(root / "data", sst2_dir, n_train=160, n_test=60, canaries=CANARIES)
    cfg = _config(data, root / "unused")
    del cfg["state_dir"]
    (root / "run.yaml").write_text(yaml.safe_dump(cfg))
    state = root / "state"
    key_with_records_in_training(state, cfg["data"], [f"{c} , a film" for c in CANARIES], ["positive"] * 2)
    proc = _cli(["run", str(root / "run.yaml")], {"PRIVPROMPT_HOME": str(state), "PYTHONPATH": str(REPO)}, root)
    return {"proc": proc, "state": state, "root": root}


def test_cli_run_prints_ids_and_headline(cli_run):
    proc = cli_run["proc"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "prefect flow run:" in proc.stdout and "mlflow run:" in proc.stdout
    assert "ε = " in proc.stdout and "test.accuracy:" in proc.stdout


def test_canaries_never_leave_private(cli_run):
    """MLflow database and artifacts, Prefect database and result storage, logs, stdout/stderr:
    no planted canary anywhere outside <state>/private/."""
    state, proc = cli_run["state"], cli_run["proc"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    needles = [c.encode() for c in CANARIES] + [c.split()[0].encode() for c in CANARIES]
    private = state / "private"
    scanned, found_private = 0, False
    for path in state.rglob("*"):
        if not path.is_file():
            continue
        blob = path.read_bytes()
        if private in path.parents:
            found_private |= any(n in blob for n in needles[:1]) or path.suffix == ".parquet"
            continue
        scanned += 1
        for n in needles:
            assert n not in blob, f"canary {n!r} leaked into {path.relative_to(state)}"
    assert scanned > 5 and (state / "mlflow.db").is_file() and (state / "prefect").is_dir()
    assert found_private  # the canaries are there, in private/, where they belong
    for n in CANARIES + [c.split()[0] for c in CANARIES]:
        assert n not in proc.stdout and n not in proc.stderr


def test_cli_ledger_lists_spend(cli_run):
    proc = _cli(["ledger"], {"PRIVPROMPT_HOME": str(cli_run["state"]), "PYTHONPATH": str(REPO)}, cli_run["root"])
    assert proc.returncode == 0, proc.stderr
    assert "toy-sst2" in proc.stdout and "prompt_sgd" in proc.stdout


@pytest.mark.parametrize("override,needle", [
    ("privacy.target_epsilon=0", "privacy.target_epsilon"),
    ("privacy.target_delta=2", "privacy.target_delta"),
    ("privacy.nonsense=1", "unknown config key"),
    # fails inside the flow after Prefect starts (≈ 50 s); the message itself: tests/pipeline/test_models.py
    pytest.param("models.local=no-such-model/really", "cannot load model 'no-such-model/really'", marks=pytest.mark.slow),
    ("data.path=/nonexistent/folder", "data folder not found"),
])
def test_cli_bad_input_is_one_line_without_traceback(cli_run, override, needle):
    state = cli_run["root"] / f"bad-{abs(hash(override))}"
    proc = _cli(["run", str(cli_run["root"] / "run.yaml"), "--set", override],
                {"PRIVPROMPT_HOME": str(state), "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}, cli_run["root"])
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    errors = [l for l in proc.stderr.splitlines() if l.startswith("privprompt: error:")]
    assert len(errors) == 1 and needle in errors[0], proc.stderr[-2000:]
    if (state / "mlflow.db").exists():  # failed inside the flow: no run left RUNNING
        client = _mlflow(state)
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert all(r.info.status != "RUNNING" for r in runs)
    if (state / "ledger.sqlite").exists():
        from privacy.ledger import Ledger

        assert all(d["spent_epsilon"] == 0 for d in Ledger(state / "ledger.sqlite").datasets())


