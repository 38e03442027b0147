"""Issue 41, never worse than nothing: every dp run compares its output with no prompt on the private
holdout through one released, accounted number (the plan's release ``no_prompt``: tasks/no_prompt.py),
and publishes no prompt when it loses (``fallback.enabled``, the default) or warns.

Pinned here: the release's noise against its declared distribution and its σ against (ε, δ); its
statistic under the neighbour harness for every privacy unit (and a double that counts rows instead of
people caught); its cost in the plan; a deliberately bad prompt (a test double) falling back through the
lifecycle's door, the ε committed being the composition of all three releases (checked against
dp-accounting); what the summary, the MLflow tags and description and the report say."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from privacy import events as ev
from tasks import neighbours, no_prompt, publish
from tasks.methodkit import holdout as holdout_scoring
from tasks.methods import PrivateRows

from tests.claims.test_neighbour_harness import UNITS, _config, _plan, check_release, fast_calibration  # noqa: F401


# ---- the mechanism ----------------------------------------------------------------------------

class _Predicts:
    """A method double: the prompt right on the first ``right`` rows, no prompt right on none."""

    def __init__(self, right: int):
        self.right = right

    def holdout_predictions(self, mctx, prompt, rows):
        y = np.array([["neg", "pos"].index(label) for label in rows.labels])
        out = 1 - y
        if prompt is not None:
            out[: self.right] = y[: self.right]
        return out


def _cfg(**fallback):
    from tasks.config import parse_config

    return parse_config({"method": "prompt_dpsgd", "data": {"name": "toy", "labels": ["neg", "pos"]},
                         "models": {"local": "tiny-bert"}, "privacy": {"target_epsilon": 4.0},
                         "fallback": fallback})


def test_the_noisy_difference_is_the_exact_one_plus_its_declared_gaussian(monkeypatch):
    """4,000 releases of D = 30 (30 of 50 holdout rows right with the prompt, none without), each with
    fresh secret noise: D̃ − D is N(0, σ²) with the plan's σ (Kolmogorov–Smirnov, and its moments)."""
    from scipy import stats

    from tasks.randomness import DpRandomness

    holdout = PrivateRows([f"t{i}" for i in range(50)], ["neg", "pos"] * 25)
    monkeypatch.setattr(no_prompt, "holdout_rows", lambda part: holdout)
    monkeypatch.setattr(holdout_scoring, "holdout_predictions",  # the double predicts for itself
                        lambda method, mctx, prompt, rows: method.holdout_predictions(mctx, prompt, rows))
    sigma = 3.7
    plan = SimpleNamespace(no_prompt=SimpleNamespace(event=ev.GaussianEvent(sigma)))
    mctx = SimpleNamespace(cfg=_cfg(), randomness=DpRandomness())  # secret: not seeded by the config's seed
    draws = np.array([no_prompt.release(mctx, plan, _Predicts(30), "p", None, 50)[no_prompt.DIFFERENCE]
                      for _ in range(4000)])
    noise = (draws - 30.0) / sigma
    # bounds a correct mechanism misses with probability < 1e-5 each (secret noise: not replayable);
    # a σ off by 10% fails the spread at once
    assert stats.kstest(noise, "norm").pvalue > 1e-5
    assert abs(noise.mean()) < 0.1 and 0.94 < noise.std() < 1.06
    one = no_prompt.release(mctx, plan, _Predicts(30), "p", None, 50)
    assert one[no_prompt.SIGMA] == sigma and one[no_prompt.GAIN] == pytest.approx(one[no_prompt.DIFFERENCE] / 50)


def test_the_comparisons_sigma_meets_its_share_exactly_and_by_dp_accounting():
    """σ is the analytic Gaussian's for (ε share, δ/10); dp-accounting's PLD of that Gaussian gives the
    same ε (what the plan counts), never above the share beyond the PLD's rounding."""
    from dp_accounting import GaussianDpEvent
    from dp_accounting.pld import pld_privacy_accountant

    from privacy.mechanisms import gaussian_delta
    from privacy.plan import no_prompt_comparison

    for eps, delta in ((0.4, 1e-6), (0.8, 1e-5), (2.0, 1e-7)):
        event, counted = no_prompt_comparison(eps, delta)
        assert gaussian_delta(eps, event.noise_multiplier) <= delta * (1 + 1e-6)
        assert gaussian_delta(eps, event.noise_multiplier * 0.999) > delta  # the smallest such σ
        pld = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
        assert pld.compose(GaussianDpEvent(event.noise_multiplier)).get_epsilon(delta) == pytest.approx(eps, rel=2e-3)
        assert counted == pytest.approx(eps, rel=2e-3)


def test_one_person_moves_the_difference_by_at_most_one():
    """Each of a person's n holdout rows weighs 1/n: a person flipped on all of them moves D by 1."""
    cfg = _cfg()
    rows = PrivateRows(["a", "b", "c", "d"], ["neg", "pos", "neg", "pos"], units=["u1", "u1", "u1", "u2"])
    person = SimpleNamespace(data=SimpleNamespace(labels=["neg", "pos"], user_unit=True, privacy_unit="author"))
    assert no_prompt.exact_difference(cfg, lambda p, r: _Predicts(4).holdout_predictions(None, p, r), "p",
                                      rows) == 4.0
    assert no_prompt.exact_difference(person, lambda p, r: _Predicts(4).holdout_predictions(None, p, r), "p",
                                      rows) == pytest.approx(2.0)
    assert no_prompt.exact_difference(person, lambda p, r: _Predicts(3).holdout_predictions(None, p, r), "p",
                                      rows) == pytest.approx(1.0)  # u1's three rows: one vote
    assert no_prompt.exact_difference(cfg, lambda p, r: _Predicts(4).holdout_predictions(None, p, r), None,
                                      rows) == 0.0  # no prompt against itself


# ---- the neighbour harness ----------------------------------------------------------------------

@pytest.mark.parametrize("unit", list(UNITS))
def test_the_harness_checks_the_comparison_under_every_unit(tmp_path, fast_calibration, unit):  # noqa: F811
    plan, cfg = _plan(_config(tmp_path, "prompt_dpsgd", unit, "off"), "prompt_dpsgd")
    release = plan.no_prompt
    assert release.statistics == ("no_prompt_difference",)
    assert release.sensitivity == float(cfg.data.group_size or 1) and release.unit == plan.charge_unit
    assert check_release(release, cfg, unit) == []
    # and the bound is reached: some neighbour (one landing in the holdout) moves D by exactly it
    from tests.claims.test_neighbour_harness import BASE_TEST, BASE_TRAIN, KEY, _source, neighbours_of

    base = neighbours.no_prompt_difference(_source(BASE_TRAIN, BASE_TEST), cfg, KEY)
    moved = [abs(float((neighbours.no_prompt_difference(d, cfg, KEY) - base)[0])) for d in neighbours_of(unit).values()]
    assert base[0] > 0 and max(moved) == release.sensitivity


def test_a_comparison_that_counts_rows_instead_of_people_is_caught(tmp_path, fast_calibration):  # noqa: F811
    @neighbours.register_statistic("no_prompt_rows_not_people")
    def rows_not_people(source, cfg, key):
        _, rows = neighbours.split_rows(source, cfg, key)
        return np.array([float(len(rows.holdout[0]))])  # every holdout row +1, whoever it belongs to

    try:
        plan, cfg = _plan(_config(tmp_path, "prompt_dpsgd", "person", "off"), "prompt_dpsgd")
        broken = dataclasses.replace(plan.no_prompt, statistics=("no_prompt_rows_not_people",))
        caught = check_release(broken, cfg, "person")
        assert caught and all("no_prompt_rows_not_people" in p for p in caught)
    finally:
        neighbours.unregister_statistic("no_prompt_rows_not_people")


# ---- the plan ---------------------------------------------------------------------------------

def test_the_plan_shows_the_comparisons_cost_out_of_the_runs_budget(tmp_path, fast_calibration):  # noqa: F811
    from tasks.config import parse_config
    from tasks.data import ReleasedSizes
    from tasks.methods import get_method
    from tasks.planning import _plan_row, format_plan
    from tasks.run_plan import plan_for

    raw = _config(tmp_path, "prompt_dpsgd", "record", "off")
    sizes = ReleasedSizes(n_train=400, n_holdout=100, n_test=100, sigma=5.0)
    cfg = parse_config(raw)
    row = _plan_row("", cfg, get_method("prompt_dpsgd"), sizes, 1e-5, "record", [])
    plan = plan_for(cfg, "prompt_dpsgd", sizes, 1e-5)
    assert row["no_prompt"]["epsilon"] == plan.no_prompt.epsilon == pytest.approx(0.1 * 8.0, rel=1e-6)
    sizes_eps = plan.release("sizes").epsilon
    assert plan.method_epsilon >= 8.0 - sizes_eps - plan.no_prompt.epsilon  # raised by the joint calibration
    text = format_plan({"runs": [row], "datasets": {}})
    assert (f"of it, the comparison with no prompt on the holdout: ε = {plan.no_prompt.epsilon:.4f} "
            "(fallback.epsilon_share 0.1;") in text
    assert f"the method's share ε = {plan.method_epsilon:.4f} (each alone at its part of δ" in text and "no prompt is published if it loses" in text
    # the stated rule: a 5-point gain at 2σ of the comparison's noise needs a holdout of 40σ, which the
    # released holdout must show at its lower bound ñ − 3σ_sizes (so it holds for the true size)
    sigma = plan.no_prompt.event.noise_multiplier
    assert 100 - 3 * 5.0 < 40 * sigma  # 100 released holdout records against σ ≈ 5: too few
    assert (f"WARNING: too few records for ε = 8 per record (δ = 1e-05) with this route: released.n_train ≈ 400, "
            f"released.n_holdout ≈ 100 "
            f"(noisy counts, σ = 5); the comparison with no prompt adds noise σ = {sigma:.3g} to a holdout of ≈ 100 "
            f"(released, ± 5): a gain of 5% shows at 2σ only on ≥ {40 * sigma:,.0f}") in text
    big = _plan_row("", cfg, get_method("prompt_dpsgd"), ReleasedSizes(n_train=4000, n_holdout=1000, n_test=100,
                                                                      sigma=5.0), 1e-5, "record", [])
    assert big["size"]["problems"] == [] and "WARNING: too few" not in format_plan({"runs": [big], "datasets": {}})
    assert "WARNING: too few" not in format_plan({"runs": [row], "datasets": {}}, datasets=False)  # the sweep's log
    # a dp baseline beside another published method publishes nothing: no comparison for it (review)
    beside = parse_config({**raw, "method": "prefix_dpsgd"})
    assert plan_for(beside, "prompt_dpsgd", sizes, 1e-5).no_prompt is None
    # a share of 0: no comparison, the whole budget (less the sizes) to the method
    off = parse_config({**raw, "fallback": {"epsilon_share": 0.0}})
    alone = plan_for(off, "prompt_dpsgd", sizes, 1e-5)
    assert alone.no_prompt is None and alone.method_epsilon == pytest.approx(8.0 - sizes_eps)
    assert "comparison with no prompt" not in format_plan({"runs": [_plan_row("", off, get_method("prompt_dpsgd"), sizes, 1e-5,
                                                                                "record", [])], "datasets": {}})
    # a selection (its candidates include no prompt) and DP-OPT (its DP-argmax includes the empty
    # instruction) already choose against no prompt: no second release
    from tasks.methods import get_method
    from tasks.run_plan import no_prompt_share, runner

    selected = parse_config({**raw, "selection": {"enabled": True, "mode": "every_candidate"}})
    assert type(runner(selected, "prompt_dpsgd").mechanism).__name__ == "Selection"
    assert no_prompt_share(selected, runner(selected, "prompt_dpsgd")) == 0.0
    assert no_prompt_share(cfg, get_method("dp_opt")) == 0.0 and no_prompt_share(cfg, get_method("dpzero")) == 0.1


# ---- a bad prompt through the door --------------------------------------------------------------

class _Child:
    """The training's child run, without MLflow (this test is about what the door spends and publishes)."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def _context_without_tracking(root: Path, sst2_dir: Path, monkeypatch):
    """The door's context on a toy partition (test_release_once's), MLflow replaced by a no-op child."""
    from tests.pipeline.test_flow import _config as flow_config, _toy_dataset

    from tasks import recording
    from tasks.config import parse_config
    from tasks.data import partition_dataset
    from tasks.stages import StageContext
    from tasks.state import state_paths

    _toy_dataset(root / "data", sst2_dir, n_train=120, n_test=20)
    cfg = parse_config(flow_config(root / "data", root / "state", fallback={"epsilon_share": 0.45},
                                   **{"privacy.target_epsilon": 8.0}))
    paths = state_paths(str(root / "state")).create()
    part = partition_dataset(cfg.data, cfg.seed, paths.private, None)
    for name in ("open_training", "record_choice", "record_training"):
        monkeypatch.setattr(recording, name, lambda *args, **kwargs: _Child())
    return StageContext(cfg=cfg, state_dir=str(root / "state"), partition=part.to_dict(), parent_run_id="parent",
                        flow_run_id="flow-run-1")


def test_a_bad_prompt_falls_back_and_its_comparison_is_committed(tmp_path, sst2_dir, monkeypatch,
                                                                 fast_calibration):  # noqa: F811
    """A test double of prompt_dpsgd whose prompt is wrong on every holdout row where no prompt is
    right (and right nowhere else): D̃ far below 0 (ε share 0.45 of 8: σ ≈ 1 record, D ≈ −n_holdout).
    No prompt is published (the model without one is registered); the ledger commits the three releases, the ε the
    run states is dp-accounting's for that composition."""
    import torch
    from privacy import accountant as acct
    from tasks import lifecycle
    from tests.independent import pld_epsilon
    from tasks.methods import get_method
    from tasks.methods.base import Trained

    ctx = _context_without_tracking(tmp_path, sst2_dir, monkeypatch)
    cls = type(get_method("prompt_dpsgd").mechanism)

    def train(self, mctx, plan, rows, progress=None):  # the double: a "trained" prompt, the planned event
        return Trained(torch.zeros(3, 8), plan.own.event, 1, {})

    def predictions(self, mctx, prompt, rows):
        y = np.array([mctx.cfg.data.labels.index(label) for label in rows.labels])
        return y if prompt is None else 1 - y

    monkeypatch.setattr(cls, "train", train)
    monkeypatch.setattr(cls, "preflight", lambda self, cfg, prepared: None)  # the double loads no model
    monkeypatch.setattr(holdout_scoring, "holdout_predictions", predictions)
    registered = []

    def publish_usable(ctx, child, name, guarantee, prompt_path, spend, source="trained"):
        registered.append((name, guarantee, prompt_path, spend, source))
        return {"registry.model": f"models:/privprompt.toy.{name}/1", "prompt.source": source}

    monkeypatch.setattr(publish, "publish_usable", publish_usable)
    out = lifecycle.run_method(ctx, "prompt_dpsgd", {})
    m = out.train_metrics
    assert m[no_prompt.FALLBACK] == 1.0 and m[no_prompt.CONCLUSIVE] == 1.0 and m[no_prompt.DIFFERENCE] < 0
    # no prompt is published; the model without one is registered in its place, with the run's ε
    assert out.prompt_path is None and not out.published
    assert out.registered_model == "models:/privprompt.toy.prompt_dpsgd/1"
    ((name, guarantee, path, spend, source),) = registered
    assert (name, guarantee, source) == ("prompt_dpsgd", "dp", "none") and spend["epsilon"] == out.spend["epsilon"]
    assert [p.name for p in (Path(ctx.state_dir) / "outputs").rglob("prompt_dpsgd*")] == ["prompt_dpsgd_no_prompt.json"]
    stored = json.loads(Path(path).read_text())
    assert stored["kind"] == "text" and stored["instruction"] == "" and stored["metadata"]["prompt.source"] == "none"
    plan = lifecycle.plan_for(ctx.cfg, "prompt_dpsgd", ctx.part.sizes)
    entry = ctx.paths.open_ledger().entry("flow-run-1:prompt_dpsgd")
    committed = ev.event_from_dict(entry["committed_event"])
    assert entry["status"] == "committed" and committed == plan.event
    assert plan.event.then.events[-1] == plan.no_prompt.event  # the comparison's ε is charged although it fell back

    def by_pld(event, delta):
        return pld_epsilon(event, delta, 1e-3)

    share = plan.event.first_delta_share  # the sizes release beside the rest, by basic composition
    by_dp_accounting = by_pld(plan.event.first, share * plan.delta) + by_pld(plan.event.then, (1 - share) * plan.delta)
    assert out.spend["epsilon"] == acct.spend(plan.event, plan.delta).epsilon
    assert out.spend["epsilon"] == pytest.approx(by_dp_accounting, rel=0.02) and out.spend["epsilon"] <= 8.0 * (1 + 1e-6)
    line, tags = no_prompt.note(m)
    assert "NO prompt was published" in line and tags == {no_prompt.TAG_FALLBACK: "true"}


# ---- what the run says ------------------------------------------------------------------------

def test_the_decision_and_what_the_summary_says():
    on, off = _cfg(), _cfg(enabled=False)
    lost = {no_prompt.DIFFERENCE: -12.0, no_prompt.SIGMA: 4.0}
    assert no_prompt.decide(on, lost) == {no_prompt.FALLBACK: 1.0, no_prompt.CONCLUSIVE: 1.0}
    assert no_prompt.decide(off, lost) == {no_prompt.FALLBACK: 0.0, no_prompt.CONCLUSIVE: 1.0}
    assert no_prompt.decide(on, {}) == {}  # no comparison (a selection, DP-OPT, share 0): nothing to decide
    line, tags = no_prompt.note({**lost, **no_prompt.decide(off, lost)})
    assert "published anyway (fallback.enabled: false)" in line and tags == {no_prompt.TAG_BELOW: "true"}
    small = {no_prompt.DIFFERENCE: -3.0, no_prompt.SIGMA: 4.0}
    line, _ = no_prompt.note({**small, **no_prompt.decide(on, small)})
    assert "NO prompt was published" in line and "inconclusive" in line  # a tie goes to no prompt
    ahead = {no_prompt.DIFFERENCE: 5.0, no_prompt.SIGMA: 4.0}
    line, tags = no_prompt.note({**ahead, **no_prompt.decide(on, ahead)})
    assert line.startswith("the prompt is not shown to beat no prompt") and "inconclusive" in line and not tags
    clear = {no_prompt.DIFFERENCE: 40.0, no_prompt.SIGMA: 4.0}
    assert no_prompt.note({**clear, **no_prompt.decide(on, clear)}) == (None, {})


def test_the_summary_mlflow_and_the_report_say_it_fell_back():
    from tests.pipeline.test_run_statement import _Parent, _summary

    from tasks.comparison import comparison_table
    from tasks.outcome import RunOutcome
    from tasks.methods import get_method
    from tasks.pipeline import RunReport
    from tasks.statement import run_markdown

    metrics = {no_prompt.DIFFERENCE: -12.5, no_prompt.SIGMA: 4.0, no_prompt.FALLBACK: 1.0, no_prompt.CONCLUSIVE: 1.0}
    out = RunOutcome("prompt_dpsgd", "dp", True, train_metrics=metrics)
    rec = RunReport(_cfg(), get_method("prompt_dpsgd"), _Parent())
    (warning,) = rec.warnings(out)
    assert "D̃ = -12.50 (noise σ = 4.00; conclusive)" in warning and "NO prompt was published" in warning
    assert rec.parent.tags == {"result.fallback_to_no_prompt": "true"}
    text = run_markdown(_summary(metrics={"privacy.epsilon": 3.9, "privacy.delta": 1e-5, **metrics},
                                 warnings=[warning]))
    assert "| holdout records right with the prompt − without (DP, noisy) | -12.5000 |" in text
    assert "| no prompt published instead (fallback) | yes |" in text and "**Warning:** the prompt lost" in text
    base = {"method": "prompt_dpsgd", "dataset": "reviews", "guarantee": "dp", "seed": "0", "epsilon": 3.9,
            "delta": 1e-5, "unit": "record", "eta": None, "mia_auc": None, "note": "", "accuracy": 0.74,
            "zero_shot": 0.74}
    lines = comparison_table([{**base, "run_id": "aaaaaaaa1", "fell_back": True}]).splitlines()
    assert [line for line in lines if line.startswith(("NOTE", "WARNING"))] == [
        "NOTE: run aaaaaaaa (prompt_dpsgd, reviews): its prompt lost to no prompt in the released holdout "
        "comparison: no prompt was published (fallback); its test accuracy is the model's without a prompt"]
