"""The method-agnostic selection driver (tasks/selection.py) on a toy train / score function."""

import numpy as np
import pytest
from scipy import stats

from privacy import accountant as acct
from privacy import events as ev
from privacy import selection as psel
from privacy.rng import seeded_rng
from tasks import selection as tsel

HOLDOUT = 1000
ACCURACY = {"lr=1e-3": 0.62, "lr=3e-3": 0.81, "lr=1e-2": 0.70}  # the toy "true" holdout accuracies
ZERO_SHOT_ACCURACY = 0.55
DELTA = 1e-5


def _candidates():
    return [tsel.Candidate(name, {"lr": float(name.split("=")[1])}) for name in ACCURACY] + [tsel.no_prompt_candidate()]


def _train(candidate, rng):
    assert not candidate.zero_shot, "the zero-shot candidate must never be trained"
    return f"prompt trained with {candidate.config}"


def _score(candidate, output):
    if candidate.zero_shot:
        assert output is None
        return int(ZERO_SHOT_ACCURACY * HOLDOUT)
    assert output == f"prompt trained with {candidate.config}"
    return int(ACCURACY[candidate.name] * HOLDOUT)


def _train_event(candidate):
    return ev.dpsgd_event(0.01, 1.0, 200)


def _run(rng, distribution=psel.TruncatedNegativeBinomial(1.0, 0.1), sigma=5.0, train=_train, score=_score):
    return tsel.run_selection(_candidates(), train, score, distribution, sigma, rng, _train_event)


def test_winner_is_the_best_noisy_trial_and_only_noisy_numbers_leave():
    result = _run(seeded_rng(3))
    ok = [t for t in result.trials if t.error is None]
    assert result.trials and len(ok) == len(result.trials)
    assert result.winner_noisy_score == max(t.noisy_score for t in ok)
    assert result.winner.name == next(t.candidate for t in ok if t.noisy_score == result.winner_noisy_score)
    exact = {int(a * HOLDOUT) for a in ACCURACY.values()} | {int(ZERO_SHOT_ACCURACY * HOLDOUT)}
    assert all(t.noisy_score not in exact for t in ok)  # Gaussian noise: never an exact count
    published = result.published()
    assert set(published) == {"winner", "winner_zero_shot", "winner_noisy_holdout_correct",
                              "distribution", "eta", "gamma", "mu"}
    assert published["winner"] == result.winner.name
    assert published["winner_noisy_holdout_correct"] == result.winner_noisy_score
    if not result.winner.zero_shot:
        assert result.winner_output == f"prompt trained with {result.winner.config}"


def test_small_noise_finds_the_best_candidate_when_it_was_tried():
    wins = 0
    for seed in range(40):
        result = _run(seeded_rng(seed), sigma=2.0)
        tried = {t.candidate for t in result.trials}
        if "lr=3e-3" in tried:
            assert result.winner.name == "lr=3e-3"  # 810 vs ≤ 700 correct, noise σ = 2
            wins += 1
    assert wins >= 30  # E[K] = 10 trials over 4 candidates: the best is almost always tried


def test_trial_count_and_candidate_choice_follow_their_distributions():
    dist = psel.PoissonTrials(4.0)
    rng = seeded_rng(2026)
    ks, picks = [], []
    for _ in range(1500):
        result = _run(rng, distribution=dist)
        ks.append(len(result.trials))
        picks.extend(t.candidate for t in result.trials)
    ks = np.array(ks)
    assert ks.mean() == pytest.approx(4.0, rel=0.05)
    assert np.mean(ks == 0) == pytest.approx(np.exp(-4.0), abs=0.01)
    names = [c.name for c in _candidates()]
    counts = [picks.count(n) for n in names]
    assert stats.chisquare(counts).pvalue > 1e-3  # uniform over the candidates


def test_no_trial_means_no_winner():
    dist = psel.PoissonTrials(1.0)
    seed = next(s for s in range(100) if dist.sample(seeded_rng(s)) == 0)  # the driver draws K first
    result = _run(seeded_rng(seed), distribution=dist)
    assert result.trials == [] and result.winner is None and result.winner_noisy_score is None
    assert result.published()["winner"] is None


def test_failed_candidate_is_skipped_and_said_so():
    def train(candidate, rng):
        if candidate.name == "lr=3e-3":
            raise RuntimeError("model failed to load")
        return _train(candidate, rng)

    result = _run(seeded_rng(5), sigma=2.0, train=train)
    failed = result.failed
    assert failed and all(t.candidate == "lr=3e-3" and t.noisy_score is None for t in failed)
    assert all("RuntimeError: model failed to load" in t.error for t in failed)
    assert result.winner is not None and result.winner.name != "lr=3e-3"
    assert "lr=1e-2" in {t.candidate for t in result.trials}  # at this seed
    assert result.winner.name == "lr=1e-2"  # the best of the rest (700 vs 620, 550 correct; σ = 2)

    def always_fails(candidate, output):
        raise OSError("disk full")

    nothing = _run(seeded_rng(5), score=always_fails)
    assert nothing.winner is None and nothing.trials and all(t.error for t in nothing.trials)


def test_same_generator_seed_same_selection():
    a, b, c = _run(seeded_rng(9)), _run(seeded_rng(9)), _run(seeded_rng(10))
    assert a.trials == b.trials and a.winner == b.winner
    assert a.trials != c.trials


def test_the_event_accounts_every_candidate_and_the_score():
    dist = psel.TruncatedNegativeBinomial(1.0, 0.1)
    result = _run(seeded_rng(1), distribution=dist)
    trials = [psel.trial_event(_train_event(c), 5.0) for c in _candidates() if not c.zero_shot]
    expected = psel.selection_event(trials + [psel.trial_event(None, 5.0)], dist)
    assert result.event == expected
    spent = acct.spend(result.event, DELTA)
    assert spent.epsilon_pld is None and spent.epsilon > acct.spend(trials[0], DELTA).epsilon


def test_bad_inputs():
    with pytest.raises(ValueError, match="zero-shot"):
        tsel.run_selection([tsel.Candidate("a")], _train, _score, psel.PoissonTrials(2.0), 1.0, seeded_rng(0),
                           _train_event)
    with pytest.raises(ValueError, match="unique"):
        tsel.selection_event([tsel.Candidate("a"), tsel.Candidate("a"), tsel.no_prompt_candidate()], _train_event,
                             psel.PoissonTrials(2.0), 1.0)
    with pytest.raises(ValueError, match="empty"):
        tsel.selection_event([], _train_event, psel.PoissonTrials(2.0), 1.0)
    with pytest.raises(TypeError, match="rng"):
        tsel.run_selection(_candidates(), _train, _score, psel.PoissonTrials(2.0), 1.0, 0, _train_event)
