"""Private selection through the one lifecycle (issue 30): the ``selection:`` block for every
registered method, a selection run end to end on a tiny model (one ledger entry whose ε is the
selection mechanism's, checked against dp-accounting's own RDP code; the winner published once;
a failing candidate skipped and said so; no exact holdout number in MLflow), ``privprompt plan``
showing the selection's ε beside one trial's, the report's released score, and the warning.

The run's DP streams are secret; the test pins only the selection's own stream (K, the trials'
candidates, the score noise) to a seeded generator chosen with the real driver so that every
candidate is tried, and scores a trained prompt above "no prompt", so the outcome is fixed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tasks.methods import get_method, registered_methods

from tests.pipeline.test_flow import _mlflow
from tests.methods.test_method_contract import _config as _contract_config
from tests.claims.test_release_once import _context, _dp_entries, _published_prompts

CANDIDATES = [{"lr": 0.05}, {"lr": 0.2}]  # lr=0.2 fails to train in the run below (data-independently)
SELECTION = {"enabled": True, "candidates": CANDIDATES, "expected_trials": 3.0, "mode": "random_stopping",
             "metric": "accuracy", "accept_timing_channel": True}


# ---- the block, for every registered method -------------------------------------------------

@pytest.mark.parametrize("name", registered_methods())
def test_selection_enabled_alone_parses_with_the_methods_grid_or_is_refused_in_one_line(name, tmp_path):
    from tasks import selection
    from tasks.config import parse_config
    from tasks.errors import ConfigError

    raw = _contract_config(tmp_path, name)
    base = parse_config(raw)
    assert base.selection.enabled is False  # off unless asked for
    method = get_method(name)
    try:
        cfg = parse_config({**raw, "selection": {"enabled": True}})
    except ConfigError as err:
        message = str(err)
        assert "\n" not in message and "selection:" in message
        # refused only for a reason the message names, and which holds for this method
        reasons = {"trains nothing": not method.traits.reads_private,
                   "reads the holdout": method.traits.uses_validation,
                   "has guarantee": any(method.mechanism.guarantee(selection.apply_settings(base, name, s)) != "dp"
                                        for s in method.traits.selection_grid)}
        assert any(reasons[k] for k in reasons if k in message), message
        return
    names = [c.name for c in selection.candidates_of(cfg, get_method(cfg.method))]
    grid = method.traits.selection_grid
    assert names == [selection.candidate_name(s) for s in grid] + ["no prompt"]
    assert len(set(names)) == len(names) >= 2
    for s in grid:  # each candidate is a valid block of the method, with a dp guarantee
        cand = selection.apply_settings(cfg, name, s)
        assert method.mechanism.guarantee(cand) == "dp"
        for key, value in s.items():
            node = getattr(cand.methods, name)
            for part in key.split("."):
                node = getattr(node, part)
            assert node == value


def test_some_methods_select_and_the_base_default_is_the_configured_settings(tmp_path):
    from tasks import selection
    from tasks.config import parse_config
    from tasks.methods.base import Traits

    accepted = []
    for name in registered_methods():
        try:
            parse_config({**_contract_config(tmp_path, name), "selection": {"enabled": True}})
            accepted.append(name)
        except Exception:  # noqa: BLE001 - refusals are checked above
            pass
    assert "prompt_dpsgd" in accepted and len(accepted) >= 3
    cfg = parse_config(_contract_config(tmp_path, "prompt_dpsgd"))
    assert cfg.selection.enabled is False and Traits().selection_grid == ({},)  # the base default: the configured settings
    assert selection.candidate_name({}) == "configured"


def test_candidates_ranges_and_bad_keys(tmp_path):
    from tasks import selection
    from tasks.config import config_hash, parse_config
    from tasks.errors import ConfigError

    raw = _contract_config(tmp_path, "prompt_dpsgd")
    cfg = parse_config({**raw, "selection": SELECTION})
    assert [c.name for c in selection.candidates_of(cfg, get_method(cfg.method))] == ["lr=0.05", "lr=0.2", "no prompt"]
    drawn = parse_config({**raw, "selection": {"enabled": True, "ranges": {"lr": [0.01, 0.3], "n_tokens": [2, 6]},
                                               "draws": 5}})
    first = selection.candidates_of(drawn, get_method(drawn.method))
    assert [c.name for c in first] == [c.name for c in selection.candidates_of(drawn, get_method(drawn.method))]  # the seed's: public
    assert first[-1].zero_shot and all(not c.zero_shot for c in first[:-1])
    for c in first[:-1]:
        assert 0.01 <= c.config["lr"] <= 0.3 and isinstance(c.config["n_tokens"], int) and 2 <= c.config["n_tokens"] <= 6
    other_seed = parse_config({**raw, "seed": 1, "selection": drawn.selection.model_dump()})
    assert [c.name for c in selection.candidates_of(other_seed, get_method(other_seed.method))] != [c.name for c in first]
    for bad, match in (({"enabled": True, "candidates": [{"learning_rate": 0.1}]}, "'learning_rate' is not a key"),
                       ({"enabled": True, "candidates": [{"lr": -1.0}]}, "not a valid methods.prompt_dpsgd block"),
                       ({"enabled": True, "candidates": [{"lr": 0.1}], "ranges": {"lr": [0.1, 0.2]}, "draws": 2},
                        "candidates or ranges"),
                       ({"enabled": True, "ranges": {"lr": [0.1, 0.2]}}, "ranges and draws go together"),
                       ({"enabled": True, "ranges": {"lr": [0.2, 0.1]}, "draws": 2}, "low < high"),
                       ({"enabled": True, "expected_trials": 1.0}, "expected_trials"),
                       ({"enabled": True, "shots": 3}, "unknown config key")):
        with pytest.raises(ConfigError, match=match):
            parse_config({**raw, "selection": bad})
    with pytest.raises(ConfigError, match="audit's shadows train the configured settings"):
        parse_config({**raw, "selection": {"enabled": True}, "audit": {"enabled": True}})
    # random stopping's ε assumes K secret, but the run's duration (MLflow's and Prefect's timestamps)
    # grows with K: refused in one line unless the operator says those servers are closed
    with pytest.raises(ConfigError) as err:
        parse_config({**raw, "selection": {"enabled": True, "mode": "random_stopping"}})
    assert "timestamps" in str(err.value) and "accept_timing_channel" in str(err.value) and "\n" not in str(err.value)
    assert parse_config({**raw, "selection": {"enabled": True, "mode": "random_stopping",
                                              "accept_timing_channel": True}}).selection.accept_timing_channel
    # a config without the block hashes as before it existed (stored runs' config.hash); enabling it changes it
    assert config_hash(parse_config(raw)) == config_hash(parse_config({**raw, "selection": {}}))
    assert config_hash(parse_config(raw)) != config_hash(cfg)


# ---- a selection through the lifecycle --------------------------------------------------------

def failing_train(real_train, tried: list):
    """prompt_dpsgd's ``train`` that records each candidate's lr in ``tried`` and fails, as a model
    that does not load would (data-independently), for lr = 0.2."""

    def train(self, mctx, plan, rows, progress=None):
        tried.append(mctx.cfg.methods.prompt_dpsgd.lr)
        if mctx.cfg.methods.prompt_dpsgd.lr == 0.2:
            raise RuntimeError("model failed to load")
        return real_train(self, mctx, plan, rows, progress)

    return train


def _pinned_seed(expected_trials: float) -> int:
    """A seed of the selection's own stream under which the real driver tries every candidate
    (lr=0.05, the failing lr=0.2, no prompt): found by running the driver with stand-ins that use
    the generator exactly as the run does (a failed trial draws no noise)."""
    from privacy.rng import seeded_rng
    from tasks import selection as tsel

    cands = [tsel.Candidate(tsel.candidate_name(c), c) for c in CANDIDATES] + [tsel.no_prompt_candidate("no prompt")]
    dist = tsel.psel.TruncatedNegativeBinomial(1.0, tsel.psel.gamma_for_mean(1.0, expected_trials))

    def train(c, rng):
        if c.name == "lr=0.2":
            raise RuntimeError("fails")
        return "trained"

    for seed in range(1000):
        result = tsel.run_selection(cands, train, lambda c, out: (1, 1), dist, 5.0, seeded_rng(seed),
                                    lambda c: tsel.ev.GaussianEvent(1.0))
        if {t.candidate for t in result.trials} == {c.name for c in cands}:
            return seed
    raise AssertionError("no seed tries every candidate")


@pytest.fixture(scope="module")
def selected(tmp_path_factory, sst2_dir):
    """One selection run of prompt_dpsgd on tiny-bert through ``run_method``: lr=0.2's training
    raises (a data-independent failure: its model 'does not load'), "no prompt" scores 0 and a
    trained prompt every holdout row (the exact counts the model gets are recorded, to look for
    them in MLflow)."""
    from privacy.rng import seeded_rng
    from tasks import randomness
    from tasks.lifecycle import run_method
    from tasks.methodkit import holdout
    from tasks.methodkit.classifiers import label_indices
    from tasks.pipeline import plan_run

    mp = pytest.MonkeyPatch()
    method_cls = type(get_method("prompt_dpsgd").mechanism)
    real_predict = holdout.holdout_predictions
    exact, tried = [], []
    train = failing_train(method_cls.train, tried)

    def holdout_predictions(self, mctx, prompt, rows):
        y = label_indices(rows.labels, mctx.cfg.data.labels).cpu().numpy()
        exact.append((int((real_predict(self, mctx, prompt, rows) == y).sum()), len(rows)))
        return 1 - y if prompt is None else y  # no prompt wrong on every row, a trained prompt right on every row

    seed = _pinned_seed(SELECTION["expected_trials"])
    real_numpy = randomness.DpRandomness.numpy
    mp.setattr(method_cls, "train", train)
    mp.setattr(holdout, "holdout_predictions", holdout_predictions)
    mp.setattr(randomness.DpRandomness, "numpy",
               lambda self, stream=0: seeded_rng(seed) if stream == 30 else real_numpy(self, stream))
    try:
        root = tmp_path_factory.mktemp("selection")
        ctx = _context(root, sst2_dir, selection=SELECTION)
        plan_run(ctx, ctx.parent)  # the parent's params, as the flow logs them before any work
        out = run_method(ctx, "prompt_dpsgd", {})
    finally:
        mp.undo()
    return {"ctx": ctx, "out": out, "exact": exact, "tried": tried, "root": root}


@pytest.mark.slow  # suite time: the random-stopping run (opt-in); every_candidate's runs by default
def test_random_stopping_is_tagged_with_its_timing_channel(selected):
    ctx = selected["ctx"]
    run = _mlflow(ctx.paths.root).get_run(ctx.parent_run_id)
    assert "secret number of trials K" in run.data.tags["selection.timing_channel"]


@pytest.mark.slow  # suite time: the random-stopping run (opt-in); every_candidate's runs by default
def test_one_ledger_entry_whose_epsilon_is_the_selection_mechanisms(selected):
    from dp_accounting import dp_event as dpe
    from dp_accounting.rdp import rdp_privacy_accountant as dpa_rdp

    from privacy import accountant as acct
    from privacy import events as ev
    from privacy import rdp as rdp_lib

    ctx, out = selected["ctx"], selected["out"]
    (entry,) = _dp_entries(ctx)
    assert entry["status"] == "committed" and entry["run_id"] == "flow-run-1:prompt_dpsgd"
    assert entry["epsilon"] == pytest.approx(out.spend["epsilon"], rel=1e-9)
    assert entry["epsilon"] <= ctx.cfg.privacy.target_epsilon
    assert entry["epsilon"] == pytest.approx(entry["epsilon_reserved"], rel=1e-9)  # committed = the reserved worst case
    assert out.spend["epsilon_pld"] is None  # the selection bound is RDP (no PLD of a best-of-K)

    # the committed event: the sizes' release, then (adaptively) best-of-K of trials ∘ the no-prompt reference
    event = ev.event_from_dict(out.event)
    assert isinstance(event, ev.AdaptiveEvent) and event.first_delta_share == 0.1
    sizes, mechanism = event.first, event.then
    select, reference = mechanism.events
    assert isinstance(select, ev.RepeatAndSelectEvent) and isinstance(reference, ev.GaussianEvent)
    assert len(select.trials) == len(CANDIDATES) + 1  # each candidate's trial, and no prompt's score alone
    assert acct.spend(event, out.spend["delta"]).epsilon == pytest.approx(entry["epsilon"], rel=1e-9)

    # independently: every RDP curve by dp-accounting's own accountant and its repeat-and-select, on
    # the integer orders of the project's grid (at fractional orders dp-accounting bounds the subsampled
    # Gaussian more loosely, or not at all below 1.9)
    orders = np.array([o for o in rdp_lib.DEFAULT_ORDERS if float(o).is_integer()])

    def curve(e) -> np.ndarray:
        if isinstance(e, ev.GaussianEvent):
            d = dpe.GaussianDpEvent(e.noise_multiplier)
        else:  # DP-SGD: steps × Poisson-subsampled Gaussian
            d = dpe.SelfComposedDpEvent(dpe.PoissonSampledDpEvent(e.event.sampling_probability,
                                                                 dpe.GaussianDpEvent(e.event.event.noise_multiplier)),
                                        e.count)
        accountant = dpa_rdp.RdpAccountant(list(orders))
        accountant.compose(d)
        return np.asarray(accountant._rdp)

    trial_curves = [np.max([curve(p) for p in t.events], axis=0) if isinstance(t, ev.ParallelEvent) else curve(t)
                    for t in select.trials]
    for t, c in zip(select.trials, trial_curves):  # each trial (training ∥ score): the same RDP curve
        np.testing.assert_allclose(rdp_lib.rdp_of_event(t, tuple(orders))[0], c, rtol=1e-9)
    trial = np.max(trial_curves, axis=0)
    mean = selected["ctx"].cfg.selection.expected_trials
    chosen = dpa_rdp._compute_rdp_repeat_and_select(orders, trial, mean, select.eta)
    # basic composition of the sizes' release (dp-accounting's PLD, as ours takes the smaller bound) at δ/10
    # and the selection with its reference (RDP) at 9δ/10
    from tests.independent import pld_epsilon

    delta = out.spend["delta"]
    independent = (pld_epsilon(sizes, delta / 10)
                   + dpa_rdp.compute_epsilon(orders, chosen + curve(reference), 0.9 * delta)[0])
    # the project's accountant optimises Theorem 2's λ̂ and the conversion over its whole grid (fractional
    # orders too), so it can only be lower than dp-accounting on the integer orders, and only a little
    assert independent * (1 - 1e-2) <= entry["epsilon"] <= independent * (1 + 1e-9)


@pytest.mark.slow  # suite time: the random-stopping run (opt-in); every_candidate's runs by default
def test_the_winner_is_published_once_and_the_failed_candidate_skipped_and_said_so(selected):
    ctx, out = selected["ctx"], selected["out"]
    assert set(selected["tried"]) == {0.05, 0.2}  # both were tried (the pinned stream)
    assert out.params["selection.winner"] == "lr=0.05"  # lr=0.2 failed; a trained prompt beats no prompt here
    files, artifacts = _published_prompts(ctx)
    assert files == ["prompt_dpsgd.safetensors"] and artifacts == ["prompt/prompt_dpsgd.safetensors"]
    log = (ctx.private_run_dir / "selection.log").read_text()
    assert "candidate lr=0.2 FAILED and was skipped: RuntimeError: model failed to load" in log
    assert "best trial: lr=0.05; published: lr=0.05" in log
    assert str(ctx.private_run_dir).startswith(str(ctx.paths.private))  # the per-trial lines stay private
    parent = _mlflow(ctx.paths.root).get_run(ctx.parent_run_id)
    assert parent.data.params["selection.winner"] == "lr=0.05"
    m = out.train_metrics
    assert 0.0 <= m["selection.winner.holdout_score"] <= 1.0 and m["selection.winner_is_no_prompt"] == 0.0
    assert m["selection.winner.holdout_score"] > m["selection.no_prompt.holdout_score"]  # 24 vs 0 of 24, σ = 5
    assert "selection.fallback_to_no_prompt" not in m and "selection.best_trial" not in out.params


def _run_text(client, run_id: str) -> list[str]:
    """Every param value, metric value and text artifact of a run, as strings."""
    import tempfile

    run = client.get_run(run_id)
    out = [str(v) for v in run.data.params.values()] + [repr(v) for v in run.data.metrics.values()]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(client.download_artifacts(run_id, "", tmp))
        for f in root.rglob("*"):
            if f.is_file() and f.suffix in (".json", ".md", ".txt", ".yaml", ".yml", ".csv"):
                out.append(f.read_text(errors="replace"))
    return out


@pytest.mark.slow  # suite time: the random-stopping run (opt-in); every_candidate's runs by default
def test_no_exact_holdout_number_reaches_mlflow(selected):
    ctx = selected["ctx"]
    client = _mlflow(ctx.paths.root)
    parent = client.get_run(ctx.parent_run_id)
    runs = [parent.info.run_id] + [r.info.run_id for r in client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{ctx.parent_run_id}'")]
    texts = [t for r in runs for t in _run_text(client, r)]
    metrics = [v for r in runs for v in client.get_run(r).data.metrics.values()]
    exact = selected["exact"]
    assert len(exact) >= 3  # the trials scored (lr=0.05, no prompt) and the reference
    for correct, n in exact:
        for value in {correct / n, (n - correct) / n}:
            if value in (0.0, 1.0):
                continue  # 0 and 1 are logged for other reasons (winner_is_no_prompt)
            assert value not in metrics
            assert not any(repr(value) in t for t in texts), value
    # the released numbers are noisy: never one of the exact ratios
    m = selected["out"].train_metrics
    for key in ("selection.winner.holdout_score", "selection.no_prompt.holdout_score"):
        assert m[key] not in {c / n for c, n in exact}
    assert not any("noisy holdout correct" in t or "trial 1" in t for t in texts)  # the per-trial list stays private


@pytest.mark.slow  # suite time: the random-stopping run (opt-in); every_candidate's runs by default
def test_plan_shows_the_selections_epsilon_beside_one_trials(selected):
    from tasks.planning import format_plan, plan_runs

    ctx = selected["ctx"]
    plan = plan_runs([("", ctx.cfg)], ctx.paths)
    (row,) = [r for r in plan["runs"] if r["method"] == "prompt_dpsgd"]
    s = row["selection"]
    assert s["selection_epsilon"] == pytest.approx(row["epsilon"], rel=1e-9)
    assert s["selection_epsilon"] == pytest.approx(selected["out"].spend["epsilon"], rel=1e-6)  # what the run spent
    assert s["trial_epsilon"] < s["selection_epsilon"] <= ctx.cfg.privacy.target_epsilon
    assert s["naive_trials"] == 3 and s["candidates"] == len(CANDIDATES) + 1
    text = format_plan(plan)
    assert f"ε = {s['selection_epsilon']:.4f} for the whole selection" in text
    assert f"a single trial alone ε = {s['trial_epsilon']:.4f}" in text
    assert f"selection among {len(CANDIDATES) + 1} choices: {len(CANDIDATES)} candidate settings + no prompt" in text
    assert (f"3 trials (draws among the {len(CANDIDATES) + 1} choices) composed naively ε = {s['naive_epsilon']:.4f}"
            in text)
    assert f"every candidate once, composed, ε = {s['naive_candidates_epsilon']:.4f}" in text
    assert s["naive_candidates_epsilon"] > s["trial_epsilon"]


@pytest.mark.slow  # suite time: the random-stopping run (opt-in); every_candidate's runs by default
def test_report_shows_the_winners_released_score_only(selected):
    from tasks.comparison import parent_runs, selection_table

    from tasks.pipeline import RunReport

    ctx = selected["ctx"]
    client = _mlflow(ctx.paths.root)
    assert client.get_run(ctx.parent_run_id).data.params["selection.enabled"] == "True"
    rec = RunReport(ctx.cfg, get_method("prompt_dpsgd"), ctx.parent)
    rec.trained(selected["out"])  # the parent's metrics, as the flow logs them
    ctx.parent.log_metrics(rec.metrics)
    client.set_tag(ctx.parent_run_id, "method", "prompt_dpsgd")
    client.set_terminated(ctx.parent_run_id)  # a finished parent run, as the flow leaves it
    rows = [r for r in parent_runs(client, ctx.cfg.experiment) if r["run_id"] == ctx.parent_run_id]
    (row,) = rows
    assert row["method"].endswith("+ selection")
    table = selection_table(rows)
    released = selected["out"].train_metrics["selection.winner.holdout_score"]
    assert f"| lr=0.05 | {released:.4f} |" in table
    assert f"{selected['out'].train_metrics['selection.no_prompt.holdout_score']:.4f}" not in table
    assert selection_table([{**row, "selection": None}]) is None


def test_the_summary_warns_when_the_published_prompt_scores_below_no_prompt():
    from tasks.selection import below_no_prompt

    worse = {"selection.winner.holdout_score": 0.61, "selection.no_prompt.holdout_score": 0.70,
             "selection.winner_is_no_prompt": 0.0}
    assert "below the released no-prompt reference 0.7000" in below_no_prompt(worse)
    assert below_no_prompt({**worse, "selection.winner.holdout_score": 0.75}) is None
    assert below_no_prompt({**worse, "selection.winner_is_no_prompt": 1.0}) is None  # no prompt is what is published
    assert below_no_prompt({}) is None


@pytest.mark.slow  # suite time: the random-stopping run (opt-in); every_candidate's runs by default
def test_the_run_report_carries_the_warning(selected):
    from dataclasses import replace

    from tasks.pipeline import RunReport

    ctx, out = selected["ctx"], selected["out"]
    rec = RunReport(ctx.cfg, get_method("prompt_dpsgd"), ctx.parent)
    # the winner's released score is above no prompt's here; lr=0.2 failed: under random stopping
    # not even counted in public (the count grows with the secret K): only in the private log
    assert rec.warnings(out) == []
    assert "selection.failed_candidates" not in out.train_metrics
    worse = replace(out, train_metrics={**out.train_metrics, "selection.no_prompt.holdout_score": 1.5})
    warnings = rec.warnings(worse)
    assert sum("below the released no-prompt reference" in w for w in warnings) == 1, warnings
    off = RunReport(ctx.cfg.model_copy(update={"selection": ctx.cfg.selection.model_copy(update={"enabled": False})}),
                    get_method("prompt_dpsgd"), ctx.parent)
    assert off.warnings(worse) == []


def test_no_prompt_is_published_when_the_best_trial_scores_below_it_released():
    from tasks import selection as tsel

    cands = [tsel.Candidate("lr=0.05", {"lr": 0.05}), tsel.Candidate("lr=0.2", {"lr": 0.2}),
             tsel.no_prompt_candidate("no prompt")]
    best = tsel.SelectionResult(cands[1], "trained prompt", 80.0, [], None, (80.0, 20.0))  # released 80 right, 20 wrong
    index, m = tsel.published_choice(cands, best, (90.0, 10.0), fallback=True)  # no prompt: 0.9 > 0.8
    assert index == 2 and m["selection.winner_is_no_prompt"] == 1.0 and m["selection.fallback_to_no_prompt"] == 1.0
    assert m["selection.winner.holdout_score"] == pytest.approx(0.9)  # the published one's: no prompt's
    assert m["selection.best_trial.holdout_score"] == pytest.approx(0.8) and m["selection.best_trial_index"] == 1.0
    assert tsel.below_no_prompt(m) is None  # what is published is not below no prompt
    assert "best trial (lr=0.2) released a holdout score of 0.8000, below no prompt's 0.9000" in \
        tsel.fallback_note(m, "lr=0.2")
    kept, m2 = tsel.published_choice(cands, best, (90.0, 10.0), fallback=False)  # published, and warned about
    assert kept == 1 and "selection.fallback_to_no_prompt" not in m2 and m2["selection.winner_is_no_prompt"] == 0.0
    assert "below the released no-prompt reference 0.9000" in tsel.below_no_prompt(m2)
    assert tsel.fallback_note(m2, None) is None
    above, m3 = tsel.published_choice(cands, best, (70.0, 30.0), fallback=True)
    assert above == 1 and m3["selection.winner.holdout_score"] == pytest.approx(0.8)
    none, m4 = tsel.published_choice(cands, tsel.SelectionResult(None, None, None, [], None), (70.0, 30.0), True)
    assert none == -1 and "selection.winner.holdout_score" not in m4 and m4["selection.winner_is_no_prompt"] == 0.0
    itself = tsel.SelectionResult(cands[2], None, 60.0, [], None, (60.0, 40.0))  # no prompt won its trial: kept
    assert tsel.published_choice(cands, itself, (90.0, 10.0), fallback=True)[0] == 2


def test_released_holdout_counts_are_the_gaussian_mechanism_on_the_pair():
    """(correct, wrong) each plus independent N(0, σ²): one record moves one coordinate by one, so
    the pair's L2 sensitivity is 1 and its event is GaussianEvent(σ), as for one count."""
    from scipy import stats

    from privacy import rdp as rdp_lib
    from privacy import selection as psel
    from privacy.rng import seeded_rng

    rng = seeded_rng(30)
    draws = np.array([psel.release_holdout_count_vector([180, 40], 5.0, rng) for _ in range(4000)])
    assert stats.kstest((draws[:, 0] - 180) / 5.0, "norm").pvalue > 1e-3
    assert stats.kstest((draws[:, 1] - 40) / 5.0, "norm").pvalue > 1e-3
    assert abs(np.corrcoef(draws[:, 0], draws[:, 1])[0, 1]) < 0.05
    # neighbouring holdouts: the record added is right (180 → 181, 40) or wrong (180, 40 → 41): both at L2
    # distance 1, the Rényi divergence of the Gaussian at sensitivity 1, the event's curve
    orders = np.array([2.0, 8.0, 32.0])
    for a, b in (((180, 40), (181, 40)), ((180, 40), (180, 41))):
        d2 = float(np.sum((np.array(a) - np.array(b)) ** 2))
        np.testing.assert_allclose(orders * d2 / (2 * 5.0 ** 2),
                                   rdp_lib.rdp_of_event(psel.holdout_score_event(5.0), tuple(orders))[0])
    from tasks.selection import released_accuracy

    assert released_accuracy(90.0, 10.0) == pytest.approx(0.9)
    assert released_accuracy(-3.0, 1.0) == 0.0 and released_accuracy(5.0, -1.0) == 1.0
