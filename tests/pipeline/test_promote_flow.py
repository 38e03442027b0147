"""promote on a real dp run (issue 40): a run that planted canaries but ran no audit has its canary
audit run by promote's gate (recorded in the ledger as a non-private use, logged on the run), and
is promoted when the bound holds; the card and the ledger say so."""

from __future__ import annotations

import pytest
from tests.pipeline.test_audit_flow import _audit_config


@pytest.fixture(scope="module")
def canary_run(prefect_harness, sst2_dir, tmp_path_factory):
    from flows.method_flow import method_flow

    root = tmp_path_factory.mktemp("promote-flow")
    data = root / "data"
    data.mkdir()
    lines = (sst2_dir / "train.jsonl").open().readlines()
    (data / "train.jsonl").write_text("".join(lines[:200]))
    (data / "test.jsonl").write_text("".join((sst2_dir / "test.jsonl").open().readlines()[:40]))
    state = root / "state"
    config = _audit_config(data, state)
    config["audit"]["enabled"] = False  # canaries planted, no audit in the flow
    summary = method_flow(config)
    return {"summary": summary, "state": state}


@pytest.mark.slow  # a dp flow run (≈ 60 s)
def test_promote_runs_the_missing_canary_audit_and_promotes(canary_run, capsys):
    from mlflow.tracking import MlflowClient

    from privprompt_cli import main

    state = canary_run["state"]
    uri = f"sqlite:///{state / 'mlflow.db'}"
    mlflow = MlflowClient(tracking_uri=uri, registry_uri=uri)
    run_id = canary_run["summary"]["mlflow_run_id"]
    assert "audit.epsilon_lower_bound" not in mlflow.get_run(run_id).data.metrics
    name = "privprompt.toy-audit.prompt_dpsgd"
    capsys.readouterr()
    rc = main(["--state-dir", str(state), "promote", f"models:/{name}@candidate"])
    out = capsys.readouterr().out
    bound = mlflow.get_run(run_id).data.metrics["audit.epsilon_lower_bound"]
    eps = mlflow.get_run(run_id).data.metrics["privacy.epsilon"]
    assert 0 <= bound <= eps
    tags = mlflow.get_model_version(name, "1").tags
    assert tags["gate.canary"] == "pass" and "(audit run now by promote)" in tags["gate.canary.reason"]
    assert tags["gate.adapter"] == "pass", tags["gate.adapter.reason"]
    assert tags["gate.lira"] == "skipped"
    # the run published its prompt whatever the released comparison said (fallback off): the holdout gate
    # reads that comparison, and a prompt below no prompt is not promoted without --force
    below = mlflow.get_run(run_id).data.metrics["no_prompt.released_difference"] < 0
    assert tags["gate.holdout"] == ("fail" if below else "pass"), tags["gate.holdout.reason"]
    assert rc == (5 if below else 0), out
    if below:
        assert "production" not in mlflow.get_registered_model(name).aliases
        assert main(["--state-dir", str(state), "promote", f"models:/{name}@candidate", "--force"]) == 0
        capsys.readouterr()
    assert {k: str(v) for k, v in mlflow.get_registered_model(name).aliases.items()} == \
        {"candidate": "1", "production": "1"}
    from tasks.state import state_paths

    uses = [e for e in state_paths(state).open_ledger().entries() if "canary audit of run" in str(e.get("description", ""))]
    assert len(uses) == 1 and uses[0]["kind"] != "dp"
    assert main(["--state-dir", str(state), "ledger"]) == 0
    assert f"  toy-audit: models:/{name}/1 (ε = " in capsys.readouterr().out
