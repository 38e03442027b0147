"""Private selection by trying every candidate once (issue 30, ``selection.mode: every_candidate``,
the default) and ranking by the released balanced accuracy (``selection.metric``, the default).

* the mechanism: the trained candidates' trainings composed, in parallel with one noisy count
  vector per candidate (``privacy.selection.every_candidate_event``) — its ε checked against
  dp-accounting's own PLD accountant on each part;
* the released per-class counts: one holdout record moves exactly one cell by one (L2
  sensitivity 1, so one Gaussian event), checked on neighbouring holdouts; the noise is N(0, σ²);
* the driver: each candidate trained once and scored once, the best released score wins, a failed
  candidate is skipped; on a skewed holdout, accuracy picks the prompt that always says the
  majority class and balanced accuracy does not (the issue's case);
* the lifecycle on a tiny model: one ledger entry whose ε is the mechanism's, every candidate's
  released score in the run record, no exact holdout number in MLflow.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from privacy import accountant as acct
from privacy import events as ev
from privacy import selection as psel
from privacy.rng import seeded_rng
from tasks import selection as tsel
from tasks.methods import get_method

DELTA = 1e-5


# ---- the mechanism's accounting ----------------------------------------------------------------

@pytest.mark.parametrize("n_trained,q,sigma,steps,score_sigma", [
    pytest.param(6, 0.04, 0.9, 48, 5.0, marks=pytest.mark.slow),  # suite time: two cases by default
    (2, 0.1, 1.2, 20, 2.0), (4, 0.02, 0.7, 100, 8.0)])
def test_every_candidate_event_matches_dp_accountings_pld_on_each_part(n_trained, q, sigma, steps, score_sigma):
    from dp_accounting import dp_event as dpe
    from dp_accounting.pld import pld_privacy_accountant as dpa_pld

    trainings = [ev.dpsgd_event(q, sigma * (1 + 0.05 * i), steps) for i in range(n_trained)]
    event = psel.every_candidate_event(trainings, n_trained + 1, score_sigma)
    assert isinstance(event, ev.ParallelEvent)

    def independent(dp_event) -> float:
        a = dpa_pld.PLDAccountant(value_discretization_interval=1e-3)
        a.compose(dp_event)
        return a.get_epsilon(DELTA)

    train_eps = independent(dpe.ComposedDpEvent([
        dpe.SelfComposedDpEvent(dpe.PoissonSampledDpEvent(q, dpe.GaussianDpEvent(sigma * (1 + 0.05 * i))), steps)
        for i in range(n_trained)]))
    score_eps = independent(dpe.SelfComposedDpEvent(dpe.GaussianDpEvent(score_sigma), n_trained + 1))
    ours = acct.spend(event, DELTA)
    # the larger part decides (a record is in the train split or the holdout, never both)
    assert ours.epsilon == pytest.approx(max(train_eps, score_eps), rel=1e-2)
    # and it is far below composing the scores with the trainings
    both = independent(dpe.ComposedDpEvent([
        dpe.SelfComposedDpEvent(dpe.PoissonSampledDpEvent(q, dpe.GaussianDpEvent(sigma * (1 + 0.05 * i))), steps)
        for i in range(n_trained)] + [dpe.SelfComposedDpEvent(dpe.GaussianDpEvent(score_sigma), n_trained + 1)]))
    assert ours.epsilon < both
    # a composition of one entry (how the ledger composes a dataset's entries) is the entry itself
    assert acct.spend(ev.ComposedEvent((event,)), DELTA).epsilon == pytest.approx(ours.epsilon, rel=1e-12)


def test_every_candidate_event_of_no_trained_candidate_is_the_scores_alone():
    event = psel.every_candidate_event([], 1, 5.0)
    assert acct.spend(event, DELTA).epsilon == pytest.approx(acct.spend(ev.GaussianEvent(5.0), DELTA).epsilon)
    with pytest.raises(ValueError, match="n_scores"):
        psel.every_candidate_event([], 0, 5.0)


# ---- the released counts -----------------------------------------------------------------------

def test_per_class_counts_move_one_cell_by_one_between_neighbouring_holdouts():
    rng = np.random.default_rng(0)
    n_classes = 4
    for _ in range(200):
        n = int(rng.integers(1, 60))
        labels, predicted = rng.integers(n_classes, size=n), rng.integers(n_classes, size=n)
        base = tsel.per_class_counts(predicted[1:], labels[1:], n_classes)  # without record 0
        full = tsel.per_class_counts(predicted, labels, n_classes)          # with it
        diff = full - base
        assert np.abs(diff).sum() == 1 and np.linalg.norm(diff) == 1.0  # one cell, by one: L2 sensitivity 1
        cell = 2 * labels[0] + (0 if predicted[0] == labels[0] else 1)
        assert diff[cell] == 1
        assert full.sum() == n and full.reshape(-1, 2).sum(axis=1).tolist() == np.bincount(labels, minlength=4).tolist()


def test_released_count_vector_is_the_gaussian_mechanism():
    rng = seeded_rng(30)
    counts = np.array([40, 20, 180, 60])
    draws = np.array([psel.release_holdout_count_vector(counts, 5.0, rng) for _ in range(3000)])
    for j in range(4):
        assert stats.kstest((draws[:, j] - counts[j]) / 5.0, "norm").pvalue > 1e-3
    assert abs(np.corrcoef(draws[:, 0], draws[:, 1])[0, 1]) < 0.06  # independent coordinates
    with pytest.raises(ValueError, match="count"):
        psel.release_holdout_count_vector([3, -1], 5.0, rng)
    with pytest.raises(TypeError, match="secret DP stream"):
        psel.release_holdout_count_vector([3, 1], 5.0, np.random.RandomState(0))


def test_released_scores_of_noisy_counts():
    # class 0: 40 right of 60; class 1: 180 right of 240
    counts = [40.0, 20.0, 180.0, 60.0]
    assert tsel.released_score(counts, "accuracy") == pytest.approx(220 / 300)
    assert tsel.released_score(counts, "balanced_accuracy") == pytest.approx((40 / 60 + 180 / 240) / 2)
    assert tsel.released_score([50.0, -3.0], "accuracy") == 1.0  # clipped to [0, 1]
    assert tsel.released_score([-2.0, -1.0, 10.0, 0.0], "balanced_accuracy") == pytest.approx(0.5)  # no total: 0
    with pytest.raises(ValueError, match="unknown selection metric"):
        tsel.released_score(counts, "f1")


# ---- the driver ----------------------------------------------------------------------------------

SKEWED_LABELS = np.array([1] * 240 + [0] * 60)  # a holdout at 80% positive


def _predictions(name: str) -> np.ndarray:
    """Toy predictions on the skewed holdout: "always positive" (accuracy 0.8, balanced 0.5), no
    prompt (0.7 on each class: accuracy 0.7, balanced 0.7), "lr=0.05" (0.6 on each class)."""
    if name == "always positive":
        return np.ones_like(SKEWED_LABELS)
    right = {"no prompt": 0.7, "lr=0.05": 0.6}[name]
    pred = SKEWED_LABELS.copy()
    for c in (0, 1):
        idx = np.flatnonzero(SKEWED_LABELS == c)
        pred[idx[int(right * len(idx)):]] = 1 - c
    return pred


def _driver(metric: str, seed: int, fail: str | None = None):
    cands = [tsel.Candidate("always positive", {"lr": 1.0}), tsel.Candidate("lr=0.05", {"lr": 0.05}),
             tsel.no_prompt_candidate()]
    trained = []

    def train(c, rng):
        if c.name == fail:
            raise RuntimeError("model failed to load")
        trained.append(c.name)
        return c.name

    def score(c, out):
        counts = tsel.per_class_counts(_predictions(c.name), SKEWED_LABELS, 2)
        if metric == "accuracy":
            counts = counts.reshape(-1, 2).sum(axis=0)
        return counts

    result = tsel.run_every_candidate(cands, train, score, 2.0, seeded_rng(seed),
                                      lambda c: ev.dpsgd_event(0.04, 1.0, 10),
                                      key=lambda noisy: tsel.released_score(noisy, metric))
    return cands, result, trained


def test_every_candidate_is_trained_once_scored_once_and_the_best_released_score_wins():
    cands, result, trained = _driver("balanced_accuracy", 1)
    assert trained == ["always positive", "lr=0.05"]  # each trained candidate once, in order; no prompt never
    assert [t.candidate for t in result.trials] == [c.name for c in cands]  # each scored once
    assert result.winner_noisy_score == max(t.noisy_score for t in result.trials)
    assert result.winner.name == "no prompt" and result.winner_output is None
    published = result.published()
    assert published["mode"] == "every_candidate" and set(published["noisy_scores"]) == {c.name for c in cands}
    assert isinstance(result.event, ev.ParallelEvent)
    index, metrics = tsel.published_choice(cands, result, result.trials[2].noisy_counts, False, "balanced_accuracy")
    assert index == 2 and metrics["selection.winner_is_no_prompt"] == 1.0
    assert {f"selection.candidate_{i}.holdout_score" for i in range(3)} <= set(metrics)
    assert metrics["selection.winner.holdout_score"] == metrics["selection.candidate_2.holdout_score"]


def test_on_a_skewed_holdout_accuracy_picks_the_majority_prompt_and_balanced_accuracy_does_not():
    picked = {m: [_driver(m, seed)[1].winner.name for seed in range(20)] for m in ("accuracy", "balanced_accuracy")}
    assert picked["accuracy"].count("always positive") >= 18  # 0.8 vs 0.7 on the skewed holdout
    assert picked["balanced_accuracy"].count("no prompt") >= 18  # 0.7 vs 0.5 and 0.6, whatever the class mix


def test_a_failed_candidate_is_skipped_and_its_training_still_counted():
    cands, result, trained = _driver("balanced_accuracy", 2, fail="lr=0.05")
    (failed,) = result.failed
    assert failed.candidate == "lr=0.05" and "model failed to load" in failed.error and failed.noisy_score is None
    assert result.winner.name != "lr=0.05"
    assert len(result.event.events[0].events) == 2  # both trainings are in the event, the failed one too


# ---- through the lifecycle, on a tiny model ------------------------------------------------------

@pytest.fixture(scope="module")
def every(tmp_path_factory, sst2_dir):
    """A selection run with the defaults (every candidate once, balanced accuracy) of prompt_dpsgd
    on tiny-bert through ``run_method``; lr=0.2's training raises (data-independently). The exact
    per-class holdout counts each candidate gets are kept, to look for them in MLflow."""
    from tasks.lifecycle import run_method
    from tasks.methodkit import holdout
    from tasks.methods import get_method
    from tasks.pipeline import plan_run
    from tests.claims.test_release_once import _context
    from tests.pipeline.test_selection_lifecycle import failing_train

    mp = pytest.MonkeyPatch()
    method_cls = type(get_method("prompt_dpsgd").mechanism)
    real_predict = holdout.holdout_predictions
    exact, tried = [], []
    train = failing_train(method_cls.train, tried)

    def holdout_predictions(self, mctx, prompt, rows):
        pred = real_predict(self, mctx, prompt, rows)
        labels = np.array([mctx.cfg.data.labels.index(y) for y in rows.labels])
        exact.append(tsel.per_class_counts(pred, labels, len(mctx.cfg.data.labels)))
        return pred

    mp.setattr(method_cls, "train", train)
    mp.setattr(holdout, "holdout_predictions", holdout_predictions)
    try:
        root = tmp_path_factory.mktemp("every")
        ctx = _context(root, sst2_dir, selection={"enabled": True, "candidates": [{"lr": 0.05}, {"lr": 0.2}]})
        plan_run(ctx, ctx.parent)
        out = run_method(ctx, "prompt_dpsgd", {})
    finally:
        mp.undo()
    return {"ctx": ctx, "out": out, "exact": exact, "tried": tried}


@pytest.mark.slow  # suite time: the every-candidate selection run through the lifecycle (≈ 33 s);
# its accounting and released counts are checked by the unit tests above by default
def test_lifecycle_one_entry_whose_epsilon_is_the_larger_branch_by_dp_accounting(every):
    from tests.claims.test_release_once import _dp_entries

    ctx, out = every["ctx"], every["out"]
    assert ctx.cfg.selection.mode == "every_candidate" and ctx.cfg.selection.metric == "balanced_accuracy"
    assert every["tried"] == [0.05, 0.2]  # each trained candidate once, in order
    (entry,) = _dp_entries(ctx)
    assert entry["status"] == "committed" and entry["epsilon"] <= ctx.cfg.privacy.target_epsilon
    assert entry["epsilon"] == pytest.approx(out.spend["epsilon"], rel=1e-9)
    event = ev.event_from_dict(out.event)
    # the sizes' release, then (adaptively) both trainings ∥ 3 noisy scores
    assert isinstance(event, ev.AdaptiveEvent) and isinstance(event.then, ev.ParallelEvent)
    sizes, branches = event.first, event.then.events
    assert len(branches) == 2
    trains, scores = branches
    assert isinstance(trains, ev.ComposedEvent) and len(trains.events) == 2  # the failed candidate's too
    assert ctx.cfg.selection.score_noise_multiplier is None  # the default: chosen from the trainings' ε
    sigma = float(out.params["selection.score_noise_multiplier"])
    assert scores == ev.SelfComposedEvent(ev.GaussianEvent(sigma), 3)
    # the scores' branch costs no more than the trainings' (more noise would buy no privacy)
    from privacy import accountant as acct
    assert acct.spend(scores, out.spend["delta"]).epsilon <= acct.spend(trains, out.spend["delta"]).epsilon

    from tests.independent import pld_epsilon

    delta = out.spend["delta"]  # the release at δ/10 beside the larger branch at 9δ/10 (basic composition)
    independent = pld_epsilon(sizes, delta / 10) + max(pld_epsilon(b, 0.9 * delta) for b in branches)
    assert entry["epsilon"] == pytest.approx(independent, rel=5e-3)


@pytest.mark.slow  # suite time: the every-candidate selection run through the lifecycle (≈ 33 s);
# its accounting and released counts are checked by the unit tests above by default
def test_lifecycle_publishes_every_candidates_released_score_and_no_exact_count(every):
    from tests.pipeline.test_flow import _mlflow
    from tests.pipeline.test_selection_lifecycle import _run_text

    ctx, out = every["ctx"], every["out"]
    m = out.train_metrics
    names = [c.name for c in tsel.candidates_of(ctx.cfg, get_method(ctx.cfg.method))]
    assert names == ["lr=0.05", "lr=0.2", "no prompt"]
    # lr=0.2 failed: which candidates failed must not show (a failure is covered by the ε only when it does
    # not depend on the data), so no candidate's own score is published, only the winner's
    assert not any(k.startswith("selection.candidate_") for k in m)
    winner = out.params["selection.winner"]
    assert winner in ("lr=0.05", "no prompt") and 0.0 <= m["selection.winner.holdout_score"] <= 1.0
    log = (ctx.private_run_dir / "selection.log").read_text()  # which one failed, and why: private
    assert "candidate lr=0.2 FAILED and was skipped: RuntimeError: model failed to load" in log
    assert out.params["selection.candidate_1"] == "lr=0.2" and out.params["selection.mode"] == "every_candidate"
    client = _mlflow(ctx.paths.root)
    parent = client.get_run(ctx.parent_run_id)
    runs = [parent.info.run_id] + [r.info.run_id for r in client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{ctx.parent_run_id}'")]
    texts = [t for r in runs for t in _run_text(client, r)]
    metrics = [v for r in runs for v in client.get_run(r).data.metrics.values()]
    assert len(every["exact"]) == 2  # lr=0.05 and no prompt were scored
    for counts in every["exact"]:
        exact_scores = {tsel.released_score(counts, "balanced_accuracy"), tsel.released_score(counts, "accuracy")}
        for value in exact_scores - {0.0, 0.5, 1.0}:
            assert value not in metrics and not any(repr(value) in t for t in texts), value
    exact_balanced = {tsel.released_score(c, "balanced_accuracy") for c in every["exact"]} - {0.0, 0.5, 1.0}
    assert m["selection.winner.holdout_score"] not in exact_balanced  # (0, ½, 1 also come from clipping)


def test_report_table_shows_every_candidates_released_score():
    from tasks.comparison import selection_table

    row = {"run_id": "abcdef0123", "method": "prompt_dpsgd + selection", "dataset": "trec_skewed", "seed": "0",
           "accuracy": 0.506, "epsilon": 7.8014,
           "selection": {"winner": "no prompt", "mode": "every_candidate", "metric": "balanced_accuracy",
                         "released_holdout_score": 0.5697,
                         "candidates": {"lr=0.05": 0.4826, "no prompt": 0.5697}}}
    table = selection_table([row])
    assert "| trec_skewed | prompt_dpsgd + selection | no prompt | 0.5697 | balanced_accuracy | 0.5060 |" in table
    assert "| trec_skewed | 0 | abcdef01 | lr=0.05 | 0.4826 |  |" in table
    assert "| trec_skewed | 0 | abcdef01 | no prompt | 0.5697 | yes |" in table
    random_stopping = {**row, "selection": {**row["selection"], "mode": "random_stopping", "candidates": {}}}
    assert "Every candidate's released holdout score" not in selection_table([random_stopping])
