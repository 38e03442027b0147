"""Private selection / hyperparameter tuning, accounted as ONE mechanism (Papernot & Steinke 2022).

Random search with a random number of trials: K is drawn from a trial-count distribution (truncated
negative binomial or Poisson) with the secret DP generator, never a configured seed; each trial
trains a candidate chosen independently of the data on the TRAIN split and releases its HOLDOUT
correct count plus N(0, σ_s²); the best noisy score is published (⊥ for K = 0). Per trial,
ε_Q(λ) ≤ max(ε_train(λ), λ/(2σ_s²)) (splits by a keyed hash of each record; with a person unit one
vote per person keeps the counts' sensitivity at 1). :func:`repeat_and_select_rdp` evaluates the
paper's Theorems 2 and 6 on the trial's RDP curve, as dp-accounting's ``RepeatAndSelectDpEvent``
does (``tests/accounting/test_selection_privacy.py`` checks the two against each other and the
bound against exact divergences). RDP only: the PLD accountant refuses ``RepeatAndSelectEvent``.

The neighbouring relations (records, people, a record-level run charged per person), the
theorems as used and how they are evaluated: docs/privacy-claims.md, "Private selection as one
mechanism".
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

from . import accountant, calibrate
from . import events as ev
from . import rdp as rdp_lib
from .mechanisms import gaussian_mechanism
from .rdp import TrialRdp, _orders_array, rdp_of_repeat_and_select, repeat_and_select_rdp  # noqa: F401 - re-exported
from .trials import (PoissonTrials, TrialCount, TruncatedNegativeBinomial, _check_rng,  # noqa: F401 - re-exported
                     _sample_by_inversion, gamma_for_mean, trial_count_distribution)
from .validation import check_count, check_delta, check_epsilon, check_nonnegative, check_positive


# ---- the RDP bound (evaluated in rdp.py: repeat_and_select_rdp) ------------------------------

def selection_epsilon(trial_rdp: TrialRdp, distribution: TrialCount, delta: float,
                      orders=rdp_lib.DEFAULT_ORDERS) -> tuple[float, float]:
    """(ε, best order) of the best-of-K selection at δ (project's RDP→(ε, δ) conversion)."""
    delta = check_delta(delta, "delta")
    orders = _orders_array(orders)
    curve = repeat_and_select_rdp(trial_rdp, distribution, orders=orders,
                                  trial_orders=None if callable(trial_rdp) else orders)
    return rdp_lib.rdp_to_epsilon(orders, curve, delta)


# ---- the DP holdout score and the events of a selection ---------------------------------------

def release_holdout_score(correct_count: int, noise_multiplier: float, rng: np.random.Generator) -> float:
    """One candidate's holdout correct-count plus N(0, σ²) (Gaussian mechanism, L2 sensitivity 1:
    one source record is in the holdout or not, and changes this count by at most one).
    Accounted as ``GaussianEvent(σ)``: RDP λ/(2σ²). Returns the noisy count only."""
    correct_count = check_count(int(correct_count) if isinstance(correct_count, np.integer) else correct_count,
                                "correct_count")
    return gaussian_mechanism(float(correct_count), noise_multiplier, 1.0, _check_rng(rng))


def release_holdout_count_vector(counts, noise_multiplier: float, rng: np.random.Generator) -> np.ndarray:
    """Holdout counts, each plus independent N(0, σ²): e.g. per class c the (correct_c, wrong_c)
    of one candidate. The Gaussian mechanism at L2 sensitivity 1 whenever one privacy unit moves
    the vector by at most 1 in L2 — one record: a holdout record has one label and is either right
    or wrong, so it is counted in exactly one (class, right/wrong) cell; one person: their rows are
    weighted by :func:`one_vote_weights`, so they move the cells by 1 in total (L1 = 1, hence L2
    ≤ 1) — hence the same ``GaussianEvent(σ)`` as :func:`release_holdout_score`. The counts are
    non-negative numbers (whole with a record unit, weighted with a person unit). With (correct,
    wrong) released, the accuracy correct / (correct + wrong) needs no released holdout size.
    Returns the noisy vector only."""
    rng = _check_rng(rng)
    values = np.asarray(counts, dtype=float)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"counts must be a non-empty 1-d vector of counts, got shape {values.shape}")
    if not np.all(np.isfinite(values)) or np.any(values < 0):
        raise ValueError(f"counts must be finite numbers >= 0 (whole, or weighted per person), got {counts!r}")
    sigma = check_positive(noise_multiplier, "noise_multiplier")
    return values + rng.normal(0.0, sigma, size=values.size)


def one_vote_weights(unit_index: Sequence[int]) -> np.ndarray:
    """The weight of each holdout row in the released counts under a person unit: 1/n_u for a row
    of person u, who has n_u rows in the holdout (``unit_index``: each row's person, 0..U−1). A
    person's weights sum to 1 whatever n_u is, and depend on that person's rows alone, so adding
    or removing one person moves any vector of cell sums by L1 = 1, hence L2 ≤ 1 (the module
    docstring: "Neighbouring relation with a person unit")."""
    index = np.asarray(unit_index, dtype=np.int64)
    if index.ndim != 1 or (index.size and index.min() < 0):
        raise ValueError("unit_index must be a 1-d sequence of person indices >= 0")
    if index.size == 0:
        return np.zeros(0, dtype=float)
    rows_per_unit = np.bincount(index)
    return 1.0 / rows_per_unit[index]


def every_candidate_event(train_events: Sequence[ev.DpEvent], n_scores: int,
                          score_noise_multiplier: float) -> ev.DpEvent:
    """Every candidate trained once and scored once, the best noisy score published.

    The procedure: each of the C trained candidates trains with its own DP mechanism on the TRAIN
    split (``train_events``, one per candidate, independent of each other and of the holdout);
    each of the ``n_scores`` candidates (the trained ones and "no prompt") releases its holdout
    count vector with Gaussian noise σ_s (:func:`release_holdout_count_vector`, L2 sensitivity 1);
    the candidate with the best noisy score is published, and every noisy score may be.

    Neighbouring relation: add/remove ONE SOURCE record. The record lies in exactly one split (a
    keyed hash of the record itself), so one neighbour pair changes the train split or the
    holdout, never both:

    * record in the train split: the trainings see different data and compose (C mechanisms on
      the same rows: ``ComposedEvent``); the holdout is unchanged, so every noisy score is a
      randomised function of the trained outputs (post-processing);
    * record in the holdout: the trainings' inputs are identical (same output laws); each of the
      ``n_scores`` released vectors moves by at most one in one coordinate: ``n_scores``
      Gaussian mechanisms at sensitivity 1, composed.

    With a person unit (add/remove one person, whose rows lie in one split: the module
    docstring), the same two cases per person: the trainings are unit-level (their events are per
    person), and each released vector, counting one vote per person (:func:`one_vote_weights`),
    moves by L2 ≤ 1.

    Either way the privacy loss is that of one of the two parts, so the procedure is bounded by
    their maximum (``ParallelEvent``: for RDP, the maximum at each order; for a PLD, the larger ε
    at δ, each part a valid bound for the pairs it covers). The choice and every released score
    are post-processing of these outputs. Nothing depends on a number of trials: there is none to
    hide."""
    check_count(n_scores, "n_scores", minimum=1)
    score = ev.SelfComposedEvent(holdout_score_event(score_noise_multiplier), int(n_scores))
    train_events = tuple(train_events)
    if not train_events:
        return score
    return ev.ParallelEvent((ev.ComposedEvent(train_events), score))


def holdout_score_event(noise_multiplier: float) -> ev.DpEvent:
    return ev.GaussianEvent(noise_multiplier)


def trial_event(train_event: ev.DpEvent | None, score_noise_multiplier: float) -> ev.DpEvent:
    """One trial of one candidate: its DP training on the train split (None: trains nothing, the
    zero-shot candidate) in parallel with its noisy holdout score (disjoint splits: the RDP is the
    maximum of the two at each order)."""
    score = holdout_score_event(score_noise_multiplier)
    if train_event is None:
        return score
    return ev.ParallelEvent((train_event, score))


def selection_event(trials: Sequence[ev.DpEvent], distribution: TrialCount) -> ev.RepeatAndSelectEvent:
    """The whole selection as one event (one ε in the record and the ledger)."""
    if isinstance(distribution, TruncatedNegativeBinomial):
        return ev.RepeatAndSelectEvent(tuple(trials), distribution.name, eta=distribution.eta,
                                       gamma=distribution.gamma)
    if isinstance(distribution, PoissonTrials):
        return ev.RepeatAndSelectEvent(tuple(trials), distribution.name, mu=distribution.mu)
    raise TypeError(f"distribution must be TruncatedNegativeBinomial or PoissonTrials, got {distribution!r}")


# ---- calibration and the comparison with naive composition -----------------------------------

@dataclass(frozen=True)
class SelectionPlan:
    """What a selection of DP-SGD trials costs, next to naive composition of the same trials."""

    target_epsilon: float
    delta: float
    distribution: str
    expected_trials: float
    n_candidates: int
    noise_multiplier: float          # DP-SGD σ of every trial
    score_noise_multiplier: float    # σ of the holdout correct-count
    trial_epsilon: float             # one trial (training ∥ score) at δ, full accountant
    selection_epsilon: float         # the whole selection at δ (RDP, P&S)
    naive_epsilon_expected_trials: float  # ⌈E[K]⌉ trials composed, same σ (full accountant)
    naive_epsilon_candidates: float       # n_candidates trials composed, same σ (full accountant)

    def to_dict(self) -> dict:
        return asdict(self)


def plan_dpsgd_selection(target_epsilon: float, delta: float, distribution: TrialCount, sample_rate: float,
                         steps: int, score_noise_multiplier: float, n_candidates: int,
                         tolerance: float = 1e-3) -> SelectionPlan:
    """The smallest DP-SGD σ (to ``tolerance`` relative) for which a selection whose trials train
    ``steps`` Poisson-subsampled steps at ``sample_rate`` (and release a noisy holdout count with
    ``score_noise_multiplier``) spends at most ``target_epsilon`` at ``delta``; with the single-trial
    ε to use and the ε of naive composition of ⌈E[K]⌉ and of ``n_candidates`` such trials.

    Raises ValueError when the score noise alone (a zero-shot-only selection) exceeds the target.
    """
    target_epsilon = check_epsilon(target_epsilon, "target_epsilon")
    delta = check_delta(delta, "delta")
    check_count(steps, "steps", minimum=1)
    check_count(n_candidates, "n_candidates", minimum=1)
    score_sigma = check_positive(score_noise_multiplier, "score_noise_multiplier")
    check_nonnegative(tolerance, "tolerance")

    def sel_event(sigma: float) -> ev.RepeatAndSelectEvent:
        train = ev.dpsgd_event(sample_rate, sigma, steps)
        return selection_event([trial_event(train, score_sigma), trial_event(None, score_sigma)], distribution)

    def sel_eps(sigma: float) -> float:
        return accountant.spend(sel_event(sigma), delta).epsilon

    floor_eps, _ = selection_epsilon(lambda o: rdp_lib.gaussian_rdp(score_sigma, o), distribution, delta)
    if floor_eps >= target_epsilon:
        raise ValueError(f"target_epsilon={target_epsilon:g} is unreachable: the holdout score noise "
                         f"score_noise_multiplier={score_sigma:g} alone costs ε={floor_eps:.4g} in this selection")
    # σ up by doubling from 1 until it fits; down by halving while it fits (to 1e-3); then bisection
    _, hi = calibrate.walk(lambda s: sel_eps(s) > target_epsilon, 1.0, lambda s: None if s * 2.0 > 1e4 else s * 2.0)
    if hi is None:
        raise ValueError(f"target_epsilon={target_epsilon:g} is unreachable for these settings")
    fitting, lo = calibrate.walk(lambda s: s > 1e-3 and sel_eps(s) <= target_epsilon, hi / 2.0, lambda s: s / 2.0)
    if fitting is not None:
        hi = fitting
    sigma = calibrate.search(lambda s: sel_eps(s) <= target_epsilon, good=hi, bad=lo, good_is_high=True,
                             propose=calibrate.geometric, narrow=calibrate.ratio_within(tolerance)).good
    trial = trial_event(ev.dpsgd_event(sample_rate, sigma, steps), score_sigma)
    expected = distribution.mean
    return SelectionPlan(
        target_epsilon=target_epsilon, delta=delta, distribution=distribution.name,
        expected_trials=expected, n_candidates=int(n_candidates), noise_multiplier=sigma,
        score_noise_multiplier=score_sigma,
        trial_epsilon=accountant.spend(trial, delta).epsilon,
        selection_epsilon=sel_eps(sigma),
        naive_epsilon_expected_trials=accountant.spend(_composed(trial, math.ceil(expected)), delta).epsilon,
        naive_epsilon_candidates=accountant.spend(_composed(trial, n_candidates), delta).epsilon,
    )


def composed_gaussian_target(target: float, n_trained: int, delta: float) -> float:
    """A first guess of the per-trial target ε when ``n_trained`` candidates each train once and
    compose: as if each were a Gaussian mechanism, whose k-fold composition at σ is one Gaussian at
    σ/√k — so each trial gets the ε (closed-form RDP) of σ_target·√k, σ_target the Gaussian σ of
    ``target`` (:func:`privacy.rdp.gaussian_sigma_for_epsilon`)."""
    if n_trained <= 1:
        return target
    orders = np.asarray(rdp_lib.DEFAULT_ORDERS, dtype=float)
    sigma = rdp_lib.gaussian_sigma_for_epsilon(target, delta) * math.sqrt(n_trained)
    return float(rdp_lib.rdp_to_epsilon(orders, rdp_lib.gaussian_rdp(sigma, orders), delta)[0])


def gaussian_selection_overhead(x: float, delta: float, distribution: TrialCount,
                                score_noise_multiplier: float) -> float:
    """What a random-stopping selection adds, in ε at δ, over one trial when the trial is a
    Gaussian mechanism of ε = x (closed-form RDP, no calibration of a method) scored with noise
    ``score_noise_multiplier``, with the no-prompt reference scored once more: a first guess of the
    per-trial target, ε(selection) − ε(one trial), at least 0."""
    orders = np.asarray(rdp_lib.DEFAULT_ORDERS, dtype=float)
    sigma = rdp_lib.gaussian_sigma_for_epsilon(x, delta)
    score = score_noise_multiplier
    curve = np.maximum(rdp_lib.gaussian_rdp(sigma, orders), rdp_lib.gaussian_rdp(score, orders))
    chosen = repeat_and_select_rdp(curve, distribution, trial_orders=orders)
    chosen = chosen + rdp_lib.gaussian_rdp(score, orders)  # the no-prompt reference
    one = rdp_lib.rdp_to_epsilon(orders, rdp_lib.gaussian_rdp(sigma, orders), delta)[0]
    return max(0.0, rdp_lib.rdp_to_epsilon(orders, chosen, delta)[0] - one)


def _composed(trial: ev.DpEvent, count: int) -> ev.DpEvent:
    # each trial touches both splits: composing the trials composes their training parts and their
    # score parts; written part-wise so the top-level parallel max stays exact (train ∥ score)
    if isinstance(trial, ev.ParallelEvent):
        return ev.ParallelEvent(tuple(ev.SelfComposedEvent(p, count) for p in trial.events))
    return ev.SelfComposedEvent(trial, count)
