"""POST end to end on a tiny teacher: the run record, the cached student, and that the
public-data stages never read private partitions."""

import json
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[4] / "shared" / "data"


def _config(state, sst2_dir, **extra):
    cfg = {
        "method": "post", "experiment": "post-tests", "seed": 0, "state_dir": str(state),
        "data": {"name": "sst2", "path": str(sst2_dir), "labels": ["negative", "positive"],
                 "train_fraction": 0.00178, "holdout_fraction": 0.000356, "test_fraction": 0.033,
                 "size_noise_sigma": 2.0},  # the audit's pool is sized from the released ~24-row holdout
        "models": {"local": "tiny-gpt2", "target": "tiny-gpt2", "max_length": 32},
        "privacy": {"target_epsilon": 8.0, "dataset_epsilon_cap": 100.0},
        "public": {"name": "tweet_sentiment", "path": str(SHARED / "tweet_sentiment"),
                   "split": "validation", "size": 200},
        "methods": {"zero_shot": {"enabled": False},
                    "post": {"tuning": {"n_tokens": 3, "epochs": 1, "batch_size": 32},
                             "distill": {"student_layers": 1, "steps": 15, "batch_size": 16},
                             "transfer": {"steps": 10, "batch_size": 16}}},
        "fallback": {"enabled": False},  # a prompt to audit, whatever the noisy comparison says
        "mia": {"max_examples": 24},
    }
    cfg.update(extra)
    return cfg


@pytest.fixture(scope="module")
def post_run(prefect_harness, sst2_dir, tmp_path_factory):
    if not (SHARED / "tweet_sentiment" / "validation.jsonl").is_file():
        pytest.skip("../shared/data/tweet_sentiment is not available")
    from flows.method_flow import method_flow

    state = tmp_path_factory.mktemp("post") / "state"
    first = method_flow(_config(state, sst2_dir))
    second = method_flow(_config(state, sst2_dir))
    return {"first": first, "second": second, "state": state, "sst2": sst2_dir}


@pytest.mark.slow  # suite time: runs with -m slow
def test_post_run_record(post_run):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{post_run['state'] / 'mlflow.db'}")
    run = client.get_run(post_run["first"]["mlflow_run_id"])
    m, tags = run.data.metrics, run.data.tags
    for key in ("test.accuracy", "test.accuracy.full_zs", "test.accuracy.compressed_pt",
                "test.accuracy.direct_transfer", "privacy.epsilon", "privacy.delta", "privacy.epsilon_rdp",
                "mia.loss.auc"):
        assert key in m, key
    assert tags["method"] == "post" and tags["privacy.guarantee"] == "dp"
    assert tags["model.target"] == "tiny-gpt2" and "students" in tags["model.local"]
    assert 0 < m["privacy.epsilon"] <= 8.0 + 1e-6
    arts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "prompt", "tables", "plots", "privacy"} <= arts
    assert {a.path for a in client.list_artifacts(run.info.run_id, "tables")} == {"tables/accuracy.md", "tables/runtime.md"}
    table = Path(client.download_artifacts(run.info.run_id, "tables/accuracy.md")).read_text()
    assert "POST" in table and "Direct Transfer" in table and "Compressed PT" in table


@pytest.mark.slow  # suite time: runs with -m slow
def test_student_is_registered_and_reused(post_run):
    from mlflow.tracking import MlflowClient

    first, second = post_run["first"], post_run["second"]
    assert first["runtime"]["distill"] != "cached" and second["runtime"]["distill"] == "cached"
    client = MlflowClient(tracking_uri=f"sqlite:///{post_run['state'] / 'mlflow.db'}")
    versions = client.search_model_versions("name = 'privprompt-student-tiny-gpt2'")
    assert len(versions) == 1
    r1 = client.get_run(first["mlflow_run_id"]).data.tags["model.local"]
    r2 = client.get_run(second["mlflow_run_id"]).data.tags["model.local"]
    assert r1 == r2


@pytest.mark.slow  # suite time: runs with -m slow
def test_public_stages_refuse_private_paths(post_run, tmp_path):
    from tasks.data import DataError, read_public_texts

    private = post_run["state"] / "private"
    part = next((private / "partitions").iterdir())
    with pytest.raises(DataError, match="private working data"):
        read_public_texts("x", str(part), "train", "text", None, private)
    # a public folder outside private/ is fine
    texts = read_public_texts("tweet_sentiment", None, "validation", "text", str(SHARED), private, size=5)
    assert len(texts) == 5


def _public_transfer(post_run, monkeypatch, flow_run_id: str, **transfer):
    """Run the transfer stage on the first run's DP prompt with ``transfer`` settings while
    <state>/private is moved away (any read there fails) and every Python-level open is
    recorded. Returns (ctx, out, texts, student, source)."""
    import builtins
    import io

    from tasks.recording import log_post_child
    from tasks.methods import MethodContext
    from tasks.config import parse_config
    from tasks.data import public_texts
    from tasks.methods.post import method as post_mod
    from tasks.prompts import load_prompt_file, save_prompt_file
    from tasks.randomness import DpRandomness
    from tasks.stages import StageContext

    state = post_run["state"]
    config = _config(state, post_run["sst2"])
    config["methods"]["post"]["transfer"].update(transfer)
    part = json.loads(next((state / "private" / "partitions").glob("*/manifest.json")).read_text())
    ctx = StageContext(cfg=parse_config(config), state_dir=str(state), partition=part,
                       parent_run_id=post_run["first"]["mlflow_run_id"], flow_run_id=flow_run_id)
    student_dir = str(next((state / "models" / "students").iterdir()))
    source = str(next((state / "outputs").rglob("post_source.safetensors")))

    def transfer_stage(texts):
        mctx = MethodContext(ctx.cfg, ctx.paths, {"student_dir": student_dir}, DpRandomness(), 0)
        moved, child = post_mod.transfer_stage(mctx, student_dir, load_prompt_file(source), texts)
        path = save_prompt_file(ctx.output_dir, "post", moved.prompt, {"method": "post"})
        log_post_child(ctx, child, "dp")
        return {"prompt_path": str(path), "selected_step": moved.best_step}

    opened, real_open = [], io.open

    def spy(file, *a, **k):
        opened.append(str(file))
        return real_open(file, *a, **k)

    private, hidden = state / "private", state / "private.hidden"
    private.rename(hidden)
    try:
        monkeypatch.setattr(io, "open", spy)
        monkeypatch.setattr(builtins, "open", spy)
        texts = public_texts(ctx.cfg, ctx.paths.private)
        out = transfer_stage(texts)
    finally:
        monkeypatch.undo()
        hidden.rename(private)
    assert any("tweet_sentiment" in f for f in opened)  # the spy sees the public reads
    assert not [f for f in opened if "private" in Path(f).resolve().parts]
    return ctx, out, texts, transfer_stage


@pytest.mark.slow  # suite time: runs with -m slow
def test_transfer_stage_is_given_public_data_only(post_run, monkeypatch):
    """The transfer task reads only the public dataset: every file it opens is outside private/."""
    _, out, _, _ = _public_transfer(post_run, monkeypatch, "transfer-check")
    assert Path(out["prompt_path"]).is_file() and out["selected_step"] is None


@pytest.mark.slow  # POST's shadows on a Dask cluster (≈ 45 s); the audit's own claims run by default (test_audit_flow)
def test_post_audit_shadows_rerun_dp_tuning_and_transfer(post_run):
    """`audit:` on a POST run: the shadows are DP tuning on the cached student + transfer to the
    teacher; results land in the run record; a finished POST run can be audited again."""
    from mlflow.tracking import MlflowClient

    from flows.audit import target_from_run
    from flows.method_flow import method_flow

    cfg = _config(post_run["state"], post_run["sst2"],
                  audit={"enabled": True, "shadows": 2, "attacks": ["loss", "lira"], "fprs": [0.1],
                         "dask": {"n_workers": 1, "threads_per_worker": 1}})
    cfg["data"]["canaries"] = 20
    out = method_flow(cfg)
    m = out["metrics"]
    assert out["runtime"]["distill"] == "cached"  # the shadows reuse the student as well
    seconds = out["compute_seconds"]
    assert seconds["audit"] > seconds["tune"] > 0 and "evaluate:post" in seconds
    for key in ("mia.lira.auc", "mia.lira_offline.auc", "mia.loss.auc", "audit.epsilon_lower_bound"):
        assert key in m, key
    assert 0 <= m["mia.lira.auc"] <= 1
    assert m["audit.epsilon_lower_bound"] <= m["privacy.epsilon"]
    client = MlflowClient(tracking_uri=f"sqlite:///{post_run['state'] / 'mlflow.db'}")
    run = client.get_run(out["mlflow_run_id"])
    assert run.data.metrics["mia.lira.auc"] == m["mia.lira.auc"]
    shadows = client.search_runs([run.info.experiment_id], f"tags.stage = 'audit-shadow' and tags.method = 'post'")
    assert len(shadows) == 2
    # each shadow ran DP tuning (1 epoch at batch 32) and the configured 10 transfer steps
    assert all(s.data.metrics["train.steps"] > 10 for s in shadows)

    target, acfg = target_from_run(out["mlflow_run_id"], str(post_run["state"]))
    assert target.method == "post" and target.prepared["student_dir"] == run.data.tags["model.local"]
    assert target.cfg.models.local == "tiny-gpt2" and acfg.shadows == 2
    assert target.epsilon == m["privacy.epsilon"]


@pytest.mark.slow  # suite time: runs with -m slow
def test_transfer_selection_uses_held_out_public_texts_only(post_run, monkeypatch):
    """`select_every`: the prompt is scored on held-out public texts every N steps and the best
    one kept; the selection, like the training, opens no file under private/."""
    from mlflow.tracking import MlflowClient

    from tasks.config import parse_config
    from tasks.errors import ConfigError

    state = post_run["state"]
    ctx, out, texts, transfer_stage = _public_transfer(post_run, monkeypatch, "select-check",
                                                            select_every=5, select_size=50)
    assert out["selected_step"] in (0, 5, 10)
    client = MlflowClient(tracking_uri=f"sqlite:///{state / 'mlflow.db'}")
    run = client.search_runs([client.get_run(post_run["first"]["mlflow_run_id"]).info.experiment_id],
                             "tags.stage = 'transfer'", order_by=["start_time DESC"])[0]
    history = client.get_metric_history(run.info.run_id, "transfer.public_select_loss")
    assert sorted(m.step for m in history) == [0, 5, 10]
    best = min(history, key=lambda m: (m.value, m.step))
    assert run.data.metrics["transfer.selected_step"] == best.step == out["selected_step"]
    # a public set smaller than the held-out part: refused before training, nothing written
    written = Path(out["prompt_path"]).stat().st_mtime_ns
    n_transfer_runs = len(client.search_runs([run.info.experiment_id], "tags.stage = 'transfer'"))
    with pytest.raises(ConfigError, match="select_size = 50 leaves no public texts to train on \\(40 in"):
        transfer_stage(texts[:40])
    assert Path(out["prompt_path"]).stat().st_mtime_ns == written
    assert len(client.search_runs([run.info.experiment_id], "tags.stage = 'transfer'")) == n_transfer_runs
    config = {**ctx.config, "methods": {**ctx.config["methods"], "post": {
        **ctx.config["methods"]["post"], "transfer": {**ctx.config["methods"]["post"]["transfer"], "select_size": 500}}}}
    with pytest.raises(ConfigError, match="select_size = 500 holds out all 200 public texts"):
        parse_config(config)


@pytest.mark.slow  # the post_run fixture (two POST flow runs)
def test_a_released_post_prompt_is_retargeted_to_another_backbone_on_public_data_only(post_run, monkeypatch,
                                                                                         capsys):
    """``privprompt retarget`` of POST's registered version: POST's transfer from its target to
    tiny-llama on the run's public texts, with the state's private/ moved away and every open
    recorded; the ledger unchanged; the new version keeps ε and names its parent."""
    import builtins
    import io

    from mlflow.tracking import MlflowClient

    from privprompt_cli import main
    from tasks.state import state_paths

    state = post_run["state"]
    uri = f"sqlite:///{state / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    name = "privprompt.sst2.post"
    parent = client.get_model_version(name, "1")
    before = state_paths(state).open_ledger().export()
    opened, real_open = [], io.open

    def spy(file, *a, **k):
        opened.append(str(file))
        return real_open(file, *a, **k)

    private, hidden = state / "private", state / "private.hidden"
    private.rename(hidden)
    try:
        monkeypatch.setattr(io, "open", spy)
        monkeypatch.setattr(builtins, "open", spy)
        capsys.readouterr()
        rc = main(["--state-dir", str(state), "retarget", f"models:/{name}/1", "--target", "tiny-llama"])
    finally:
        monkeypatch.undo()
        hidden.rename(private)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert any("tweet_sentiment" in f for f in opened)
    assert not [f for f in opened if "private" in Path(f).resolve().parts or "/sst2/" in f]
    assert "note:" not in out  # POST's own public-data stages checked the public set against the source
    after = state_paths(state).open_ledger().export()
    assert after["entries"] == before["entries"] and after["datasets"] == before["datasets"]
    versions = sorted(client.search_model_versions(f"name = '{name}'"), key=lambda v: int(v.version))
    new = versions[-1]
    assert new.tags["privacy.epsilon"] == parent.tags["privacy.epsilon"]
    assert new.tags["lineage.parent"] == f"models:/{name}/1" and new.tags["model.target"] == "tiny-llama"
    metrics = client.get_run(new.run_id).data.metrics
    assert metrics["retarget.transfer.loss_last"] >= 0 and "retarget.public.accuracy" in metrics
