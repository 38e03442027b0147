"""dp_fewshot through the method flow with configs/dp_fewshot.yaml's settings on a small SST-2 sample:
the run record (ε from the accountant within the target, the neighbouring relation and σ as
params, the published prompt the generated demonstrations), the ledger's commit equal to the
plan, and no private training text (a planted canary) in what is published."""

import json
from pathlib import Path

import pytest
import yaml
from tests.conftest import key_with_records_in_training

from tests.pipeline.test_flow import _mlflow, _toy_dataset

pytestmark = pytest.mark.slow  # a flow on a tiny LM: about a minute on 2 shared cores

CANARY = "zqxv canary heliotrope quokka 5521"
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def fewshot_run(prefect_harness, sst2_dir, tmp_path_factory):
    from flows.method_flow import method_flow

    root = tmp_path_factory.mktemp("fewshot")
    data = _toy_dataset(root / "data", sst2_dir, n_train=150, n_test=30, canaries=[CANARY])
    state = root / "state"
    cfg = yaml.safe_load((REPO / "configs" / "dp_fewshot.yaml").read_text())
    cfg["state_dir"] = str(state)
    cfg["fallback"] = {"enabled": False}  # the published demos are inspected below, whatever the noisy comparison says
    cfg["data"] = {"name": "sst2", "path": str(data), "labels": ["negative", "positive"], "holdout_fraction": 0.1,
                   "size_noise_sigma": 5.0}
    key_with_records_in_training(state, cfg["data"], [f"{CANARY} , a film"], ["positive"])
    return {"summary": method_flow(cfg), "state": state, "cfg": cfg}


def test_run_record_and_ledger(fewshot_run):
    from privacy.ledger import Ledger

    client = _mlflow(fewshot_run["state"])
    run = client.get_run(fewshot_run["summary"]["mlflow_run_id"])
    m, params, tags = run.data.metrics, run.data.params, run.data.tags
    assert tags["method"] == "dp_fewshot" and tags["privacy.guarantee"] == "dp"
    assert 0 < m["privacy.epsilon"] <= 8.0 + 1e-6 and "test.accuracy" in m and "test.accuracy.zero_shot" in m
    assert params["dpfewshot.neighbouring"].startswith("add/remove one record")
    assert float(params["dpfewshot.noise_multiplier"]) > 0
    assert 1 <= m["dpfewshot.queries"] <= 2 * 2 * 8  # labels × demos × T at most
    ledger = Ledger(fewshot_run["state"] / "ledger.sqlite")
    (dp,) = [e for e in ledger.entries() if e["kind"] == "dp"]
    assert dp["status"] == "committed" and dp["epsilon_committed"] <= dp["epsilon_reserved"] + 1e-9
    uses = [e["description"] for e in ledger.entries() if e["kind"] == "nonprivate"]
    assert any("audit statistics" in u and "leakage" in u for u in uses)  # the exact-copy count
    prompt = json.loads(Path(client.download_artifacts(run.info.run_id, "prompt/dp_fewshot.json")).read_text())
    assert prompt["kind"] == "text" and prompt["instruction"].startswith("Classify the input text as")
    assert "Output: negative" in prompt["instruction"] or "Output: positive" in prompt["instruction"] \
        or m["dpfewshot.demos_nonempty"] == 0


def test_no_canary_or_training_text_is_published(fewshot_run):
    outputs = [p for p in (fewshot_run["state"]).rglob("*") if p.is_file() and "private" not in p.parts]
    for path in outputs:
        if path.suffix in (".json", ".txt", ".md", ".yaml"):
            assert "heliotrope quokka" not in path.read_text(errors="ignore"), path
