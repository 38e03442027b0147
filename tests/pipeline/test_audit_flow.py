"""Membership-inference attacks on tiny models with known answers, and the audit flow end to end
(Dask shadows, run record, canary audit, loud failure, bad input before any training)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from privacy import audit as stats


COLOURS = ["red", "blue", "green", "black", "white", "brown", "pink", "gray"]


def _random_label_texts(rng, n, prefix, n_labels=2):
    words = ["alpha", "bravo", "delta", "gamma", "kilo", "lima", "oscar", "sierra", "tango", "zulu"]
    texts = [f"{prefix} " + " ".join(rng.choice(words, size=6)) for _ in range(n)]
    return texts, torch.as_tensor(rng.integers(0, n_labels, size=n))


def _fine_tuned(texts, labels, seed, label_names=None):
    """A tiny GPT-2 classifier fully fine-tuned until it memorises ``texts``' random labels
    (memorisation planted on purpose: the attacks must find it)."""
    import copy

    from models.classifiers import build_classifier
    from models.backbones import load_backbone

    base = load_backbone("tiny-gpt2", seed=0)
    backbone = copy.copy(base)
    backbone.model = copy.deepcopy(base.model)
    for p in backbone.model.parameters():
        p.requires_grad_(True)
    clf = build_classifier(backbone, label_names or COLOURS)
    enc = clf.encode(texts, 24)
    opt = torch.optim.Adam(backbone.model.parameters(), lr=3e-3)
    torch.manual_seed(seed)
    for _ in range(150):
        loss = torch.nn.functional.cross_entropy(clf(enc), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    backbone.model.eval()
    return clf


@pytest.mark.slow  # suite time: runs with -m slow
def test_attacks_find_planted_memorisation():
    """Loss attack and LiRA (8 shadows on random halves of the pool) on models that memorised
    random labels (8 classes) of their members: AUC near 1."""
    from models.scoring import per_example_loss, true_label_logit_scores

    rng = np.random.default_rng(0)
    texts, y = _random_label_texts(rng, 32, "pool", n_labels=len(COLOURS))
    member = np.zeros(32, bool)
    member[:16] = True
    target = _fine_tuned(texts[:16], y[:16], 0)
    enc = target.encode(texts, 24)
    loss_scores = -per_example_loss(target, enc, y).numpy()
    auc, low, _ = stats.auc_with_ci(loss_scores, member, rng=np.random.default_rng(0))
    assert auc > 0.85 and low > 0.7  # non-members match a random label by chance only 1 in 8

    mask = np.argsort(rng.random((8, 32)), axis=0) < 4
    shadow_scores = []
    for k in range(8):
        idx = np.flatnonzero(mask[k])
        shadow = _fine_tuned([texts[i] for i in idx], y[idx], k + 1)
        shadow_scores.append(true_label_logit_scores(shadow, shadow.encode(texts, 24), y).numpy())
    lira = stats.lira_scores_online(true_label_logit_scores(target, enc, y).numpy(), np.stack(shadow_scores), mask)
    assert stats.auc(lira, member) > 0.85


def test_attack_on_examples_never_seen_is_chance():
    from models.classifiers import build_classifier
    from models.backbones import load_backbone
    from models.scoring import per_example_loss

    rng = np.random.default_rng(1)
    clf = build_classifier(load_backbone("tiny-bert", seed=0), ["negative", "positive"])
    a, ya = _random_label_texts(rng, 400, "sample")
    b, yb = _random_label_texts(rng, 400, "sample")
    scores = -np.r_[per_example_loss(clf, clf.encode(a, 24), ya).numpy(), per_example_loss(clf, clf.encode(b, 24), yb).numpy()]
    member = np.r_[np.ones(400, bool), np.zeros(400, bool)]
    auc, low, high = stats.auc_with_ci(scores, member, rng=np.random.default_rng(0))
    assert low < 0.5 < high and abs(auc - 0.5) < 0.06


# ---- the audit flow ---------------------------------------------------------------------------

def _audit_config(data_dir, state_dir, **audit):
    return {
        "method": "prompt_dpsgd", "experiment": "audit-tests", "seed": 0, "state_dir": str(state_dir),
        "data": {"name": "toy-audit", "path": str(data_dir), "labels": ["negative", "positive"],
                 "train_fraction": 0.2, "holdout_fraction": 0.18, "canaries": 30,
                 # the pool is sized from the RELEASED sizes: at the default σ = 50 records, a ~36-row
                 # holdout would be released below the 20 non-members FPR 0.05 needs about a third of the time
                 "size_noise_sigma": 2.0},
        "models": {"local": "tiny-gpt2", "max_length": 24},
        "privacy": {"target_epsilon": 4.0, "dataset_epsilon_cap": 100.0},
        "methods": {"prompt_dpsgd": {"n_tokens": 3, "epochs": 1, "batch_size": 16}},
        "fallback": {"enabled": False},  # a prompt to audit, whatever the noisy comparison says
        "mia": {"enabled": False},
        "audit": {"enabled": True, "shadows": 2, "fprs": [0.05], "dask": {"n_workers": 2}, **audit},
    }


@pytest.fixture(scope="module")
def audited(prefect_harness, sst2_dir, tmp_path_factory):
    from flows.method_flow import method_flow

    root = tmp_path_factory.mktemp("audit")
    data = root / "data"
    data.mkdir()
    lines = (sst2_dir / "train.jsonl").open().readlines()
    (data / "train.jsonl").write_text("".join(lines[:200]))
    (data / "test.jsonl").write_text("".join((sst2_dir / "test.jsonl").open().readlines()[:40]))
    state = root / "state"
    summary = method_flow(_audit_config(data, state))
    return {"summary": summary, "state": state, "data": data, "root": root}


def _client(state):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{state / 'mlflow.db'}")


@pytest.mark.slow  # suite time: runs with -m slow
def test_audit_results_in_run_record_and_child_runs(audited):
    client = _client(audited["state"])
    run = client.get_run(audited["summary"]["mlflow_run_id"])
    m = run.data.metrics
    # the audit's loss attack on its pool is `loss_pool`: the in-flow `mia.loss` is another attack
    for attack in ("loss_pool", "lira", "lira_offline", "min_k"):
        assert 0 <= m[f"mia.{attack}.auc"] <= 1
        assert f"mia.{attack}.tpr_at_5pct_fpr" in m and f"mia.{attack}.auc_low" in m
    assert "audit.epsilon_lower_bound" in m
    assert m["audit.epsilon_lower_bound"] <= m["privacy.epsilon"]
    exp = run.info.experiment_id
    (audit_run,) = client.search_runs([exp], f"tags.mlflow.parentRunId = '{run.info.run_id}' and tags.stage = 'audit'")
    assert audit_run.info.status == "FINISHED"
    assert audit_run.data.metrics["mia.lira.auc"] == m["mia.lira.auc"]
    shadows = client.search_runs([exp], f"tags.mlflow.parentRunId = '{audit_run.info.run_id}'")
    assert sorted(s.data.tags["shadow"] for s in shadows) == ["0", "1"]
    assert all(s.info.status == "FINISHED" for s in shadows)
    details = json.loads(Path(client.download_artifacts(audit_run.info.run_id, "audit/audit.json")).read_text())
    assert details["canary_audit"]["num_canaries"] == 30
    plots = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert "plots/roc_attacks.png" in plots


@pytest.mark.slow  # suite time: runs with -m slow
def test_audit_recorded_as_nonprivate_use_and_pool_stays_private(audited):
    from privacy.ledger import Ledger

    entries = Ledger(audited["state"] / "ledger.sqlite").entries()
    assert any(e["kind"] == "nonprivate" and "membership audit" in e["description"] for e in entries)
    pools = list((audited["state"] / "private" / "audits").glob("*/pool.parquet"))
    assert pools and not list((audited["state"] / "mlartifacts").rglob("*.parquet"))


@pytest.mark.slow  # ≈ 36 s; the audit itself is checked by the default tests above
def test_cli_style_audit_of_finished_run(audited):
    from flows.audit import run_audit, target_from_run

    target, acfg = target_from_run(audited["summary"]["mlflow_run_id"], str(audited["state"]), shadows=2)
    out = run_audit(target, acfg)
    assert out["metrics"]["audit.epsilon_lower_bound"] <= target.epsilon


@pytest.mark.slow  # suite time: runs with -m slow
def test_audit_bad_input_fails_before_training(audited, tmp_path):
    from flows.audit import target_from_run
    from tasks.audit import AuditError

    state = str(audited["state"])
    with pytest.raises(AuditError, match="no MLflow run 'nope'"):
        target_from_run("nope", state)
    client = _client(audited["state"])
    run_id = audited["summary"]["mlflow_run_id"]
    child = client.search_runs([client.get_run(run_id).info.experiment_id],
                               f"tags.mlflow.parentRunId = '{run_id}' and tags.stage = 'train'")[0]
    with pytest.raises(AuditError, match="not a prompt-tuning run"):
        target_from_run(child.info.run_id, state)
    n_before = len(client.search_runs([client.get_run(run_id).info.experiment_id]))
    from flows.method_flow import method_flow

    cfg = _audit_config(audited["data"], audited["state"], fprs=[0.001])
    with pytest.raises(AuditError, match="audit pool too small: .* needs at least 1000"):
        method_flow(cfg)
    runs = client.search_runs([client.get_run(run_id).info.experiment_id])
    assert len(runs) == n_before + 1  # only the refused run's parent run, FAILED: no training, no shadows
    (refused,) = [r for r in runs if r.info.start_time == max(x.info.start_time for x in runs)]
    assert refused.info.status == "FAILED" and "mlflow.parentRunId" not in refused.data.tags


@pytest.mark.slow  # suite time: runs with -m slow
def test_audit_fails_loudly_when_leakage_exceeds_the_claim(audited, tmp_path, monkeypatch):
    """A model that memorised its planted canaries, audited against a (false) claim of ε = 0.01:
    the one-run lower bound exceeds the claim and the audit raises."""
    import pyarrow.parquet as pq

    from models.soft_prompt import save_prompt
    from tasks.methodkit import classifiers
    from tasks.audit import AuditFailure, AuditTarget, canary_audit
    from tasks.config import AuditConfig, parse_config

    cfg = parse_config(_audit_config(audited["data"], audited["state"]))
    part = json.loads(next((audited["state"] / "private" / "partitions").glob("*/manifest.json")).read_text())
    planted = [r for r in pq.read_table(Path(part["directory"]) / "canaries.parquet").to_pylist() if r["planted"]]
    labels = torch.tensor([cfg.data.labels.index(r["label"]) for r in planted])
    memorised = _fine_tuned([r["text"] for r in planted], labels, 0, label_names=cfg.data.labels)
    monkeypatch.setattr(classifiers, "classifier_for", lambda cfg, name, template=None: memorised)
    path = tmp_path / "prompt.safetensors"
    save_prompt(path, torch.zeros(1, memorised.embed_dim), {})
    target = AuditTarget(config=cfg.model_dump(mode="json"), partition=part, prompt_path=str(path),
                         method="prompt_dpsgd", epsilon=0.01, delta=1e-5, run_id="claimed-run",
                         flow_run_id="x", state_dir=str(audited["state"]))
    with pytest.raises(AuditFailure, match=r"exceeds the claimed ε = 0\.010 .* DP implementation is broken"):
        canary_audit(target, AuditConfig(enabled=True, fprs=[0.05]))


@pytest.mark.slow  # suite time: runs with -m slow
def test_an_attack_registered_by_a_test_is_run_by_the_audit(audited, tmp_path):
    """A toy attack (the true-label logit as a threshold attack) registered here, in tests/, is
    chosen by name in ``audit.attacks`` and scored on the audited run's pool by the audit's own
    ``attack_metrics``, beside a built-in one; no shadows are read (none of them needs any)."""
    from flows.audit import target_from_run
    from tasks.attacks import Attack, register_attack, unregister_attack
    from tasks.audit import attack_metrics
    from tasks.config import AuditConfig

    @register_attack
    class ToyLogit(Attack):
        name = "toy_logit"

        def statistics(self, scoring):
            from models.scoring import true_label_logit_scores

            return {"toy_logit": true_label_logit_scores(scoring.classifier, scoring.encoded, scoring.labels,
                                                         scoring.prompt, scoring.batch_size).numpy()}

        def scores(self, target, shadows):
            assert shadows is None
            return {"toy_logit": target["toy_logit"]}

    try:
        target, _ = target_from_run(audited["summary"]["mlflow_run_id"], str(audited["state"]), shadows=2)
        acfg = AuditConfig(enabled=True, shadows=2, fprs=[0.05], attacks=["toy_logit", "loss"])
        # the flow's pool (a slow test's audit of the finished run draws the same one: same seed)
        pool_path = sorted((audited["state"] / "private" / "audits").glob("*/pool.parquet"))[0]
        pool = {"pool_path": str(pool_path), "mask_path": str(pool_path.parent / "shadow_in.npy")}
        metrics, details = attack_metrics(target, acfg, pool, [], tmp_path, seed=0)
    finally:
        unregister_attack("toy_logit")
    assert sorted(details["report"]) == ["loss_pool", "toy_logit"]
    assert 0 <= metrics["mia.toy_logit.auc"] <= 1 and "mia.toy_logit.tpr_at_5pct_fpr" in metrics
    assert "mia.lira.auc" not in metrics and Path(details["roc_path"]).is_file()
    client = _client(audited["state"])
    # the same pool and prompt: the built-in loss attack scores as it did inside the flow
    assert metrics["mia.loss_pool.auc"] == pytest.approx(
        client.get_run(audited["summary"]["mlflow_run_id"]).data.metrics["mia.loss_pool.auc"])


@pytest.mark.slow  # suite time: runs with -m slow
def test_the_standalone_audit_of_a_split_with_no_row_does_not_run_and_says_so(audited, monkeypatch):
    """Review 8b, R4: ``privprompt audit`` / the audit-finished-run deployment failed at the pool draw
    on an exactly empty split (the flow's own audit already skipped): it now ends with no attack, its
    audit run tagged ``audit.not_run``."""
    import flows.audit as fa
    from flows.audit import run_audit, target_from_run

    target, acfg = target_from_run(audited["summary"]["mlflow_run_id"], str(audited["state"]), shadows=2)
    monkeypatch.setattr(fa, "has_empty_side", lambda part: True)  # as for a partition whose holdout has no row
    out = run_audit(target, acfg)
    assert out["metrics"] == {} and out["canary"] is None
    tags = _client(audited["state"]).get_run(out["audit_run_id"]).data.tags
    assert tags["audit.not_run"] == "a split holds no row"
