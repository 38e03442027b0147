"""The prompt-tuning flow end to end on a tiny model: the run record, the ledger, caching and
refusals (the CLI end to end, bad input and planted canaries: test_flow_cli.py)."""

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CANARIES = ["zqxv canary wombat ultramarine 7731", "plover canary heliotrope quokka 2209"]


def _toy_dataset(folder: Path, sst2_dir: Path, n_train=240, n_test=80, canaries=()):
    """A small SST-2 sample (read from ../shared/data at test time) with canary sentences planted."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(l) for l in (sst2_dir / "train.jsonl").open().readlines()[:n_train]]
    rows += [{"text": f"{c} , a film", "label": "positive"} for c in canaries]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    test = [json.loads(l) for l in (sst2_dir / "test.jsonl").open().readlines()[:n_test]]
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in test))
    return folder


def _config(data_dir: Path, state_dir: Path, **extra) -> dict:
    cfg = {
        "method": "prompt_dpsgd", "experiment": "tests", "seed": 0, "state_dir": str(state_dir),
        "allow_nonprivate_baselines": True,
        "data": {"name": "toy-sst2", "path": str(data_dir), "labels": ["negative", "positive"],
                 "holdout_fraction": 0.2},
        "models": {"local": "tiny-bert", "max_length": 32, "eval_batch_size": 64},
        "privacy": {"target_epsilon": 4.0, "dataset_epsilon_cap": 50.0},
        "methods": {"zero_shot": {"enabled": True},
                    "prompt_sgd": {"enabled": True, "n_tokens": 3, "epochs": 1, "batch_size": 32},
                    "prompt_dpsgd": {"n_tokens": 3, "epochs": 1, "batch_size": 32}},
        "mia": {"max_examples": 40},
        # the comparison with no prompt runs (its ε is in every plan), but a noisy loss on the toy holdout
        # must not withhold the prompt these tests inspect: tests/claims/test_no_prompt_fallback.py pins
        # the fallback itself, and the toy plugin's flow (tests/methods/test_toy_method.py) runs the default
        "fallback": {"enabled": False},
    }
    for k, v in extra.items():
        node = cfg
        *head, last = k.split(".")
        for h in head:
            node = node[h]
        node[last] = v
    return cfg


def _mlflow(state_dir: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{state_dir / 'mlflow.db'}")


def assert_baselines_labelled(metrics: dict, reads_private: dict[str, bool]) -> None:
    """On a dp parent, nothing computed on private data without DP is shown under a bare name:
    no ``leakage.*`` or ``baseline.*`` metric, and no ``test.accuracy.<m>`` of a baseline ``m``
    that read private training data (only ``audit.baseline.<m>.*``, RUN_RECORD.md)."""
    assert not [k for k in metrics if k.startswith(("leakage.", "baseline."))]
    for method, private in reads_private.items():
        assert (f"test.accuracy.{method}" in metrics) == (not private), method
        assert (f"audit.baseline.{method}.test.accuracy" in metrics) == private, method


# ---- in-process flows under one Prefect test harness -------------------------------------------

@pytest.fixture(scope="module")
def flow_run(prefect_harness, sst2_dir, tmp_path_factory):
    from flows.method_flow import method_flow

    root = tmp_path_factory.mktemp("flow")
    data = _toy_dataset(root / "data", sst2_dir)
    state = root / "state"
    summary = method_flow(_config(data, state))
    return {"summary": summary, "state": state, "data": data, "root": root}


def test_run_record_is_complete(flow_run):
    """Every name of ../shared/RUN_RECORD.md is in the parent run."""
    client = _mlflow(flow_run["state"])
    run = client.get_run(flow_run["summary"]["mlflow_run_id"])
    tags, params, metrics = run.data.tags, run.data.params, run.data.metrics
    for tag in ("method", "dataset", "dataset.fingerprint", "model.local", "model.target",
                "privacy.guarantee", "prefect.flow_run_id"):
        assert tags.get(tag), tag
    assert tags["method"] == "prompt_dpsgd" and tags["privacy.guarantee"] == "dp"
    assert tags["prefect.flow_run_id"] == flow_run["summary"]["flow_run_id"]
    for p in ("privacy.target_epsilon", "privacy.target_delta", "privacy.unit", "seed", "dpsgd.sample_rate",
              "dpsgd.noise_multiplier", "dpsgd.steps", "dpsgd.max_grad_norm"):
        assert p in params, p
    assert params["privacy.unit"] == "record"
    for m in ("privacy.epsilon", "privacy.delta", "privacy.epsilon_rdp", "test.accuracy", "test.accuracy.tiny-bert",
              "mia.loss.auc", "test.accuracy.zero_shot", "audit.baseline.prompt_sgd.test.accuracy",
              "audit.baseline.prompt_sgd.mia.loss.auc"):
        assert m in metrics, m
    assert_baselines_labelled(metrics, {"zero_shot": False, "prompt_sgd": True})
    # a TPR at FPR ≤ x needs ≥ 1/x non-members: reported exactly when there are enough
    n_out = metrics["mia.loss.n_nonmembers"]
    for key, fpr in (("mia.loss.tpr_at_1pct_fpr", 0.01), ("mia.loss.tpr_at_0.1pct_fpr", 0.001)):
        assert (key in metrics) == (n_out * fpr >= 1), (key, n_out)
    assert 0 < metrics["privacy.epsilon"] <= 4.0 + 1e-6
    assert metrics["privacy.epsilon"] <= metrics["privacy.epsilon_rdp"]
    assert run.info.status == "FINISHED"
    arts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "prompt", "plots", "privacy"} <= arts
    assert {a.path for a in client.list_artifacts(run.info.run_id, "prompt")} == {"prompt/prompt_dpsgd.safetensors"}
    plots = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert {"plots/privacy_utility.png", "plots/prompt_dpsgd_roc_loss.png"} <= plots
    # the batch-loss curve is an exact statistic of private data: local (private/) only, never published
    assert not [p for p in plots if "training_curve" in p]
    assert "train.loss_last10" not in metrics
    budget = json.loads(Path(client.download_artifacts(run.info.run_id, "privacy/budget.json")).read_text())
    assert budget["total"]["epsilon"] == pytest.approx(metrics["privacy.epsilon"])
    # the run's mechanism: the partition's released sizes (one Gaussian count), DP-SGD and the comparison
    # with no prompt on the holdout (one Gaussian difference: tasks/no_prompt.py)
    from tasks.data import Partition

    event = budget["stages"][0]["event"]
    assert event["type"] == "adaptive" and event["first"]["type"] == "gaussian"  # the sizes, then what chose from them
    assert event["then"]["type"] == "composed" and [e["type"] for e in event["then"]["events"]] == [
        "self_composed", "gaussian"]
    assert float(params["no_prompt.noise_sigma"]) == event["then"]["events"][1]["noise_multiplier"]
    assert "no_prompt.released_difference" in metrics and metrics["no_prompt.fallback"] == 0.0  # fallback off here
    sizes = Partition(**json.loads(next((flow_run["state"] / "private" / "partitions").glob("*/manifest.json"))
                                   .read_text())).sizes
    assert event["first"]["noise_multiplier"] == sizes.sigma == 50.0
    # the published sizes are the released ones, and the parent's ε covers them with the method
    assert [int(params[f"data.{k}"]) for k in ("n_train", "n_holdout", "n_test")] == [
        sizes.n_train, sizes.n_holdout, sizes.n_test]
    assert float(params["privacy.method_epsilon"]) < 4.0


def test_the_run_keeps_its_seconds_per_example_for_the_next_plan(flow_run):
    """The run's training and evaluation seconds per example, by method, in the state folder's
    probe cache (what the next plan's time estimate reads)."""
    from tasks import estimate as est

    cache = json.loads(est.state_cache(flow_run["state"]).read_text())
    seen = {json.loads(k)[1]: v for k, v in cache.items() if json.loads(k)[0] == "observed"}
    assert set(seen) == {"prompt_dpsgd", "prompt_sgd", "zero_shot"}
    assert seen["prompt_dpsgd"]["train_s"] > 0 and seen["prompt_dpsgd"]["eval_s"] > 0
    assert seen["zero_shot"]["train_s"] is None and seen["zero_shot"]["eval_s"] > 0


def test_run_says_where_its_prompt_is_and_on_which_device(flow_run, capsys):
    """Issue 29, reading a run: the summary and budget.json name the published prompt's file and
    MLflow artifact in fields that say what they are, the two hashes apart, and the device."""
    import mlflow.artifacts

    import privprompt_commands.run
    from flows.parent_run import device_description

    summary, state = flow_run["summary"], flow_run["state"]
    client = _mlflow(state)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.data.tags["device"] == device_description() == summary["device"]
    assert run.data.tags["device"] == "cpu" or run.data.tags["device"].startswith("cuda:")
    budget = json.loads(Path(client.download_artifacts(run.info.run_id, "privacy/budget.json")).read_text())
    pub = budget["published"]
    assert set(pub) == {"method", "prompt_path", "prompt_published", "guarantee", "formal_dp_guarantee",
                        "artifact_uri"}
    assert pub["prompt_published"] is True and pub["formal_dp_guarantee"] is True and pub["guarantee"] == "dp"
    assert pub["artifact_uri"] == f"runs:/{run.info.run_id}/prompt/prompt_dpsgd.safetensors"
    assert summary["published"] == pub
    fetched = mlflow.artifacts.download_artifacts(artifact_uri=pub["artifact_uri"],
                                                  tracking_uri=f"sqlite:///{state / 'mlflow.db'}")
    assert Path(fetched).read_bytes() == Path(pub["prompt_path"]).read_bytes()
    assert Path(pub["prompt_path"]).is_relative_to(state / "outputs")
    # the ledger's key (source dataset) and the partition's hash: two names, two values
    assert budget["dataset.fingerprint"] == run.data.tags["dataset.fingerprint"]
    assert budget["data.partition"] == run.data.tags["data.partition"] != budget["dataset.fingerprint"]
    privprompt_commands.run._print_summary(summary, 100.0)
    out = capsys.readouterr().out
    assert f"published prompt:           {pub['prompt_path']}\n" in out
    assert f"MLflow artifact {pub['artifact_uri']}" in out
    mia_line = next(line for line in out.splitlines() if line.startswith("mia.loss.auc:"))
    assert mia_line.endswith("(audit statistic, not DP)")
    assert f"device:                     {summary['device']}" in out


def test_mlflow_description_and_prefect_artifact_state_unit_and_delta(flow_run):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterId

    summary = flow_run["summary"]
    run = _mlflow(flow_run["state"]).get_run(summary["mlflow_run_id"])
    note = run.data.tags["mlflow.note.content"]
    eps = run.data.metrics["privacy.epsilon"]
    assert f"ε = {eps:.4f} per record, δ = {run.data.metrics['privacy.delta']:.3g} (accountant " in note
    assert summary["unit"] == "record" and summary["accountant"] in note
    assert summary["registered_model"].startswith("models:/") and summary["registered_model"] in note
    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["privprompt-run"])),
                                     flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[summary["flow_run_id"]])))
    assert len(arts) == 1 and arts[0].type == "markdown" and arts[0].data == note
    # both run lists name the run by what it is: method, dataset and target ε
    with get_client(sync_client=True) as client:
        prefect_name = client.read_flow_run(summary["flow_run_id"]).name
    target = float(run.data.params["privacy.target_epsilon"])
    assert prefect_name == run.data.tags["mlflow.runName"] == f"prompt_dpsgd · {run.data.tags['dataset']} · ε {target:g}"
    # the run's test numbers per class beside its accuracy
    assert 0 <= run.data.metrics["test.balanced_accuracy"] <= 1 and "test.recall.positive" in run.data.metrics


def test_child_runs_and_baselines(flow_run):
    client = _mlflow(flow_run["state"])
    parent = client.get_run(flow_run["summary"]["mlflow_run_id"])
    children = client.search_runs([parent.info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    by_name = {c.data.tags["mlflow.runName"]: c for c in children}
    assert {"prompt_sgd", "prompt_dpsgd", "evaluate:zero_shot", "evaluate:prompt_sgd",
            "evaluate:prompt_dpsgd", "mia:prompt_dpsgd"} <= set(by_name)
    assert all(c.info.status == "FINISHED" for c in children)
    baseline = by_name["prompt_sgd"]
    assert baseline.data.tags["privacy.guarantee"] == "none"
    assert client.list_artifacts(baseline.info.run_id) == []  # metrics only: the prompt stays private
    assert "privacy.epsilon" not in baseline.data.metrics


def test_ledger_records_dp_spend_and_nonprivate_use(flow_run):
    from privacy.ledger import Ledger

    ledger = Ledger(flow_run["state"] / "ledger.sqlite")
    (ds,) = ledger.datasets()
    # non-private uses: the prompt_sgd baseline, and the two in-flow loss attacks (audit statistics)
    assert ds["committed_runs"] == 1 and ds["reserved_runs"] == 0 and ds["nonprivate_uses"] == 3
    uses = [e["description"] for e in ledger.entries() if e["kind"] == "nonprivate"]
    assert sum("membership inference" in u for u in uses) == 2
    metrics = flow_run["summary"]["metrics"]
    assert ds["spent_epsilon"] == pytest.approx(metrics["privacy.epsilon"], rel=1e-3)


@pytest.mark.slow  # a second whole flow; the ledger's composition is checked in tests/ledger/
def test_rerun_reuses_partition_and_composes_budget(flow_run):
    from flows.method_flow import method_flow
    from privacy.ledger import Ledger

    part_dir = Path(flow_run["summary"]["budget"]["dataset.fingerprint"] and
                    next((flow_run["state"] / "private" / "partitions").iterdir()))
    stamp = (part_dir / "manifest.json").stat().st_mtime_ns
    cfg = _config(flow_run["data"], flow_run["state"])
    cfg["methods"]["zero_shot"]["enabled"] = False
    cfg["methods"]["prompt_sgd"]["enabled"] = False
    cfg["mia"]["enabled"] = False
    second = method_flow(cfg)
    assert (part_dir / "manifest.json").stat().st_mtime_ns == stamp
    assert len(list((flow_run["state"] / "private" / "partitions").iterdir())) == 1
    ds = Ledger(flow_run["state"] / "ledger.sqlite").datasets()[0]
    eps = second["metrics"]["privacy.epsilon"]
    assert ds["committed_runs"] == 2
    assert eps < ds["spent_epsilon"] < 2 * eps  # composed through the accountant, not added


@pytest.mark.slow  # two more trainings; the door's retries are checked in tests/claims/test_release_once.py
def test_retried_training_never_charges_twice(flow_run):
    from privacy.ledger import Ledger
    from tasks import stages
    from tasks.config import parse_config
    from tasks.lifecycle import run_method

    summary = flow_run["summary"]
    cfg = _config(flow_run["data"], flow_run["state"])
    state = flow_run["state"]
    part_dir = next((state / "private" / "partitions").iterdir())
    ctx = stages.StageContext(cfg=parse_config(cfg), state_dir=str(state),
                              partition=json.loads((part_dir / "manifest.json").read_text()),
                              parent_run_id=summary["mlflow_run_id"], flow_run_id="retry-test")
    ledger = Ledger(state / "ledger.sqlite")
    before = ledger.spent(ctx.part.dataset_key).epsilon
    first = run_method(ctx, "prompt_dpsgd", {})
    after_first = ledger.spent(ctx.part.dataset_key).epsilon
    again = run_method(ctx, "prompt_dpsgd", {})  # what a Prefect retry does
    assert first.reserved_new and not again.reserved_new
    assert ledger.spent(ctx.part.dataset_key).epsilon == pytest.approx(after_first)
    assert after_first > before


def test_run_refused_by_ledger(flow_run, tmp_path):
    from flows.method_flow import method_flow
    from privacy.ledger import BudgetExceededError, Ledger

    state = tmp_path / "state"
    cfg = _config(flow_run["data"], state, **{"privacy.dataset_epsilon_cap": 1.0})
    cfg["methods"]["prompt_sgd"]["enabled"] = False
    with pytest.raises(BudgetExceededError, match=r"remaining ε=1(\.0+)?\b") as info:
        method_flow(cfg)
    assert "refused before any baseline, evaluation or training" in str(info.value)
    for ds in Ledger(state / "ledger.sqlite").datasets():  # refused before the dataset's registration: none
        assert ds["spent_epsilon"] == 0 and ds["reserved_runs"] == 0 and ds["committed_runs"] == 0
    client = _mlflow(state)
    runs = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert runs and all(r.info.status in ("FAILED", "FINISHED") for r in runs)
    parent = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert [r.info.status for r in parent] == ["FAILED"]
    assert len(runs) == 1  # refused before the zero-shot baseline's evaluation: no child run at all


def test_nonprivate_method_publishes_metrics_only(flow_run, tmp_path):
    from flows.method_flow import method_flow

    state = tmp_path / "state"
    cfg = _config(flow_run["data"], state, method="prompt_sgd")
    cfg["methods"]["zero_shot"]["enabled"] = False
    cfg["mia"]["enabled"] = False
    summary = method_flow(cfg)
    run = _mlflow(state).get_run(summary["mlflow_run_id"])
    assert run.data.tags["privacy.guarantee"] == "none" and run.data.tags["method"] == "prompt_sgd"
    assert "privacy.epsilon" not in run.data.metrics and "test.accuracy" in run.data.metrics
    arts = {a.path for a in _mlflow(state).list_artifacts(run.info.run_id)}
    assert "prompt" not in arts
    assert Path(summary["published"]["prompt_path"]).is_relative_to(state / "private")
    budget = json.loads(Path(_mlflow(state).download_artifacts(run.info.run_id, "privacy/budget.json")).read_text())
    assert budget["total"] is None and "no formal privacy guarantee" in budget["note"]
    assert budget["published"]["prompt_published"] is False and budget["published"]["artifact_uri"] is None
    assert budget["published"]["formal_dp_guarantee"] is False and budget["published"]["guarantee"] == "none"


def test_cli_summary_separates_model_work_audit_and_orchestration(capsys):
    import privprompt_commands.run

    summary = {"flow_run_id": "f", "mlflow_run_id": "m", "experiment": "e", "method": "post",
               "metrics": {"privacy.epsilon": 7.9975, "privacy.delta": 1e-5, "privacy.epsilon_rdp": 9.7,
                           "test.accuracy": 0.74},
               "compute_seconds": {"tune": 60.0, "transfer": 90.0, "audit": 1300.0}}
    privprompt_commands.run._print_summary(summary, 1600.0)
    out = capsys.readouterr().out
    assert "1600.0 s (150.0 s model work, 1300.0 s audit, 150.0 s orchestration" in out
    summary["compute_seconds"].pop("audit")
    privprompt_commands.run._print_summary(summary, 200.0)
    out = capsys.readouterr().out
    assert "200.0 s (150.0 s model work, 50.0 s orchestration" in out and "comparison" not in out
    summary["metrics"]["no_prompt.released_difference"] = 3.2  # its time is outside the published model work
    privprompt_commands.run._print_summary(summary, 200.0)
    assert "50.0 s orchestration, tracking and start-up, with the comparison with no prompt)" in capsys.readouterr().out


def test_sweep_table_shows_private_baselines_only_labelled():
    """The sweep's table keeps baselines' accuracies, a private-data one under its audit label."""
    from flows.sweep import columns_of, short_name

    rows = [{"test.accuracy.zero_shot": 0.5, "audit.baseline.prompt_sgd.test.accuracy": 0.6,
             "audit.leakage.exact_copies": 0.0}]
    extra = columns_of(rows)[-2:]
    assert extra == ["audit.baseline.prompt_sgd.test.accuracy", "test.accuracy.zero_shot"]
    assert [short_name(c) for c in extra] == ["audit:prompt_s", "zero_shot"]


def test_baseline_names_follow_the_methods_properties():
    """Labelled iff private training data went in without DP: by guarantee and data read, not by name."""
    from tasks.pipeline import audit_label, baseline_name, labelled

    assert baseline_name("zero_shot", "test.accuracy", labelled("none", False)) == "test.accuracy.zero_shot"
    assert baseline_name("opt", "test.accuracy", labelled("none", True)) == "audit.baseline.opt.test.accuracy"
    assert baseline_name("full_pt", "test.accuracy", labelled("ldp", True)) == "audit.baseline.full_pt.test.accuracy"
    assert baseline_name("compressed_pt", "test.accuracy", labelled("dp", True)) == "test.accuracy.compressed_pt"
    assert baseline_name("icl", "mia.loss.auc", False) == "audit.baseline.icl.mia.loss.auc"
    assert audit_label({"leakage.prompts": 2.0, "audit.leakage.exact_copies": 0.0, "mia.x.auc": 0.5}) == {
        "audit.leakage.prompts": 2.0, "audit.leakage.exact_copies": 0.0, "mia.x.auc": 0.5}


def test_stage_context_holds_the_parsed_frozen_config_and_pickles_whole(tmp_path):
    """The context carries the config the flow parsed (the same object, frozen: no stage writes
    it); it pickles whole (a Dask worker gets the parsed config, no parse) and hashes stably for
    Prefect's input hash; a RunOutcome pickles whole."""
    import pickle

    import pydantic
    from prefect.utilities.hashing import hash_objects

    from tasks.config import parse_config
    from tasks.outcome import RunOutcome
    from tasks.stages import StageContext
    from tasks.state import state_paths

    cfg = parse_config(_config(tmp_path / "data", tmp_path / "state"))
    ctx = StageContext.for_run(cfg, state_paths(tmp_path / "state"), {"n_train": 10}, "parent", "flow")
    before = hash_objects(ctx)
    assert before is not None and ctx.cfg is cfg and hash_objects(ctx) == before
    assert ctx.config == cfg.model_dump(mode="json")
    copy = pickle.loads(pickle.dumps(ctx))
    assert copy == ctx and copy.cfg == cfg and copy.cfg is not cfg and hash_objects(copy) == before
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        cfg.privacy.target_epsilon = 1.5
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        cfg.methods.prompt_dpsgd = cfg.methods.prompt_sgd
    changed = cfg.model_copy(update={"seed": 3})  # a changed value is a new config; the old one stays
    assert changed.seed == 3 and cfg.seed == 0 and ctx.cfg.seed == 0
    out = RunOutcome("prompt_dpsgd", "dp", True, spend={"epsilon": 1.0, "delta": 1e-5}, compute={"train": 0.5})
    assert pickle.loads(pickle.dumps(out)) == out and out.epsilon == 1.0