"""Method-agnostic private selection (issue 30): random search with a random number of trials,
noisy holdout scores, one published winner — accounted by ``privacy.selection``.

Given candidates (a method's hyperparameter grid plus the "no prompt" / zero-shot candidate), a
training function, a scorer on the HOLDOUT rows and the run's secret generator:

1. K ~ the trial-count distribution (truncated negative binomial or Poisson), from the generator;
2. each of the K trials picks a candidate uniformly at random (from the generator: independently
   of the data), trains it (``train(candidate, rng)``; the zero-shot candidate trains nothing) and
   releases its holdout correct-count with Gaussian noise (``privacy.selection.release_holdout_score``);
3. the trial with the highest noisy score wins.

What the selection ε covers. :func:`selection_event` is the event to reserve in the ledger BEFORE
the first trial; its ε (Papernot & Steinke, ``privacy/selection.py``) covers publishing the
WINNER only: its candidate, its trained output and its noisy score. ``SelectionResult.published()``
is that. The per-trial list (``SelectionResult.trials``: K, every trial's candidate and noisy score)
holds only noisy numbers, never an exact holdout count, but publishing it is NOT covered by that ε
(it would reveal every trial: naive composition of K trials); keep it out of the run record.

Failures. A trial whose training or scoring raises is skipped: it is recorded with its error and
no score, it still counts as one of the K trials (it may have read private data), and the
winner is the best of the others. This is sound only for failures that do not depend on the
private data (a model that does not load, a full disk); a data-dependent failure is an output of
the trial that the accounting does not see. No winner (K = 0 under Poisson, or every trial
failed) publishes "no winner".

No Prefect, no MLflow here; the caller wires it into a flow.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from privacy import events as ev
from privacy import selection as psel


@dataclass(frozen=True)
class Candidate:
    """One point of the search space. ``zero_shot``: the "no prompt" candidate (nothing is trained)."""

    name: str
    config: Any = None
    zero_shot: bool = False


def no_prompt_candidate(name: str = "no prompt") -> Candidate:
    return Candidate(name=name, config=None, zero_shot=True)


@dataclass(frozen=True)
class TrialOutcome:
    """One trial as released: the candidate, its NOISY holdout score (None if it failed), the error."""

    index: int
    candidate: str
    noisy_score: float | None
    error: str | None = None


@dataclass
class SelectionResult:
    winner: Candidate | None
    winner_output: Any
    winner_noisy_score: float | None
    trials: list[TrialOutcome] = field(default_factory=list)  # operator-only: NOT covered by the ε
    event: ev.RepeatAndSelectEvent | None = None

    def published(self) -> dict[str, Any]:
        """What the selection ε covers: the winner, its noisy score, and how it was chosen
        (data-independent settings); not K, not the other trials."""
        e = self.event
        return {
            "winner": None if self.winner is None else self.winner.name,
            "winner_zero_shot": None if self.winner is None else self.winner.zero_shot,
            "winner_noisy_holdout_correct": self.winner_noisy_score,
            "distribution": e.distribution, "eta": e.eta, "gamma": e.gamma, "mu": e.mu,
        }

    @property
    def failed(self) -> list[TrialOutcome]:
        return [t for t in self.trials if t.error is not None]


def _check_candidates(candidates: Sequence[Candidate]) -> list[Candidate]:
    candidates = list(candidates)
    if not candidates:
        raise ValueError("candidates must not be empty")
    if not all(isinstance(c, Candidate) for c in candidates):
        raise TypeError(f"candidates must be Candidate objects, got {candidates!r}")
    names = [c.name for c in candidates]
    if len(set(names)) != len(names):
        raise ValueError(f"candidate names must be unique, got {names}")
    if not any(c.zero_shot for c in candidates):
        raise ValueError("candidates must include the zero-shot ('no prompt') candidate (issue 30): "
                         "add no_prompt_candidate()")
    return candidates


def selection_event(candidates: Sequence[Candidate], train_event: Callable[[Candidate], ev.DpEvent],
                    distribution: psel.TrialCount, score_noise_multiplier: float) -> ev.RepeatAndSelectEvent:
    """The event of the whole selection (reserve it before the first trial): every candidate's
    training event (``train_event(candidate)``; not called for the zero-shot candidate) in parallel
    with its noisy holdout score, one of them per trial, best of K."""
    candidates = _check_candidates(candidates)
    trials = [psel.trial_event(None if c.zero_shot else train_event(c), score_noise_multiplier) for c in candidates]
    return psel.selection_event(trials, distribution)


def run_selection(candidates: Sequence[Candidate], train: Callable[[Candidate, np.random.Generator], Any],
                  score: Callable[[Candidate, Any], int], distribution: psel.TrialCount,
                  score_noise_multiplier: float, rng: np.random.Generator,
                  train_event: Callable[[Candidate], ev.DpEvent]) -> SelectionResult:
    """Run the selection. ``train(candidate, rng)`` returns the trained output (never called for the
    zero-shot candidate, whose output is None); ``score(candidate, output)`` returns the number of
    holdout rows it gets right (an exact count: it is only ever released with noise).
    ``rng`` is the run's secret DP generator: K, the candidate of each trial and the score noise
    all come from it."""
    candidates = _check_candidates(candidates)
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator (the run's secret DP stream), got {rng!r}")
    event = selection_event(candidates, train_event, distribution, score_noise_multiplier)
    k = distribution.sample(rng)
    trials: list[TrialOutcome] = []
    best: tuple[float, int, Candidate, Any] | None = None
    for i in range(k):
        cand = candidates[int(rng.integers(len(candidates)))]
        try:
            output = None if cand.zero_shot else train(cand, rng)
            correct = score(cand, output)
            noisy = psel.release_holdout_score(correct, score_noise_multiplier, rng)
        except Exception as exc:  # noqa: BLE001 — a failed trial is skipped and said so
            trials.append(TrialOutcome(i, cand.name, None, f"{type(exc).__name__}: {exc}"))
            continue
        trials.append(TrialOutcome(i, cand.name, noisy))
        if best is None or noisy > best[0]:
            best = (noisy, i, cand, output)
    if best is None:
        return SelectionResult(None, None, None, trials, event)
    return SelectionResult(best[2], best[3], best[0], trials, event)
