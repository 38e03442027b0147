"""``privprompt retarget`` (issue 40): a released soft prompt moves to another backbone by POST's
public-data transfer, a DP-OPT instruction is re-evaluated on the new target; either way nothing
private is read (the private folder and the private source are moved away and every Python-level
open is recorded, as in tests/methods/post/test_post_flow.py), the ledger is unchanged, and the new
version keeps its parent's privacy tags, names its parent, gets 'candidate' and is gated like any other."""

from __future__ import annotations

import builtins
import io
import json
from pathlib import Path

import pytest
from tests.pipeline.test_promote import GOOD, _aliases, publish, state  # noqa: F401 - the module's fixture

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
LABELS = ["negative", "positive"]


def _config(data: Path, state_dir: Path) -> dict:
    return {"method": "prompt_dpsgd", "experiment": "tests", "seed": 0, "state_dir": str(state_dir),
            "data": {"name": "toy", "path": str(data), "labels": LABELS},
            "models": {"local": "tiny-gpt2", "max_length": 32},
            "privacy": {"target_epsilon": 3.5, "dataset_epsilon_cap": 50.0},
            "public": {"name": "tweet_sentiment", "path": str(SHARED / "tweet_sentiment"), "split": "validation",
                       "size": 64},
            "methods": {"post": {"transfer": {"steps": 3, "batch_size": 16}}}}


@pytest.fixture()
def private_source(tmp_path, sst2_dir):
    if not (SHARED / "tweet_sentiment" / "validation.jsonl").is_file():
        pytest.skip("../shared/data/tweet_sentiment is not available")
    data = tmp_path / "private-source"
    data.mkdir()
    rows = (sst2_dir / "train.jsonl").read_text().splitlines()[:20]
    (data / "train.jsonl").write_text("\n".join(rows) + "\n")
    (data / "test.jsonl").write_text("\n".join(rows[:5]) + "\n")
    return data


def _retarget_reading_nothing_private(state, monkeypatch, private_source, argv: list[str]) -> list[str]:
    """Run the CLI with the state's private/ and the private source moved away and every open recorded."""
    from privprompt_cli import main

    opened, real_open = [], io.open

    def spy(file, *a, **k):
        opened.append(str(file))
        return real_open(file, *a, **k)

    private = state["paths"].private
    private.mkdir(exist_ok=True)
    moved = [(private, private.with_name("private.hidden")), (private_source, private_source.with_name("hidden"))]
    for a, b in moved:
        a.rename(b)
    try:
        monkeypatch.setattr(io, "open", spy)
        monkeypatch.setattr(builtins, "open", spy)
        rc = main(["--state-dir", str(state["paths"].root), *argv])
    finally:
        monkeypatch.undo()
        for a, b in moved:
            b.rename(a)
    assert rc == 0
    assert any("tweet_sentiment" in f for f in opened)  # the spy sees the public reads
    assert not [f for f in opened if "private" in Path(f).resolve().parts or "private-source" in f]
    return opened


def _ledger(state) -> dict:
    export = state["paths"].open_ledger().export()
    return {k: v for k, v in export.items() if k in ("datasets", "entries", "cap_changes", "trail")}


def test_retarget_refuses_in_one_line(state, capsys):
    from privprompt_cli import main

    name = "privprompt.rt.noconfig"
    publish(state, name, GOOD)  # a run without its config.yaml
    capsys.readouterr()
    assert main(["--state-dir", str(state["paths"].root), "retarget", f"models:/{name}/1", "--target",
                 "tiny-bert"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no config.yaml artifact" in err[0]
    assert main(["--state-dir", str(state["paths"].root), "retarget", "models:/privprompt.rt.none/1", "--target",
                 "tiny-bert"]) == 2
    assert "privprompt.rt.none" in capsys.readouterr().err


def test_a_text_prompt_is_re_evaluated_and_re_registered_for_another_target(state, monkeypatch, private_source,
                                                                           capsys):
    from models.prompts.text import TextPrompt

    name = "privprompt.rt.dp_opt"
    instruction = "Say whether the review is positive or negative."
    publish(state, name, GOOD, config=_config(private_source, state["paths"].root), prompt=TextPrompt(instruction),
            method="dp_opt")
    ledger = state["paths"].open_ledger()
    ledger.register_dataset("fp-toy", "rt", 10.0, 1e-5)
    before = _ledger(state)
    _retarget_reading_nothing_private(state, monkeypatch, private_source,
                                      ["retarget", f"models:/{name}/latest", "--target", "tiny-bert"])
    assert _ledger(state) == before
    mlflow = state["client"]
    new = mlflow.get_model_version(name, "2")
    assert new.tags["privacy.epsilon"] == "3.5" and new.tags["lineage.parent"] == f"models:/{name}/1"
    prompt = Path(mlflow.download_artifacts(new.run_id, "registered_model/artifacts/dp_opt.json"))
    assert json.loads(prompt.read_text())["instruction"] == instruction  # the same instruction, no new ε
    assert "retarget.transfer.loss_last" not in mlflow.get_run(new.run_id).data.metrics
    assert "retarget.public.accuracy" in mlflow.get_run(new.run_id).data.metrics


def test_a_soft_prompt_is_retargeted_on_public_data_only(state, monkeypatch, private_source, capsys):
    name = "privprompt.rt.prompt_dpsgd"
    parent = publish(state, name, GOOD, config=_config(private_source, state["paths"].root))
    state["paths"].open_ledger().register_dataset("fp-toy", "rt", 10.0, 1e-5)
    before = _ledger(state)
    capsys.readouterr()
    _retarget_reading_nothing_private(state, monkeypatch, private_source,
                                      ["retarget", f"models:/{name}/1", "--target", "tiny-bert"])
    out = capsys.readouterr().out
    assert "models:/privprompt.rt.prompt_dpsgd/2 (alias candidate" in out and "no ledger entry" in out
    assert "private record" not in out  # no word on whether public texts are private records: runs never look
    assert _ledger(state) == before  # spends nothing: the ledger is unchanged
    mlflow = state["client"]
    new = mlflow.get_model_version(name, "2")
    kept = {k: v for k, v in parent.tags.items() if k.startswith("privacy.") or k == "dataset.fingerprint"}
    assert kept["privacy.epsilon"] == "3.5" and {k: new.tags[k] for k in kept} == kept
    assert new.tags["lineage.parent"] == f"models:/{name}/1" and new.tags["lineage.dp_run"] == parent.run_id
    assert _aliases(mlflow, name) == {"candidate": "2"}
    run = mlflow.get_run(new.run_id)
    assert run.data.tags["mlflow.parentRunId"] == parent.run_id and run.data.tags["data"] == "public only"
    assert {"retarget.public.accuracy", "retarget.public.no_prompt.accuracy"} <= set(run.data.metrics)
    spec = json.loads(Path(mlflow.download_artifacts(new.run_id, "registered_model/artifacts/spec.json")).read_text())
    assert spec["model"] == "tiny-bert" and spec["backbone"]["name"] == "tiny-bert" and spec["labels"] == LABELS
    assert "retargeted from `models:/privprompt.rt.prompt_dpsgd/1`" in new.description

    # its gates run like any other's: the DP run's audits, its own public scores, its PEFT adapter on tiny-bert
    from tasks.promotion import promote

    gates = {g.name: g for g in promote(mlflow, f"models:/{name}@candidate").gates}
    assert gates["canary"].status == "pass" and gates["lira"].status == "pass"
    assert gates["holdout"].status in ("pass", "fail") and "retarget.public.accuracy" in gates["holdout"].reason
    # (a random tiny model may label every probe alike: then the gate fails it, and says so)
    assert gates["adapter"].status == "pass" or gates["adapter"].reason.startswith("one label ("), gates["adapter"]
    assert "PEFT adapter loads and scores the probes" in gates["adapter"].reason
