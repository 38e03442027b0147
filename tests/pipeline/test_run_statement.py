"""Issue 41, what a run tells its user: the unit and δ beside every ε (plan, run summary, ledger
table, report with the dataset's composed spend, the MLflow run's description, the Prefect
artifact), and a budget refusal before any baseline or evaluation work."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import privprompt_commands.run
from privacy import events as ev
from privacy.ledger import Ledger
from tasks.statement import epsilon_statement, run_markdown, unit_phrase

REPO = Path(__file__).resolve().parents[1]


def test_epsilon_statement_names_unit_delta_and_accountant():
    assert unit_phrase("record") == unit_phrase(None) == "per record"
    assert unit_phrase("customer_id") == "per person (customer_id)"
    assert epsilon_statement(3.89641, 1e-5, "customer_id", "min_pld_rdp") == (
        "ε = 3.8964 per person (customer_id), δ = 1e-05 (accountant min_pld_rdp)")


def _summary(**extra) -> dict:
    summary = {"flow_run_id": "f", "mlflow_run_id": "m", "experiment": "e", "method": "prompt_dpsgd",
               "dataset": "reviews", "unit": "customer_id", "accountant": "min_pld_rdp",
               "metrics": {"privacy.epsilon": 3.8964, "privacy.delta": 1e-5, "privacy.epsilon_rdp": 4.1,
                           "test.accuracy": 0.6045, "test.accuracy.zero_shot": 0.7445},
               "guarantee": "dp", "compute_seconds": {"train": 1.0}, "device": "cpu",
               "published": {"method": "prompt_dpsgd", "prompt_path": "/s/outputs/p.safetensors",
                             "prompt_published": True, "guarantee": "dp", "formal_dp_guarantee": True,
                             "artifact_uri": "runs:/m/prompt/p.safetensors"},
               "registered_model": "models:/privprompt.reviews.prompt_dpsgd/3"}
    summary.update(extra)
    return summary


def test_run_markdown_states_epsilon_with_unit_and_delta():
    text = run_markdown(_summary(warnings=["the published prompt's released holdout score is below no prompt's"]))
    assert "ε = 3.8964 per person (customer_id), δ = 1e-05 (accountant min_pld_rdp)" in text
    assert "| test accuracy | 0.6045 |" in text and "| test accuracy, zero_shot | 0.7445 |" in text
    assert "models:/privprompt.reviews.prompt_dpsgd/3" in text and "**Warning:**" in text
    assert "no formal guarantee" in run_markdown(_summary(metrics={"test.accuracy": 0.5}, guarantee="none"))


def test_cli_summary_prints_unit_delta_and_the_registered_model(capsys):
    privprompt_commands.run._print_summary(_summary(), 10.0)
    out = capsys.readouterr().out
    assert "privacy:                    ε = 3.8964 per person (customer_id), δ = 1e-05 (accountant min_pld_rdp)" in out
    assert "registered model:           models:/privprompt.reviews.prompt_dpsgd/3" in out


def test_plan_output_shows_unit_and_delta_per_run_and_dataset():
    from tasks.planning import format_plan

    plan = {"runs": [{"variant": "", "method": "zero_shot", "guarantee": "none", "epsilon": None, "delta": 1e-5,
                      "unit": "customer_id"},
                     {"variant": "", "method": "prompt_dpsgd", "guarantee": "dp", "epsilon": 3.8964, "delta": 1e-5,
                      "unit": "customer_id"}],
            "datasets": {"f" * 64: {"name": "reviews", "unit": "customer_id", "delta": 1e-5, "spent_epsilon": 0.0,
                                    "total_epsilon": 3.8964, "cap": 10.0, "fits": True}}}
    lines = format_plan(plan).splitlines()
    assert lines[0].split()[-2:] == ["δ", "unit"]
    assert lines[2].endswith("3.8964  1e-05    per person (customer_id)")
    assert lines[1].split()[-2:] == ["-", "-"]  # no ε, so no δ or unit either
    assert lines[3].startswith("dataset reviews (ffffffffffff): spent ε=0.0000")
    assert lines[3].endswith("(fits); every ε per person (customer_id), δ = 1e-05")


def test_ledger_table_has_a_unit_column(tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.register_dataset("a" * 64, "reviews", 8.0, 1e-5, unit="customer_id")
    ledger.register_dataset("b" * 64, "sst2", 8.0, 1e-5)
    lines = ledger.summary_table().splitlines()
    header = lines[1].split()
    assert header[:4] == ["dataset", "fingerprint", "unit", "delta"]
    rows = {line.split()[0]: line.split() for line in lines[3:5]}
    assert rows["reviews"][2] == "customer_id" and rows["sst2"][2] == "record"
    assert any(line.startswith("unit: what every ε of the dataset protects") for line in lines)


def test_report_shows_the_dataset_composed_spend_beside_each_run(tmp_path):
    from tasks.comparison import add_composed_spend, comparison_table

    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.register_dataset("a" * 64, "reviews", 10.0, 1e-5, unit="customer_id")
    for flow in ("flowA", "flowB"):
        ledger.reserve("a" * 64, f"{flow}:prompt_dpsgd", ev.ExponentialEvent(1.0))
        ledger.commit(f"{flow}:prompt_dpsgd", ev.ExponentialEvent(1.0))
    spent = ledger.dataset("a" * 64)["spent_epsilon"]
    rows = [{"run_id": f"{flow}run00", "flow_run_id": flow, "method": "prompt_dpsgd", "dataset": "reviews",
             "guarantee": "dp", "seed": "0", "epsilon": 1.0, "delta": 1e-5, "unit": "customer_id", "eta": None,
             "accuracy": 0.6, "mia_auc": None, "note": ""} for flow in ("flowA", "flowB")]
    rows.append({**rows[0], "run_id": "zzzzzzzz", "flow_run_id": "flowC", "method": "zero_shot", "epsilon": None,
                 "guarantee": "none"})
    assert "dataset ε (composed" not in comparison_table(rows, [])  # MLflow's copy: no ledger column
    add_composed_spend(rows, ledger)
    table = comparison_table(rows, []).splitlines()
    assert "| δ | unit | dataset ε (composed, ledger) |" in table[0]
    assert table[2].startswith(f"| reviews | prompt_dpsgd | dp | 1.0000 | 1e-05 | per person (customer_id) | "
                               f"{spent:.4f} of cap 10 |")
    assert table[4].startswith("| reviews | zero_shot | none | - | - | - | - |")


# ---- the budget check before any work ------------------------------------------------------------

def customer_reviews(folder: Path, customers: int = 60, test_rows: int = 40) -> Path:
    """The issue's trial in small: a retailer's reviews (``review``, ``sentiment`` neg/pos,
    ``customer_id``), some customers with many reviews; synthetic text."""
    folder.mkdir(parents=True, exist_ok=True)
    words = {"pos": ["great", "lovely", "works well", "recommend"], "neg": ["broken", "awful", "refund", "late"]}

    def rows(n_customers, offset):
        out = []
        for c in range(n_customers):
            for j in range(20 if c < 3 else 1 + c % 3):
                label = "pos" if (c + j) % 2 else "neg"
                out.append({"review": f"order {offset + c}-{j}: {words[label][j % 4]}", "sentiment": label,
                            "customer_id": f"cust-{offset + c}"})
        return out

    for split, data in (("train", rows(customers, 0)), ("test", rows(test_rows, 10_000))):
        with (folder / f"{split}.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, ["review", "sentiment", "customer_id"])
            writer.writeheader()
            writer.writerows(data)
    return folder


def customer_config(root: Path, **privacy) -> Path:
    cfg = {"method": "prompt_dpsgd", "experiment": "reviews", "seed": 0,
           "data": {"name": "reviews", "path": str(customer_reviews(root / "reviews")), "text_field": "review",
                    "label_field": "sentiment", "labels": ["neg", "pos"], "privacy_unit": "customer_id",
                    "holdout_fraction": 0.2},
           "models": {"local": "tiny-bert", "max_length": 32},
           "privacy": {"target_epsilon": 4.0, "dataset_epsilon_cap": 10.0, **privacy},
           "methods": {"zero_shot": {"enabled": True}, "prompt_dpsgd": {"n_tokens": 2, "epochs": 1, "batch_size": 8}}}
    (root / "reviews.yaml").write_text(yaml.safe_dump(cfg))
    return root / "reviews.yaml"


@pytest.mark.slow  # a CLI process (≈ 8-12 s on two shared cores)
def test_an_over_cap_run_is_refused_in_seconds_and_spends_nothing(tmp_path):
    config = customer_config(tmp_path, dataset_epsilon_cap=2.0)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update({"PRIVPROMPT_HOME": str(tmp_path / "state"), "PYTHONPATH": str(REPO), "PRIVPROMPT_NO_WORKER": "1"})
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "privprompt_cli", "run", str(config)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("privprompt: error:")]
    assert len(errors) == 1 and "exhausted" in errors[0] and "per person (customer_id)" in errors[0], proc.stderr
    assert "refused before any baseline" in errors[0] and "nothing reserved, no ε used" in errors[0]
    largest = float(errors[0].split("the largest target_epsilon that still fits: ≈ ")[1].split(";")[0])
    assert 1.9 < largest <= 2.0  # under the cap of 2, nothing spent: the guarantee is ≤ its target
    assert "Traceback" not in proc.stderr
    # the refusal's own work (imports, the source's hash, the σ calibration, the ledger) is under 15 s of
    # CPU; its wall time is too on an idle machine (6 s measured), more when other work shares the cores
    assert cpu < 15.0 and wall < 45.0, (cpu, wall)
    ledger = tmp_path / "state" / "ledger.sqlite"
    assert not ledger.exists() or all(d["spent_epsilon"] == 0 for d in Ledger(ledger).datasets())
    assert not (tmp_path / "state" / "mlflow.db").exists()  # no run was started


# ---- never worse than nothing, silently ------------------------------------------------------------

class _Parent:
    def __init__(self):
        self.tags = {}

    def set_tags(self, tags):
        self.tags.update(tags)


def test_a_dp_prompt_below_no_prompt_on_the_test_split_is_warned_about_and_tagged():
    from tasks.config import parse_config
    from tasks.outcome import RunOutcome
    from tasks.methods import get_method
    from tasks.pipeline import RunReport

    cfg = parse_config({"method": "prompt_dpsgd", "data": {"name": "reviews", "labels": ["neg", "pos"]},
                        "models": {"local": "tiny-bert"}, "methods": {"zero_shot": {"enabled": True}}})
    out = RunOutcome("prompt_dpsgd", "dp", True, prompt_path="/s/outputs/p.safetensors")
    rec = RunReport(cfg, get_method("prompt_dpsgd"), _Parent())
    rec.metrics.update({"test.accuracy": 0.6045, "test.accuracy.zero_shot": 0.7445})
    (warning,) = rec.warnings(out)
    assert "test accuracy 0.6045 is below no prompt's 0.7445" in warning
    assert rec.parent.tags == {"result.below_no_prompt": "true"}
    rec.metrics["test.accuracy"] = 0.80
    assert RunReport(cfg, get_method("prompt_dpsgd"), _Parent()).warnings(out) == []  # no metrics: no comparison
    assert rec.warnings(out) == []
    assert "do not deploy" in run_markdown(_summary(warnings=[warning]))


def test_failed_selection_candidates_are_counted_publicly_never_named():
    from tasks import selection as tsel

    cands = [tsel.Candidate("lr=0.05", {"lr": 0.05}), tsel.Candidate("lr=0.2", {"lr": 0.2}),
             tsel.no_prompt_candidate("no prompt")]
    trials = [tsel.TrialOutcome(0, "lr=0.05", None, "ValueError: units dropped"),
              tsel.TrialOutcome(1, "lr=0.2", 0.8, None, (80.0, 20.0)), tsel.TrialOutcome(2, "no prompt", 0.9, None,
                                                                                     (90.0, 10.0))]
    result = tsel.SelectionResult(cands[2], None, 0.9, trials, None, (90.0, 10.0))
    assert result.every_candidate  # every candidate once (the default mode): the count is published
    _, metrics = tsel.published_choice(cands, result, (90.0, 10.0), fallback=False)
    assert metrics["selection.failed_candidates"] == 1.0
    # random stopping (trials drawn with repetition): the count would tell the secret number of trials K
    from privacy import events as ev

    stopping = ev.RepeatAndSelectEvent((ev.GaussianEvent(2.0),), "poisson", mu=3.0)
    repeated = tsel.SelectionResult(cands[2], None, 0.9, trials + [tsel.TrialOutcome(3, "lr=0.05", None, "again")],
                                    stopping, (90.0, 10.0))
    assert not repeated.every_candidate
    assert "selection.failed_candidates" not in tsel.published_choice(cands, repeated, (90.0, 10.0), False)[1]
    note = tsel.failed_note(metrics)
    assert note.startswith("1 selection candidate(s) failed") and "lr=0.05" not in note and "units" not in note
    assert tsel.failed_note({"selection.failed_candidates": 0.0}) is None
    assert "| failed selection candidates (count) | 1 |" in run_markdown(_summary(metrics={**metrics}))


def test_the_report_warns_below_no_prompt_and_counts_failed_candidates():
    from tasks.comparison import comparison_table

    base = {"method": "prompt_dpsgd", "dataset": "reviews", "guarantee": "dp", "seed": "0", "epsilon": 3.9,
            "delta": 1e-5, "unit": "customer_id", "eta": None, "mia_auc": None, "note": ""}
    rows = [{**base, "run_id": "aaaaaaaa1", "accuracy": 0.6045, "zero_shot": 0.7445},
            {**base, "run_id": "bbbbbbbb1", "accuracy": 0.80, "zero_shot": 0.7445,
             "selection": {"failed_candidates": 2.0}},
            {**base, "run_id": "cccccccc1", "accuracy": 0.80, "zero_shot": None, "below_no_prompt": True}]
    lines = comparison_table(rows).splitlines()  # the registered methods' sections: zero-shot is a reference
    warnings = [line for line in lines if line.startswith("WARNING")]
    assert warnings == [
        "WARNING: run aaaaaaaa (prompt_dpsgd, reviews): its prompt scored below no prompt; the model without a "
        "prompt serves better",
        "WARNING: run bbbbbbbb (prompt_dpsgd): 2 selection candidate(s) failed and were skipped",
        "WARNING: run cccccccc (prompt_dpsgd, reviews): its prompt scored below no prompt; the model without a "
        "prompt serves better"]


# ---- sizing: steps and a wall-time estimate per run ---------------------------------------------

def test_the_plan_estimates_steps_and_time_from_a_measured_probe():
    from types import SimpleNamespace

    from tasks import estimate as est
    from tasks.planning import format_plan

    measured = est.probe("tiny-bert", 16, train_batch=4, eval_batch=8)
    assert measured.train_s > 0 and measured.eval_s > 0
    assert est.probe("tiny-bert", 16, train_batch=4, eval_batch=8) is measured  # once per process
    sizes = SimpleNamespace(n_test=200, n_train=300)
    fixed = est.Probe("m", train_s=0.01, eval_s=0.002)
    dpsgd = SimpleNamespace(settings={"steps": 9, "expected_batch": 32.0}, reads_private=True)
    assert est.run_estimate(dpsgd, sizes, fixed) == {"steps": 9, "seconds": pytest.approx(9 * 32 * 0.01 + 200 * 0.002)}
    zero_shot = SimpleNamespace(settings={}, reads_private=False)
    assert est.run_estimate(zero_shot, sizes, fixed) == {"steps": None, "seconds": pytest.approx(0.4)}
    selection = SimpleNamespace(settings={"selection": {}}, reads_private=True)
    assert est.run_estimate(selection, sizes, fixed) == {"steps": None, "seconds": None}
    plan = {"runs": [{"variant": "", "method": "prompt_dpsgd", "guarantee": "dp", "epsilon": 3.9, "delta": 1e-5,
                      "unit": "record", "steps": 9, "seconds": 95.0}],
            "datasets": {}}
    lines = format_plan(plan).splitlines()
    assert lines[0].split()[5:8] == ["steps", "est.", "time"]
    assert "9" in lines[1].split() and "≈1.6 min" in lines[1]
    assert lines[2].startswith("est. time: ≈1.6 min of model work in all")


def test_a_probe_is_kept_per_machine_and_measured_again_on_demand(tmp_path, monkeypatch):
    """plan's model probe is measured once per machine (the state folder's cache/probe.json, 0600)
    and read back by the next plan — the plan says when it was measured; --probe measures again."""
    import json
    import stat

    from tasks import estimate as est
    from tasks.planning import format_plan

    monkeypatch.setattr(est, "_PROBES", {})
    monkeypatch.delenv(est.CACHE_ENV, raising=False)
    monkeypatch.delenv(est.REFRESH_ENV, raising=False)
    est.enable_cache(tmp_path)
    first = est.probe("tiny-bert", 16, train_batch=4, eval_batch=8)
    cache = tmp_path / "cache" / "probe.json"
    assert first.measured_at is None and stat.S_IMODE(cache.stat().st_mode) == 0o600
    (entry,) = json.loads(cache.read_text()).values()
    assert entry["train_s"] == first.train_s and entry["measured_at"]
    monkeypatch.setattr(est, "_PROBES", {})  # a new process
    again = est.probe("tiny-bert", 16, train_batch=4, eval_batch=8)
    assert (again.train_s, again.eval_s, again.measured_at) == (first.train_s, first.eval_s, entry["measured_at"])
    plan = {"runs": [{"variant": "", "method": "prompt_dpsgd", "guarantee": "dp", "epsilon": 3.9, "delta": 1e-5,
                      "unit": "record", "steps": 9, "seconds": 95.0, "probe_at": again.measured_at}], "datasets": {}}
    assert f"measured {again.measured_at} (privprompt plan --probe measures it again)" in format_plan(plan)
    monkeypatch.setattr(est, "_PROBES", {})
    monkeypatch.setenv(est.REFRESH_ENV, "1")
    fresh = est.probe("tiny-bert", 16, train_batch=4, eval_batch=8)
    assert fresh.measured_at is None  # measured now, and the cache replaced
    assert json.loads(cache.read_text())[next(iter(json.loads(cache.read_text())))]["train_s"] == fresh.train_s


def test_the_sweep_table_states_delta_and_unit_beside_epsilon():
    from flows.sweep import summary_table

    rows = [{"variant": "privacy.target_epsilon=4.0", "mlflow_run_id": "aaaaaaaa1", "privacy.epsilon": 3.8964,
             "privacy.delta": 1e-5, "unit": "customer_id", "test.accuracy": 0.70},
            {"variant": "method=zero_shot", "mlflow_run_id": "bbbbbbbb1", "privacy.epsilon": None, "unit": "customer_id",
             "test.accuracy": 0.74}]
    lines = summary_table(rows, []).splitlines()
    assert lines[0].endswith("| δ | unit |") and "privacy.epsilon" in lines[0]
    assert lines[2] == "| privacy.target_epsilon=4.0 | aaaaaaaa | 3.8964 | 0.7000 | 1e-05 | per person (customer_id) |"
    assert lines[3] == "| method=zero_shot | bbbbbbbb | - | 0.7400 | - | - |"


def test_the_time_estimate_counts_records_under_a_person_unit():
    """The released sizes and the expected batch count people; the model's work is per record: each
    person counts as data.max_records_per_unit records (public: an upper bound), and without a cap no
    time is estimated (records per person are private). The comparison with no prompt scores the
    holdout twice."""
    from types import SimpleNamespace

    from tasks import estimate as est
    from tasks.planning import format_plan

    fixed = est.Probe("m", train_s=0.01, eval_s=0.002)
    dpsgd = SimpleNamespace(settings={"steps": 9, "expected_batch": 32.0}, reads_private=True, no_prompt=None)
    people = SimpleNamespace(n_test=200, n_train=300, n_holdout=50, unit="customer_id")
    assert est.run_estimate(dpsgd, people, fixed, 40) == {
        "steps": 9, "seconds": pytest.approx(40 * (9 * 32 * 0.01 + 200 * 0.002)), "bound": True}
    uncapped = est.run_estimate(dpsgd, people, fixed, None)
    assert uncapped["seconds"] is None and "data.max_records_per_unit" in uncapped["why"]
    compared = SimpleNamespace(**{**vars(dpsgd), "no_prompt": object()})
    records = SimpleNamespace(n_test=200, n_train=300, n_holdout=50, unit="record")
    assert est.run_estimate(compared, records, fixed)["seconds"] == pytest.approx(9 * 32 * 0.01 + 300 * 0.002)
    plan = {"runs": [{"variant": "", "method": "prompt_dpsgd", "guarantee": "dp", "epsilon": 3.9, "delta": 1e-5,
                      "unit": "customer_id", "steps": 9, "seconds": 95.0, "bound": True},
                     {"variant": "b", "method": "prompt_dpsgd", "guarantee": "dp", "epsilon": 3.9, "delta": 1e-5,
                      "unit": "customer_id", **uncapped}], "datasets": {}}
    text = format_plan(plan)
    assert "≤≈1.6 min" in text and "an upper bound (each person counted as data.max_records_per_unit" in text
    assert "est. time: - (records per person are private" in text


def test_a_selection_gets_an_estimate_from_its_trials_plans(monkeypatch):
    """Every candidate once: each trained candidate's steps × batch, a holdout score per candidate (no
    prompt's among them) and the test split; random stopping: E[K] trials of a uniformly drawn candidate."""
    from types import SimpleNamespace

    from tasks import estimate as est
    from tasks import selection as tsel
    from tasks.methods import get_method
    from tasks.config import parse_config

    plans = {"lr=0.05": {"steps": 10, "expected_batch": 32.0}, "lr=0.2": {"steps": 20, "expected_batch": 16.0}}
    monkeypatch.setattr(tsel, "_candidate_plan", lambda method, cfg, c, t, n, d: (
        cfg, SimpleNamespace(settings=plans[c.name])))
    candidates = [{"name": n, "settings": {}, "zero_shot": False} for n in plans]
    plan = SimpleNamespace(n_train=300, settings={"selection": {"trial_target": 1.0, "delta": 1e-5, "candidates": [
        *candidates, {"name": "no prompt", "settings": None, "zero_shot": True}]}})
    raw = {"method": "prompt_dpsgd", "data": {"name": "x", "labels": ["neg", "pos"]}, "models": {"local": "tiny-bert"}}
    every = tsel.trial_work(parse_config({**raw, "selection": {"enabled": True}}), get_method("prompt_dpsgd"), plan)
    assert every == {"trainings": [(10, 32.0), (20, 16.0)], "scores": 3.0}
    fixed = est.Probe("m", train_s=0.01, eval_s=0.002)
    sizes = SimpleNamespace(n_test=200, n_train=300, n_holdout=50, unit="record")
    assert est.selection_estimate(every, sizes, fixed) == {
        "steps": 30, "seconds": pytest.approx((10 * 32 + 20 * 16) * 0.01 + (3 * 50 + 200) * 0.002)}
    stopping = tsel.trial_work(parse_config({**raw, "selection": {
        "enabled": True, "mode": "random_stopping", "accept_timing_channel": True, "expected_trials": 6.0}}),
        get_method("prompt_dpsgd"), plan)
    assert stopping["weight"] == pytest.approx(6.0 / 3) and stopping["scores"] == pytest.approx(7.0)
    assert est.selection_estimate(stopping, sizes, fixed)["steps"] == 60


def test_the_plans_guarantee_line_states_unit_and_delta():
    from tasks.planning import guarantee_line

    row = {"guarantee_epsilon": 7.992, "target_epsilon": 8.0, "delta": 1e-5, "unit": "record", "epsilon": 7.992,
           "size_epsilon": 0.071}
    line = guarantee_line(row)
    assert line.startswith("  guarantee: ε = 7.9920 per record, δ = 1e-05, of the target 8 (the split sizes' release")
    assert line.endswith("; the ledger charges the same")
    grouped = guarantee_line({**row, "unit": "author", "group": "3 author", "epsilon": 20.1, "epsilon_per_record": 7.992})
    assert "ε = 7.9920 per record, δ = 1e-05" in grouped
    assert grouped.endswith("the ledger charges ε = 20.1000 per person (author) (group privacy)")


def test_a_runs_seconds_per_example_replace_the_probe_in_the_next_plan(tmp_path, monkeypatch):
    """After a run, the plan estimates that method from the run's own seconds per example on this
    machine (no probe of the model); a method the run only evaluated keeps the probe's training."""
    from types import SimpleNamespace

    from tasks import estimate as est
    from tasks import planning

    monkeypatch.setattr(est, "_PROBES", {})
    monkeypatch.delenv(est.REFRESH_ENV, raising=False)
    monkeypatch.setenv(est.CACHE_ENV, str(est.state_cache(tmp_path)))
    shape = ("tiny-bert", 16, 32, 64)
    est.record_observed("prompt_dpsgd", *shape, None, train_s=0.004, eval_s=0.001, path=est.state_cache(tmp_path))
    # a method without steps is keyed at the probe's batch (its plan has no expected batch), as the flow keeps it
    est.record_observed("zero_shot", "tiny-bert", 16, est.PROBE_BATCH, 64, None, train_s=None, eval_s=0.0005,
                        path=est.state_cache(tmp_path))
    seen = est.observed("prompt_dpsgd", *shape)
    assert (seen.train_s, seen.eval_s, seen.observed) == (0.004, 0.001, True) and seen.measured_at

    def no_probe(*args, **kwargs):
        raise AssertionError("a method a run measured is not probed")

    monkeypatch.setattr(est, "probe", no_probe)
    cfg = SimpleNamespace(models=SimpleNamespace(max_length=16, eval_batch_size=64, placement_of=lambda m: None),
                          seed=0, data=SimpleNamespace(max_records_per_unit=None))
    method = SimpleNamespace(name="prompt_dpsgd", extras=SimpleNamespace(source_model=lambda cfg, prepared: "tiny-bert"))
    plan = SimpleNamespace(settings={"steps": 10, "expected_batch": 32.0}, reads_private=True, no_prompt=None)
    sizes = SimpleNamespace(n_test=100, n_train=320, n_holdout=0)
    row: dict = {}
    planning._estimate_row(row, cfg, method, plan, sizes)
    assert row["seconds"] == pytest.approx(10 * 32 * 0.004 + 100 * 0.001) and row["observed_at"] == seen.measured_at
    zero = SimpleNamespace(name="zero_shot", extras=method.extras)
    row = {}
    planning._estimate_row(row, cfg, zero, SimpleNamespace(settings={}, reads_private=False, no_prompt=None), sizes)
    assert row["seconds"] == pytest.approx(100 * 0.0005)
    monkeypatch.setenv(est.REFRESH_ENV, "1")  # plan --probe: the probe, measured again
    assert est.observed("prompt_dpsgd", *shape) is None
