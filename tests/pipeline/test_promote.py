"""The release gate (issue 40): a registered version gets the alias ``candidate``; ``privprompt
promote`` moves ``production`` only when no gate fails, records every gate as a version tag and
writes the model card; a run whose canary audit failed is refused (one line per gate, exit != 0)
unless ``--force``, which records the failure. The gates' own rules are checked on their inputs."""

from __future__ import annotations

import pytest
import torch
import yaml

LABELS = ["negative", "positive"]
SPEND = {"epsilon": 3.5, "delta": 1e-5, "accountant": "min(pld, rdp)"}
GOOD = {"privacy.epsilon": 3.5, "privacy.delta": 1e-5, "audit.epsilon_lower_bound": 0.41, "mia.lira.auc": 0.56,
        "mia.lira.auc_low": 0.49, "selection.winner.holdout_score": 0.71, "selection.no_prompt.holdout_score": 0.52,
        "test.accuracy": 0.7, "runtime.train_s": 3.0}


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    import os

    from tasks.record import client, ensure_experiment
    from tasks.state import state_paths

    os.environ.pop("MLFLOW_TRACKING_URI", None)
    paths = state_paths(tmp_path_factory.mktemp("promote") / "state")
    paths.create()
    mlflow = client(paths)
    return {"paths": paths, "client": mlflow, "experiment": ensure_experiment(mlflow, "tests", paths)}


def publish(state, name: str, metrics: dict, seed: int = 1, peft_seed: int | None = None, config: dict | None = None,
            prompt=None, method: str = "prompt_dpsgd", source: str = "trained", run_tags: dict | None = None):
    """A parent run as a dp flow leaves it (metrics, published prompt, a training child with the
    PEFT adapter) and its registered version, as ``tasks.publish.publish_usable`` makes them."""
    from models import load_backbone
    from models.backbone_ref import backbone_reference, base_model_name_or_path
    from models.prompts import save_prompt_artifact
    from models.prompts.peft_export import save_peft_adapter
    from tasks.model_card import write_card
    from tasks.registry_model import register_output

    mlflow, paths = state["client"], state["paths"]
    tags = {"method": method, "dataset": name.split(".")[1], "privacy.guarantee": "dp", **(run_tags or {})}
    parent = mlflow.create_run(state["experiment"], tags=tags).info.run_id
    outputs = paths.root / "outputs" / parent
    outputs.mkdir(parents=True)
    if config is not None:
        mlflow.log_text(parent, yaml.safe_dump(config), "config.yaml")
    backbone = load_backbone("tiny-gpt2", "cpu")
    if prompt is None:
        prompt = torch.randn(3, backbone.embed_dim, generator=torch.Generator().manual_seed(seed))
    suffix = ".json" if getattr(prompt, "kind", None) == "text" else ".safetensors"
    path = save_prompt_artifact(outputs / f"{method}{suffix}", prompt, {"privacy.guarantee": "dp"})
    mlflow.log_artifact(parent, str(path), "prompt")
    ref = backbone_reference("tiny-gpt2", 0)
    spec = {"method": method, "backbone": ref, "model": "tiny-gpt2", "labels": LABELS,
            "label_descriptions": {}, "template": None, "max_length": 32, "seed": 0}
    for key, value in metrics.items():
        mlflow.log_metric(parent, key, value)
    version = register_output(mlflow, parent, name, spec, path, "dp", SPEND, "fp-toy", paths.private,
                              extra_tags={"prompt.source": source})
    write_card(mlflow, version, spec)
    child = mlflow.create_run(state["experiment"], tags={"mlflow.parentRunId": parent, "stage": "train",
                                                         "registry.model": f"models:/{name}/{version.version}"})
    if suffix == ".safetensors":
        adapter = outputs / "peft"
        exported = prompt if peft_seed is None else torch.randn(3, backbone.embed_dim,
                                                                generator=torch.Generator().manual_seed(peft_seed))
        save_peft_adapter(adapter, exported, backbone.model, backbone.kind, base_model_name_or_path(ref))
        mlflow.log_artifacts(child.info.run_id, str(adapter), "peft")
    return version


def _aliases(mlflow, name: str) -> dict[str, str]:
    return {alias: str(v) for alias, v in mlflow.get_registered_model(name).aliases.items()}


def test_a_good_run_is_promoted_with_every_gate_recorded(state, capsys):
    from privprompt_cli import main

    name = "privprompt.toy.prompt_dpsgd"
    version = publish(state, name, GOOD)
    mlflow = state["client"]
    assert _aliases(mlflow, name) == {"candidate": "1"}
    card = mlflow.get_model_version(name, version.version).description
    assert "| canary | not checked |" in card and "dataset fingerprint:** `fp-toy`" in card
    capsys.readouterr()
    rc = main(["--state-dir", str(state["paths"].root), "promote", f"models:/{name}@candidate"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0, out
    assert [line.split(":")[0] for line in out[:4]] == ["gate canary", "gate lira", "gate holdout", "gate adapter"]
    assert out[-1] == f"promoted models:/{name}/1: models:/{name}@production"
    tags = mlflow.get_model_version(name, "1").tags
    assert {tags[f"gate.{g}"] for g in ("canary", "lira", "holdout", "adapter")} == {"pass"}
    assert tags["gate.canary.reason"] == "canary audit ε lower bound 0.410 ≤ ε 3.500"
    assert "≤ the AUC bound 0.971 of (ε 3.500, δ 1e-05)" in tags["gate.lira.reason"]
    assert "PEFT adapter loads and scores the probes as PrivPrompt does" in tags["gate.adapter.reason"]
    assert "gate.forced" not in tags
    assert _aliases(mlflow, name) == {"candidate": "1", "production": "1"}
    card = mlflow.get_model_version(name, "1").description
    for text in ("**method:** prompt_dpsgd", "**ε:** 3.5000 per record", "**δ:** 1e-05", "min(pld, rdp)",
                 "**privacy unit:** record", "| canary | pass | canary audit ε lower bound 0.410",
                 "What the guarantee does not cover", "`test.accuracy`", "`mia.lira.auc`", "`runtime.train_s`"):
        assert text in card, text


def test_a_run_whose_canary_audit_failed_is_refused_unless_forced(state, capsys):
    """The test double: the DP run's canary audit logged an ε lower bound above its ε (what a broken
    implementation gives). promote refuses with one line per gate; --force promotes, recorded."""
    from privprompt_cli import main

    name = "privprompt.toy.broken"
    publish(state, name, {**GOOD, "audit.epsilon_lower_bound": 5.2})
    mlflow = state["client"]
    capsys.readouterr()
    rc = main(["--state-dir", str(state["paths"].root), "promote", f"models:/{name}/1"])
    captured = capsys.readouterr()
    assert rc == 5
    lines = captured.out.splitlines()
    assert len(lines) == 4 and lines[0].startswith("gate canary: FAIL: canary audit ε lower bound 5.200 > ε 3.500")
    assert all(line.split(": ")[1] == "PASS" for line in lines[1:])
    assert captured.err.strip().splitlines() == [f"privprompt: refused: models:/{name}/1 stays out of production "
                                                 "(1 gate(s) failed; --force promotes it with the failures recorded)"]
    assert "production" not in _aliases(mlflow, name)
    assert mlflow.get_model_version(name, "1").tags["gate.canary"] == "fail"
    assert "| canary | fail |" in mlflow.get_model_version(name, "1").description

    assert main(["--state-dir", str(state["paths"].root), "promote", f"models:/{name}/1", "--force"]) == 0
    assert _aliases(mlflow, name)["production"] == "1"
    tags = mlflow.get_model_version(name, "1").tags
    assert tags["gate.forced"] == "promoted with --force despite: canary" and tags["gate.canary"] == "fail"
    assert "Promoted with --force" in mlflow.get_model_version(name, "1").description


def test_an_adapter_that_does_not_score_like_privprompt_fails_its_gate(state):
    """A PEFT adapter that is not the published prompt (an export gone wrong) fails the adapter gate."""
    from tasks.promotion import promote

    name = "privprompt.toy.corrupt"
    publish(state, name, GOOD, peft_seed=7)
    out = promote(state["client"], f"models:/{name}/latest")
    (adapter,) = [g for g in out.gates if g.name == "adapter"]
    assert adapter.status == "fail" and "PEFT adapter's scores differ" in adapter.reason
    assert not out.promoted and [g.name for g in out.failed] == ["adapter"]


def _candidate(metrics: dict, **tags):
    from tasks.release_gates import Candidate

    return Candidate("privprompt.toy.m", "1", "run", {"privacy.epsilon": "1.0", "privacy.delta": "1e-05",
                                                     "privacy.guarantee": "dp", **tags}, metrics, metrics)


def test_gate_rules_on_their_inputs():
    from privacy.tradeoff import dp_auc_bound
    from tasks.release_gates import canary_gate, holdout_gate, lira_gate

    bound = dp_auc_bound(1.0, 1e-5)  # ≈ 0.731
    assert lira_gate(_candidate({"mia.lira.auc": 0.70})).status == "pass"
    # the interval's lower end decides: an AUC above the bound within sampling error passes
    assert lira_gate(_candidate({"mia.lira.auc": 0.76, "mia.lira.auc_low": 0.70})).status == "pass"
    failed = lira_gate(_candidate({"mia.lira.auc": 0.9, "mia.lira.auc_low": 0.85, "mia.lira_offline.auc": 0.6}))
    assert failed.status == "fail" and f"{bound:.3f}" in failed.reason and "mia.lira.auc 0.900" in failed.reason
    assert lira_gate(_candidate({})).status == "skipped"
    assert canary_gate(_candidate({})).status == "skipped"
    assert canary_gate(_candidate({"audit.epsilon_lower_bound": 1.0})).status == "pass"
    ldp = _candidate({"audit.epsilon_lower_bound": 9.0}, **{"privacy.epsilon": "none", "privacy.guarantee": "ldp"})
    assert canary_gate(ldp).status == "skipped" and lira_gate(ldp).status == "skipped"
    # released holdout scores: the selection's pair, a released comparison's pair, or X beside no_prompt.X
    assert holdout_gate(_candidate({})).status == "skipped"
    worse = holdout_gate(_candidate({"prompt.released_holdout_score": 0.4, "no_prompt.released_holdout_score": 0.5}))
    assert worse.status == "fail" and "below no prompt" in worse.reason
    generic = holdout_gate(_candidate({"holdout.balanced_accuracy": 0.6, "no_prompt.holdout.balanced_accuracy": 0.6}))
    assert generic.status == "pass" and "holdout.balanced_accuracy 0.6000" in generic.reason
    # every dp run's released comparison with no prompt (issue 41): D̃ below zero fails, at or above passes
    lost = holdout_gate(_candidate({"no_prompt.released_difference": -3.2, "no_prompt.noise_sigma": 5.2}))
    assert lost.status == "fail" and "D̃ = -3.20 (noise σ 5.20)" in lost.reason
    won = holdout_gate(_candidate({"no_prompt.released_difference": 12.0, "no_prompt.noise_sigma": 5.2}))
    assert won.status == "pass" and "D̃ = 12.00" in won.reason


def test_promote_names_what_it_cannot_find_in_one_line(state, capsys):
    from privprompt_cli import main

    capsys.readouterr()
    assert main(["--state-dir", str(state["paths"].root), "promote", "models:/privprompt.toy.none/1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("privprompt: error: ") and "privprompt.toy.none" in err[0]
    assert main(["--state-dir", str(state["paths"].root), "promote", "runs:/abc/model"]) == 2
    assert "is not models:/NAME/VERSION" in capsys.readouterr().err


def test_the_ledger_says_which_version_is_in_production(state, capsys):
    """privprompt ledger names, per dataset, the version with the alias 'production'; a dataset
    with none says so."""
    from privprompt_cli import main
    from tasks.promotion import production_versions, production_versions_local

    mlflow, root = state["client"], str(state["paths"].root)
    name = "privprompt.shop.prompt_dpsgd"
    state["paths"].open_ledger().register_dataset("fp-shop", "shop", 10.0, 1e-5)
    capsys.readouterr()
    assert main(["--state-dir", root, "ledger"]) == 0
    assert "in production: none (privprompt promote MODEL_URI" in capsys.readouterr().out
    publish(state, name, GOOD)
    publish(state, name, GOOD, seed=2)
    assert main(["--state-dir", root, "promote", f"models:/{name}/1"]) == 0
    rows = {r["model"]: r for r in production_versions(mlflow, {"shop"})}
    # the ledger's fast path (the SQLite store read without MLflow) reads the same rows
    assert production_versions_local(state["paths"].mlflow_db, {"shop"}) == list(rows.values())
    assert production_versions_local(state["paths"].root / "no.db") is None
    assert list(rows) == [name] and rows[name]["version"] == "1" and rows[name]["epsilon"] == "3.5"
    assert _aliases(mlflow, name) == {"candidate": "2", "production": "1"}
    capsys.readouterr()
    assert main(["--state-dir", root, "ledger"]) == 0
    out = capsys.readouterr().out
    assert "in production (MLflow registry, alias 'production'):" in out
    assert f"  shop: models:/{name}/1 (ε = 3.5000, unit record, fingerprint fp-toy)" in out


@pytest.mark.slow  # the report's figures and Prefect's import (≈ 8 s)
def test_the_report_says_which_version_is_in_production(state, capsys):
    """privprompt report: the production lines of its datasets, also as report/production.md."""
    from privprompt_cli import main

    mlflow, root = state["client"], str(state["paths"].root)
    name = "privprompt.report.prompt_dpsgd"
    publish(state, name, GOOD)
    assert main(["--state-dir", root, "promote", f"models:/{name}/1"]) == 0
    for run_id in {v.run_id for v in mlflow.search_model_versions(f"name='{name}'")}:
        mlflow.set_tag(run_id, "privacy.guarantee", "dp")
        mlflow.set_terminated(run_id)
    assert main(["--state-dir", root, "report", "tests"]) == 0
    out = capsys.readouterr().out
    assert f"  report: models:/{name}/1 (ε = 3.5000" in out
    report = mlflow.search_runs([state["experiment"]], "tags.flow = 'report'")[0]
    assert any(a.path == "report/production.md" for a in mlflow.list_artifacts(report.info.run_id, "report"))


@pytest.mark.slow  # a model server's start-up (≈ 20-60 s on two shared cores)
def test_mlflow_models_serve_answers_for_the_production_alias(state, tmp_path):
    """The promoted version, served by its alias: ``mlflow models serve -m models:/NAME@production``
    answers with PrivPrompt's own labels."""
    import json

    from privprompt_cli import main
    from tasks.registry_model import Predictor, download_model
    from tests.pipeline.test_registry_flow import served_answer
    from tasks.release_gates import PROBE_TEXTS

    name = "privprompt.serve.prompt_dpsgd"
    publish(state, name, GOOD)
    assert main(["--state-dir", str(state["paths"].root), "promote", f"models:/{name}/1"]) == 0
    folder = download_model(state["client"], f"models:/{name}@production", tmp_path / "model")
    spec = json.loads((folder / "artifacts" / "spec.json").read_text())
    own = Predictor.build(spec, folder / "artifacts" / "prompt_dpsgd.safetensors").predict(list(PROBE_TEXTS))
    answer = served_answer(state["paths"].mlflow_db, f"models:/{name}@production",
                           {"dataframe_records": [{"text": t} for t in PROBE_TEXTS]}, tmp_path / "serve.log")
    assert answer is not None, (tmp_path / "serve.log").read_text()[-2000:]
    assert [p["label"] for p in answer["predictions"]] == own["label"].tolist()


def test_the_canary_gate_holds_a_per_person_run_to_its_record_level_claim():
    """A record-level run charged per person states ε per person; its single-record canaries are
    held to the per-record ε (the audit's own claim, flows.audit.target_from_run)."""
    from tasks.release_gates import canary_gate

    per_person = _candidate({"privacy.epsilon_per_record": 0.5, "audit.epsilon_lower_bound": 0.8},
                            **{"privacy.epsilon": "2.0"})
    failed = canary_gate(per_person)
    assert failed.status == "fail" and "> ε 0.500" in failed.reason
    assert canary_gate(_candidate({"privacy.epsilon_per_record": 0.9, "audit.epsilon_lower_bound": 0.8})).status == "pass"


def test_the_lira_gate_holds_a_per_person_run_to_its_record_level_claim():
    """LiRA attacks single records: a record-level run charged per person (ε 18.6 per person, 1 per
    record) is held to the per-record bound (AUC 0.731 at ε 1), not the per-person one (1.000)."""
    from privacy.tradeoff import dp_auc_bound
    from tasks.release_gates import lira_gate

    per_person = _candidate({"privacy.epsilon_per_record": 1.0, "mia.lira.auc": 0.9, "mia.lira.auc_low": 0.85},
                            **{"privacy.epsilon": "18.6", "privacy.delta": "1e-5"})
    failed = lira_gate(per_person)
    assert failed.status == "fail" and f"{dp_auc_bound(1.0, 1e-5):.3f}" in failed.reason
    assert dp_auc_bound(18.6, 1e-5) > 0.99  # the per-person bound would have passed it
    passed = lira_gate(_candidate({"privacy.epsilon_per_record": 1.0, "mia.lira.auc": 0.6},
                                  **{"privacy.epsilon": "18.6", "privacy.delta": "1e-5"}))
    assert passed.status == "pass" and "per record" in passed.reason


def test_the_canary_gate_runs_a_missing_audit_through_its_runner():
    from tasks.release_gates import CanaryAuditFailed, canary_gate

    calls = []

    def runner(run_id):
        calls.append(run_id)
        return 0.25, ""

    ran = canary_gate(_candidate({}), runner)
    assert calls == ["run"] and ran.status == "pass" and ran.reason.endswith("(audit run now by promote)")
    assert canary_gate(_candidate({}), lambda run_id: (None, "the run planted no canaries")).reason.endswith(
        "none ran now: the run planted no canaries")

    def broken(run_id):
        raise CanaryAuditFailed("empirical ε lower bound 3.100 exceeds the claimed ε = 1.000")

    assert canary_gate(_candidate({}), broken).status == "fail"
    assert canary_gate(_candidate({"audit.epsilon_lower_bound": 0.1}), broken).status == "pass"  # logged: not rerun


def test_the_model_without_a_prompt_is_registered_servable_and_promotable(state, capsys):
    """A run whose prompt lost to no prompt registers the model without one (an empty text prompt:
    the template and label words): it predicts as zero-shot does, its card says what it is with the
    run's test numbers and warnings, and its gates pass on what it is (nothing trained in it)."""
    import mlflow.pyfunc as pyfunc
    import pandas as pd

    from models.backbone_ref import backbone_reference
    from models.prompts.text import TextPrompt
    from privprompt_cli import main
    from tasks.registry_model import Predictor, download_model

    name = "privprompt.toy.fell_back"
    fell_back = {"privacy.epsilon": 3.5, "privacy.delta": 1e-5, "no_prompt.released_difference": -6.2,
                 "no_prompt.noise_sigma": 2.0, "no_prompt.fallback": 1.0, "test.accuracy": 0.6,
                 "test.balanced_accuracy": 0.55, "test.recall.negative": 0.9, "test.recall.positive": 0.2}
    warning = "the released comparison says the prompt is worse than no prompt"
    version = publish(state, name, fell_back, prompt=TextPrompt(""), source="none", run_tags={"warning": warning})
    mlflow = state["client"]
    tags = mlflow.get_model_version(name, version.version).tags
    assert tags["prompt.source"] == "none" and tags["privacy.epsilon"] == "3.5" and tags["privacy.unit"] == "record"
    card = mlflow.get_model_version(name, version.version).description
    assert "**No prompt.**" in card and "test accuracy:** 0.6000 (no prompt's" in card
    assert "balanced accuracy:** 0.5500 (recall per class: negative 0.9000, positive 0.2000)" in card
    assert f"- {warning}" in card
    folder = download_model(mlflow, f"models:/{name}/{version.version}", state["paths"].root / "dl-none")
    texts = ["a fine day", "an awful film", "the bus was late"]
    served = pyfunc.load_model(str(folder)).predict(pd.DataFrame({"text": texts}))
    spec = {"backbone": backbone_reference("tiny-gpt2", 0),
            "labels": LABELS, "label_descriptions": {}, "template": None, "max_length": 32}
    zero_shot = Predictor.build(spec, next(p for p in (folder / "artifacts").glob("*.json") if p.name != "spec.json"))
    assert zero_shot.prompt is None  # no trained parameter: the classifier as zero-shot builds it
    assert served["label"].tolist() == zero_shot.predict(texts)["label"].tolist()
    rows = state["paths"].root / "rows.csv"
    pd.DataFrame({"text": texts}).to_csv(rows, index=False)
    capsys.readouterr()
    assert main(["--state-dir", str(state["paths"].root), "predict", f"models:/{name}/{version.version}",
                 "--input", str(rows), "--output", str(state["paths"].root / "out.csv")]) == 0
    assert f"models:/{name}/{version.version}: no prompt — the model with its template and label words" in \
        capsys.readouterr().err
    rc = main(["--state-dir", str(state["paths"].root), "promote", f"models:/{name}@candidate"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "gate canary: SKIPPED: no prompt: nothing in this version was trained on the private data"
    assert lines[2].startswith("gate holdout: PASS: it is the model without a prompt; the run's prompt did not beat "
                               "it (released D̃ = -6.20)")
    assert lines[3].startswith("gate adapter: PASS")
    assert rc == 0 and _aliases(mlflow, name)["production"] == str(version.version)
