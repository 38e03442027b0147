"""Budget plans before anything runs: `privprompt plan` composes every run's planned event with
the ledger without writing a run; a sweep whose plan exceeds a cap is refused before any training
and leaves no MLflow run; grids expand; resumable sweeps skip finished variants; ε = inf is refused."""

import pytest

from tests.pipeline.test_flow import _config, _mlflow, _toy_dataset


@pytest.fixture(scope="module")
def toy(sst2_dir, tmp_path_factory):
    return _toy_dataset(tmp_path_factory.mktemp("plan") / "data", sst2_dir, n_train=160, n_test=40)


def _cfg(toy, state, **extra):
    cfg = _config(toy, state, **extra)
    cfg["methods"]["zero_shot"]["enabled"] = False
    cfg["methods"]["prompt_sgd"]["enabled"] = False
    cfg["mia"]["enabled"] = False
    return cfg


@pytest.mark.slow  # suite time: runs with -m slow
def test_plan_composes_variants_and_writes_no_run(toy, tmp_path):
    from tasks.config import parse_config, sweep_variants
    from tasks.planning import format_plan, plan_runs
    from tasks.state import state_paths

    cfg = parse_config(_cfg(toy, tmp_path / "state", grid={"privacy.target_epsilon": [1.0, 4.0]}))
    variants = sweep_variants(cfg)
    assert [label for label, _ in variants] == ["privacy.target_epsilon=1.0", "privacy.target_epsilon=4.0"]
    plan = plan_runs(variants, state_paths(str(tmp_path / "state")))
    (d,) = plan["datasets"].values()
    eps = [r["epsilon"] for r in plan["runs"]]
    # calibrated σ: the method gets the target minus the sizes release's ε (basic composition: about
    # 0.08-0.11 at this toy's δ), and the run's ε composes the two realised events, at most the target
    assert 1.0 - 0.15 <= eps[0] <= 1.0 and 4.0 - 0.15 <= eps[1] <= 4.0
    assert max(eps) < d["total_epsilon"] < sum(eps) + 1e-9 and d["spent_epsilon"] == 0 and d["fits"]
    text = format_plan(plan)
    assert "remaining after" in text
    assert "\ntarget_epsilon=1.0 " in text and "\ntarget_epsilon=4.0 " in text  # the variants told apart
    assert not (tmp_path / "state" / "mlflow.db").exists() and not (tmp_path / "state" / "ledger.sqlite").exists()


class _Logs:
    """What the sweep logs to Prefect (its run logger), as text."""

    def __init__(self):
        self.lines = []

    def __call__(self):
        return self

    def _log(self, msg, *args, **kwargs):
        self.lines.append(str(msg) % args if args else str(msg))

    info = warning = error = debug = _log

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@pytest.mark.slow  # suite time: runs with -m slow
def test_sweep_over_the_cap_is_refused_before_anything_runs(prefect_harness, toy, tmp_path, monkeypatch):
    """Refused before any run and any reservation, and with no plan number on Prefect (its log or
    the flow run's state message): they derive from the released sizes, and nothing is charged for
    their release (issue 35, defect 7)."""
    import re

    from flows import sweep
    from tasks.config import parse_config, sweep_variants
    from tasks.errors import ConfigError
    from tasks.planning import format_plan, plan_runs
    from tasks.state import state_paths

    logs = _Logs()
    monkeypatch.setattr(sweep, "get_run_logger", logs)
    cfg = _cfg(toy, tmp_path / "state", grid={"privacy.target_epsilon": [3.0, 3.0001]})
    cfg["privacy"]["dataset_epsilon_cap"] = 3.2  # each fits alone, the two compose above it
    with pytest.raises(ConfigError, match="exceed a dataset's privacy budget") as refused:
        sweep.sweep_flow(cfg)
    assert not (tmp_path / "state" / "mlflow.db").exists()
    assert not (tmp_path / "state" / "ledger.sqlite").exists()  # nothing reserved
    # the plan the sweep made (the same released sizes, kept under private/): none of its numbers left
    plan = plan_runs(sweep_variants(parse_config(cfg)), state_paths(str(tmp_path / "state")))
    assert not plan["fits"]
    numbers = set(re.findall(r"\d+\.\d{4}", format_plan(plan)))
    assert numbers
    for text in (logs.text, str(refused.value)):
        assert not numbers & set(re.findall(r"\d+\.\d{4}", text)), text
        assert "planned" not in text.replace("planned runs", "")
    assert "budget plan" not in logs.text
    assert "toy-sst2" not in str(refused.value) and "privprompt plan" in str(refused.value)


@pytest.mark.slow  # suite time: runs with -m slow
def test_resumed_sweep_skips_finished_variants(prefect_harness, toy, tmp_path, monkeypatch):
    from flows import sweep
    from flows.sweep import sweep_flow

    logs = _Logs()
    monkeypatch.setattr(sweep, "get_run_logger", logs)
    cfg = _cfg(toy, tmp_path / "state", sweep=[{"privacy.target_epsilon": 2.0}])
    first = sweep_flow(cfg)
    # logged to Prefect after the check: the runs' planned ε, never the per-dataset lines (which dataset a
    # source is charged to depends on its records)
    assert "budget plan (1 to run, 0 finished before)" in logs.text and "planned ε" in logs.text
    assert "(fits)" not in logs.text and "dataset " not in logs.text
    again = sweep_flow(cfg)
    assert [r["resumed"] for r in first["variants"]] == [False]
    assert [r["resumed"] for r in again["variants"]] == [True]
    assert again["variants"][0]["mlflow_run_id"] == first["variants"][0]["mlflow_run_id"]
    client = _mlflow(tmp_path / "state")
    exp = client.get_experiment_by_name("tests")
    method_runs = [r for r in client.search_runs([exp.experiment_id], "tags.flow = 'method'")]
    assert len(method_runs) == 1  # the rerun trained nothing
    report = client.list_artifacts(again["mlflow_run_id"], "report")
    assert {a.path for a in report} == {"report/comparison.md", "report/privacy_utility.png", "report/summary.md"}
    # `privprompt report EXPERIMENT --out DIR` rebuilds it from MLflow alone and writes the files
    from privprompt_cli import main

    assert main(["--state-dir", str(tmp_path / "state"), "report", "tests", "--out", str(tmp_path / "out")]) == 0
    written = {p.name for p in (tmp_path / "out").iterdir()}
    # in DIR itself, nothing else; production.md: which registered version of each dataset is in production
    assert written == {"comparison.md", "privacy_utility.png", "summary.md", "production.md"}


@pytest.mark.parametrize("override,needle", [
    ({"privacy": {"target_epsilon": float("inf")}}, "must be a finite number"),
    ({"grid": {"privacy.target_epsilon": []}}, "grid.privacy.target_epsilon must be a non-empty list"),
    ({"method": "nope"}, "not registered; choose one of"),
])
def test_bad_sweep_input_is_one_clear_error(toy, tmp_path, override, needle):
    from tasks.config import parse_config
    from tasks.errors import ConfigError

    cfg = _cfg(toy, tmp_path / "state")
    for k, v in override.items():
        cfg[k] = {**cfg[k], **v} if isinstance(v, dict) and isinstance(cfg.get(k), dict) else v
    with pytest.raises(ConfigError, match=needle):
        parse_config(cfg)


@pytest.mark.slow  # a LocalCluster of worker processes (≈ 40 s); the serial sweep tests run by default
def test_sweep_variants_run_as_dask_tasks(prefect_harness, toy, tmp_path):
    """sweep_dask: the variants run on a local Dask cluster (two worker processes), each its own
    method flow run; the ledger composes both and the summary has both rows, in order."""
    from flows.sweep import sweep_flow
    from privacy.ledger import Ledger

    cfg = _cfg(toy, tmp_path / "state", grid={"privacy.target_epsilon": [2.0, 4.0]},
               sweep_dask={"n_workers": 2, "threads_per_worker": 1})
    out = sweep_flow(cfg)
    labels = [r["variant"] for r in out["variants"]]
    assert labels == ["privacy.target_epsilon=2.0", "privacy.target_epsilon=4.0"]
    eps = [r["privacy.epsilon"] for r in out["variants"]]
    assert 1.85 <= eps[0] <= 2.0 and 3.85 <= eps[1] <= 4.0  # the sizes release takes its share (≤ 0.15)
    assert len({r["mlflow_run_id"] for r in out["variants"]}) == 2
    (entry,) = Ledger(tmp_path / "state" / "ledger.sqlite").datasets()
    assert entry["committed_runs"] == 2 and entry["reserved_runs"] == 0
    client = _mlflow(tmp_path / "state")
    for r in out["variants"]:
        assert client.get_run(r["mlflow_run_id"]).data.tags["sweep.variant"] == r["variant"]


def test_short_labels_keep_variants_apart():
    """The plan printed 31 characters of each label: every variant of a RAPT λ grid read
    ``methods.rapt.reconstruction_wei``. Keys are cut to their last part, never merging labels."""
    from tasks.planning import short_labels

    long = "methods.rapt.reconstruction_weight=0.1,methods.rapt.tuning=prefix,methods.rapt.eta=150.0,seed=2"
    assert short_labels([long]) == ["reconstruction_weight=0.1,tuning=prefix,eta=150.0,seed=2"]
    clash = ["methods.a.eta=1.0", "methods.b.eta=1.0"]  # shortened they would read the same
    assert short_labels(clash) == clash
    assert short_labels(["(config)", "seed=1"]) == ["(config)", "seed=1"]


def test_a_plan_over_the_cap_probes_no_model_for_its_time(toy, tmp_path, monkeypatch):
    """The budget's verdict comes first: a config over the dataset's cap is refused without the
    time probe (it loads and runs the model); one that fits gets its estimate."""
    from tasks import estimate as est
    from tasks.config import parse_config
    from tasks.planning import plan_runs
    from tasks.state import state_paths

    probed = []
    monkeypatch.setattr(est, "probe", lambda *a, **k: probed.append(a[0]) or est.Probe(a[0], train_s=0.01, eval_s=0.001))
    over = parse_config(_cfg(toy, tmp_path / "state", privacy={"target_epsilon": 8.0, "dataset_epsilon_cap": 2.0}))
    plan = plan_runs([("", over)], state_paths(str(tmp_path / "state")), estimate=True)
    assert not plan["fits"] and probed == [] and not any("seconds" in r for r in plan["runs"])
    fits = parse_config(_cfg(toy, tmp_path / "state", privacy={"target_epsilon": 1.0, "dataset_epsilon_cap": 2.0}))
    plan = plan_runs([("", fits)], state_paths(str(tmp_path / "state")), estimate=True)
    assert plan["fits"] and probed and all("seconds" in r for r in plan["runs"])
