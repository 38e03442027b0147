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

import logging
import math as _math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from privacy import events as ev
from privacy import rdp as rdp_lib
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
    noisy_score: float | None  # the trial's order key: the noisy count, or ``key`` of the noisy counts
    error: str | None = None
    noisy_counts: tuple[float, ...] | None = None  # when ``score`` gives a count vector: its noisy release

    @property
    def noisy_wrong(self) -> float | None:
        """The noisy wrong count when ``score`` gave (correct, wrong)."""
        return None if self.noisy_counts is None or len(self.noisy_counts) != 2 else self.noisy_counts[1]


@dataclass
class SelectionResult:
    winner: Candidate | None
    winner_output: Any
    winner_noisy_score: float | None
    # random stopping: operator-only, NOT covered by the ε; every candidate: each candidate's trial,
    # all of them covered (the ε is of releasing every noisy score)
    trials: list[TrialOutcome] = field(default_factory=list)
    event: ev.DpEvent | None = None
    winner_noisy_counts: tuple[float, ...] | None = None  # when ``score`` gives a count vector

    @property
    def winner_noisy_wrong(self) -> float | None:
        c = self.winner_noisy_counts
        return None if c is None or len(c) != 2 else c[1]

    @property
    def every_candidate(self) -> bool:
        return not isinstance(self.event, ev.RepeatAndSelectEvent)

    def published(self) -> dict[str, Any]:
        """What the selection ε covers: the winner, its noisy score, and how it was chosen
        (data-independent settings). Random stopping: not K, not the other trials. Every candidate
        once: every candidate's noisy score too (post-processing of what the ε covers)."""
        out = {"winner": None if self.winner is None else self.winner.name,
               "winner_zero_shot": None if self.winner is None else self.winner.zero_shot,
               "winner_noisy_holdout_correct": self.winner_noisy_score}
        e = self.event
        if isinstance(e, ev.RepeatAndSelectEvent):
            return {**out, "distribution": e.distribution, "eta": e.eta, "gamma": e.gamma, "mu": e.mu}
        return {**out, "mode": "every_candidate",
                "noisy_scores": {t.candidate: t.noisy_score for t in self.trials}}

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


def every_candidate_event(candidates: Sequence[Candidate], train_event: Callable[[Candidate], ev.DpEvent],
                          score_noise_multiplier: float) -> ev.DpEvent:
    """The event of trying every candidate once (``privacy.selection.every_candidate_event``): the
    trained candidates' trainings composed, in parallel with one noisy score per candidate."""
    candidates = _check_candidates(candidates)
    return psel.every_candidate_event([train_event(c) for c in candidates if not c.zero_shot], len(candidates),
                                      score_noise_multiplier)


def run_selection(candidates: Sequence[Candidate], train: Callable[[Candidate, np.random.Generator], Any],
                  score: Callable[[Candidate, Any], Any], distribution: psel.TrialCount,
                  score_noise_multiplier: float, rng: np.random.Generator,
                  train_event: Callable[[Candidate], ev.DpEvent],
                  key: Callable[[np.ndarray], float] | None = None) -> SelectionResult:
    """Run the selection (random stopping). ``train(candidate, rng)`` returns the trained output
    (never called for the zero-shot candidate, whose output is None); ``score(candidate, output)``
    returns the number of holdout rows it gets right, or a vector of holdout counts in which one
    record is counted once (e.g. (correct, wrong), or per class (correct_c, wrong_c)): exact
    counts, only ever released with noise. Trials are ordered by ``key(noisy counts)`` (default:
    the noisy count, or the vector's first coordinate). ``rng`` is the run's secret DP generator:
    K, the candidate of each trial and the score noise all come from it."""
    candidates = _check_candidates(candidates)
    _check_secret(rng)
    event = selection_event(candidates, train_event, distribution, score_noise_multiplier)
    k = distribution.sample(rng)
    trials = [_trial(i, candidates[int(rng.integers(len(candidates)))], train, score, score_noise_multiplier,
                     rng, key) for i in range(k)]
    return _best(trials, event)


def run_every_candidate(candidates: Sequence[Candidate], train: Callable[[Candidate, np.random.Generator], Any],
                        score: Callable[[Candidate, Any], Any], score_noise_multiplier: float,
                        rng: np.random.Generator, train_event: Callable[[Candidate], ev.DpEvent],
                        key: Callable[[np.ndarray], float] | None = None) -> SelectionResult:
    """Every candidate trained once (in order) and scored once with noise; the best noisy score
    wins (ties: the earlier candidate). ``train``, ``score``, ``key`` and ``rng`` as for
    :func:`run_selection`. The event (:func:`every_candidate_event`) covers every trial's noisy
    score, so ``SelectionResult.trials`` may be published. A candidate that fails is skipped (its
    ε is still counted: it may have read private data)."""
    candidates = _check_candidates(candidates)
    _check_secret(rng)
    event = every_candidate_event(candidates, train_event, score_noise_multiplier)
    trials = [_trial(i, c, train, score, score_noise_multiplier, rng, key) for i, c in enumerate(candidates)]
    return _best(trials, event)


def _check_secret(rng) -> None:
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator (the run's secret DP stream), got {rng!r}")


def _trial(i: int, cand: Candidate, train, score, sigma: float, rng, key):
    """One trial: train (not the zero-shot candidate), score, release with noise; a failure is
    recorded with its error (no noise drawn)."""
    try:
        output = None if cand.zero_shot else train(cand, rng)
        counts = score(cand, output)
        if isinstance(counts, (tuple, list, np.ndarray)):  # a count vector: L2 sensitivity 1 per unit
            # (one record in one cell; one person's rows weighted to one vote: tasks/selection.holdout_weights)
            noisy_counts = tuple(float(x) for x in psel.release_holdout_count_vector(counts, sigma, rng))
            noisy = key(np.asarray(noisy_counts)) if key else noisy_counts[0]
        else:  # one count: the noisy count is the order (``key`` reads count vectors)
            noisy_counts = None
            noisy = psel.release_holdout_score(counts, sigma, rng)
    except Exception as exc:  # noqa: BLE001 — a failed trial is skipped and said so
        return TrialOutcome(i, cand.name, None, f"{type(exc).__name__}: {exc}"), None, None
    return TrialOutcome(i, cand.name, float(noisy), None, noisy_counts), cand, output


def _best(trials, event) -> SelectionResult:
    best = None
    for outcome, cand, output in trials:
        if outcome.error is None and (best is None or outcome.noisy_score > best[0].noisy_score):
            best = (outcome, cand, output)
    outcomes = [t[0] for t in trials]
    if best is None:
        return SelectionResult(None, None, None, outcomes, event)
    return SelectionResult(best[1], best[2], best[0].noisy_score, outcomes, event, best[0].noisy_counts)


# ==== the selection of a run: config → candidates → plan → trials (the lifecycle calls these) ====
#
# ``selection: {enabled: true}`` makes the published method's pass through the lifecycle ONE
# mechanism: the event reserved before the first private read is :func:`mechanism_event`, the
# selection (best of K trials, Papernot & Steinke) composed with the release of the "no prompt"
# reference score; every trial's training is calibrated (:func:`plan_selection`) so that this
# event, composed with the release of the split sizes, meets privacy.target_epsilon. What is
# published: the winner (its settings' name, its trained output), its noisy holdout counts and
# the no-prompt reference's (shown as accuracies of noisy counts), or — when the reference's is
# higher — no prompt instead (:func:`published_choice`, post-processing). What is not: K, the
# other trials, any exact holdout count (they stay in the operator's private log).
#
# The secret number of trials K is part of the mechanism: the Papernot–Steinke bound holds for
# the best trial with K hidden (conditioned on K = k it would be best-of-k, up to k times the
# trial's loss). So no per-trial line goes to the Prefect log (its count is K): the trials'
# progress goes to a private operator log (``private/runs/<id>/selection.log``, a Python logger
# that does not propagate to Prefect), and the Prefect log says when the selection starts and
# ends. The run's wall time still grows with K and shows in MLflow's and Prefect's timestamps:
# random stopping is refused unless ``selection.accept_timing_channel`` says those servers are as
# closed as the private side (:func:`check_selection_config`; the run is tagged
# ``selection.timing_channel``), and its training time is kept out of the run record.
#
# The privacy unit. With ``data.privacy_unit`` naming a person, the candidates train on rows that
# keep their units (the methods' unit-level steps sample and clip people) and the holdout counts
# count one VOTE per person (:func:`holdout_weights`: each of a person's n holdout rows weighs 1/n),
# so one person moves a released vector by L2 ≤ 1 — the Gaussian events' sensitivity 1 holds per
# person, in both modes, with or without a cap (proof: ``privacy/selection.py``). A record-level
# run charged per person (``data.person_field``) counts rows, ≤ k per person: its charge is the
# group-privacy event (σ/k), defined for every candidate once; random stopping is refused there
# (:func:`check_selection_config`).

NO_PROMPT = "no prompt"


def candidate_name(settings: dict) -> str:
    """A candidate's name in the run record: its settings, ``key=value`` joined by commas."""
    return ",".join(f"{k}={v}" for k, v in settings.items()) or "configured"


def applies(cfg, name: str) -> bool:
    """Whether method ``name``'s pass through the lifecycle is a selection (the published method only)."""
    return bool(cfg.selection.enabled) and name == cfg.method


def apply_settings(cfg, name: str, settings: dict):
    """``cfg`` with the candidate's ``settings`` (keys of ``methods.<name>``, dotted for nested
    blocks) applied and validated; raises ValueError naming a bad key."""
    import copy

    from pydantic import ValidationError

    block = getattr(cfg.methods, name)
    data = copy.deepcopy(block.model_dump(by_alias=True))
    for dotted, value in settings.items():
        node, parts = data, str(dotted).split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                raise ValueError(f"selection: {dotted!r} is not a key of methods.{name}")
            node = node[part]
        if parts[-1] not in node:
            raise ValueError(f"selection: {dotted!r} is not a key of methods.{name}")
        node[parts[-1]] = value
    try:
        new_block = type(block).model_validate(data)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in err.errors())
        raise ValueError(f"selection: candidate {candidate_name(settings)!r} is not a valid methods.{name} "
                         f"block ({problems})") from None
    return cfg.model_copy(update={"methods": cfg.methods.model_copy(update={name: new_block})})


def _drawn_settings(cfg, name: str) -> list[dict]:
    """``selection.draws`` settings drawn from ``selection.ranges`` with the config's (public) seed."""
    rng = np.random.default_rng([int(cfg.seed), 30])
    block = getattr(cfg.methods, name)
    out = []
    for _ in range(cfg.selection.draws):
        item = {}
        for key, (low, high) in cfg.selection.ranges.items():
            current = block
            for part in key.split("."):
                current = getattr(current, part, None)
            if isinstance(current, int) and not isinstance(current, bool):
                item[key] = int(rng.integers(int(_math.ceil(low)), int(_math.floor(high)) + 1))
            elif low > 0:
                item[key] = float(f"{_math.exp(rng.uniform(_math.log(low), _math.log(high))):.3g}")
            else:
                item[key] = float(f"{rng.uniform(low, high):.3g}")
        out.append(item)
    return out


def candidates_of(cfg, method) -> list[Candidate]:
    """The published method's candidates: ``selection.candidates``, draws from ``selection.ranges``,
    or the method's own grid (``Traits.selection_grid`` of ``method``, its spec), then the "no
    prompt" candidate."""
    name = cfg.method
    if cfg.selection.candidates:
        settings = [dict(c) for c in cfg.selection.candidates]
    elif cfg.selection.ranges:
        settings = _drawn_settings(cfg, name)
    else:
        settings = [dict(c) for c in method.traits.selection_grid]
    if not settings:
        raise ValueError(f"selection: method {name} has no candidates to choose from")
    out, seen = [], set()
    for s in settings:
        c = Candidate(candidate_name(s), s)
        if c.name not in seen:  # draws may repeat a point: each candidate once
            seen.add(c.name)
            out.append(c)
    return out + [no_prompt_candidate(NO_PROMPT)]


def check_selection_config(cfg, method) -> None:
    """Config-time checks of ``selection:`` (raise ValueError naming the problem): the published
    method has an (ε, δ) guarantee under every candidate, reads private training rows, and does
    not read the holdout itself (the selection scores on it; a record there must touch only the
    score, for the trial's parallel composition). And the privacy unit: with a record unit each
    holdout row is one count (sensitivity 1); with a person unit (``data.privacy_unit``) each
    person one vote (:func:`holdout_weights`: sensitivity 1 per person, either mode, with or
    without ``data.max_records_per_unit``; the trainings are the method's unit-level mechanisms);
    a record-level run charged per person (``data.person_field``, k records each) is charged the
    group-privacy event, Gaussian σ → σ/k for its row counts — which exists for every candidate
    once, and not for random stopping's best-of-K event: refused. ``method``: the published
    method's spec."""
    data = cfg.data
    if data.group_size and not every_candidate(cfg.selection):
        raise ValueError(
            f"selection: selection.mode: random_stopping on a record-level run charged per person (data.person_field: "
            f"{data.person_field}, data.max_records_per_unit: {data.group_size}) is refused: its best-of-K event "
            "(RepeatAndSelectEvent) has no group-privacy rule here; use selection.mode: every_candidate (its holdout "
            f"counts are then charged at sensitivity {data.group_size} per person) or data.privacy_unit: "
            f"{data.person_field} (one vote per person)")
    if not every_candidate(cfg.selection) and not cfg.selection.accept_timing_channel:
        raise ValueError(
            "selection: selection.mode: random_stopping is refused: its ε assumes the number of trials K stays secret, "
            "but the run's duration grows with K and shows in MLflow's and Prefect's run timestamps (knowing K, the "
            "best of K trials can cost up to K trials composed); use selection.mode: every_candidate, or set "
            "selection.accept_timing_channel: true where those servers are as closed as the private side")
    if cfg.audit.enabled:
        raise ValueError("selection: audit.enabled: the audit's shadows train the configured settings, not the "
                         "selection (the audit of a selection is not implemented); turn one of them off")
    if not method.traits.reads_private:
        raise ValueError(f"selection: method {cfg.method} trains nothing on private data; there is nothing to select")
    if method.traits.uses_validation:
        raise ValueError(f"selection: method {cfg.method} reads the holdout in its own training, which the "
                         "selection scores on; select its settings without selection: or use another method")
    for c in candidates_of(cfg, method):
        if c.zero_shot:
            continue
        guarantee = method.mechanism.guarantee(apply_settings(cfg, cfg.method, c.config))
        if guarantee != "dp":
            raise ValueError(f"selection: candidate {c.name!r} of method {cfg.method} has guarantee {guarantee!r}; "
                             "private selection needs an (ε, δ)-DP method under every candidate")
    if data.user_unit and not method.traits.unit_level:
        raise ValueError(f"selection: data.privacy_unit: {data.privacy_unit} needs a method whose trainings bound a "
                         f"person's contribution; method {cfg.method} bounds one record's")


def trial_count(sel) -> psel.TrialCount:
    """The law of K from the ``selection:`` block."""
    if sel.distribution == "poisson":
        return psel.PoissonTrials(float(sel.expected_trials))
    return psel.TruncatedNegativeBinomial(float(sel.eta), psel.gamma_for_mean(float(sel.eta),
                                                                              float(sel.expected_trials)))


def mechanism_event(selection: ev.DpEvent, score_noise_multiplier: float) -> ev.DpEvent:
    """The whole mechanism. Random stopping: the selection, then the noisy holdout counts of the
    "no prompt" reference (Gaussian at sensitivity 1, composed: it reads the holdout again). Every
    candidate once: the selection itself (no prompt is scored as one of the candidates)."""
    if not isinstance(selection, ev.RepeatAndSelectEvent):
        return selection
    return ev.ComposedEvent((selection, psel.holdout_score_event(score_noise_multiplier)))


def every_candidate(sel) -> bool:
    return sel.mode == "every_candidate"


RANDOM_STOPPING_SCORE_SIGMA = 5.0  # random stopping's default σ of the holdout counts (in records)


def score_sigma(sel, train_events: Sequence[ev.DpEvent], n_scores: int, delta: float) -> float:
    """σ of the released holdout counts: ``selection.score_noise_multiplier`` when set; random
    stopping: 5 records; every candidate once: the σ at which the scores cost no more than the
    trainings. The two branches touch disjoint rows (train split, holdout), so the mechanism
    costs the larger of the two (``privacy.selection.every_candidate_event``): noise on the
    scores beyond that point buys no privacy, only a noisier choice. ``n_scores`` Gaussian
    counts of σ compose like one of σ/√n_scores; that one is solved at the trainings' ε by its
    closed-form RDP conversion, which is looser than the PLD the accountant also uses, so the
    scores' branch comes out at or below the trainings' (the accountant computes the whole
    mechanism's ε from the events, whatever σ is chosen here). Data-independent: depends on the
    config and the released sizes only."""
    from privacy import accountant as acct

    if sel.score_noise_multiplier is not None:
        return float(sel.score_noise_multiplier)
    if not every_candidate(sel) or not train_events:
        return RANDOM_STOPPING_SCORE_SIGMA
    train_eps = acct.spend(ev.ComposedEvent(tuple(train_events)), delta).epsilon
    return float(f"{rdp_lib.gaussian_sigma_for_epsilon(train_eps, delta) * _math.sqrt(n_scores) * 1.001:.4g}")


def _selection_of(sel, candidates, train_event, delta: float) -> tuple[ev.DpEvent, float]:
    """The selection's event and the σ of its scores."""
    sigma = score_sigma(sel, [train_event(c) for c in candidates if not c.zero_shot], len(candidates), delta)
    if every_candidate(sel):
        return every_candidate_event(candidates, train_event, sigma), sigma
    return selection_event(candidates, train_event, trial_count(sel), sigma), sigma


def _candidate_plan(method, cfg, cand: Candidate, trial_target: float, n_train: int, delta: float):
    """(the candidate's config — ``cfg`` with its own settings of ``methods.<name>``, the user's
    budget untouched —, its plan at the per-trial ε ``trial_target``)."""
    cand_cfg = apply_settings(cfg, method.name, cand.config)
    return cand_cfg, method.mechanism.plan(cand_cfg, n_train, delta, epsilon=trial_target)


def selection_epsilon_at(method, cfg, candidates, trial_target: float, n_train: int, delta: float):
    """(ε of the whole mechanism at δ, its event, the σ of its scores) when every trial is
    calibrated to ``trial_target``."""
    from privacy import accountant as acct

    events = {c.name: _candidate_plan(method, cfg, c, trial_target, n_train, delta)[1].event
              for c in candidates if not c.zero_shot}
    selection, sigma = _selection_of(cfg.selection, candidates, lambda c: events[c.name], delta)
    event = mechanism_event(selection, sigma)
    return acct.spend(event, delta).epsilon, event, sigma


def calibrate_trial_target(method, cfg, candidates, n_train: int, delta: float, target: float,
                           tolerance: float = 0.01) -> tuple[float, float, ev.DpEvent, float]:
    """The largest per-trial target ε t found at which the whole mechanism spends at most
    ``target``, and within ``tolerance`` (relative) of it: returns (t, its ε, its event, the σ of
    its scores). ε(t) is smooth and increasing with slope ≈ 1 (the selection adds a near-constant
    to one trial), so: a first guess from a Gaussian trial (closed form), then secant steps
    (``privacy.calibrate.largest_within``). Each step plans every candidate at t (the methods' own
    calibrations, cached; the search: ``privacy.plan.calibrate_trial_target``). Raises ValueError
    when no t above target/1000 fits."""
    from privacy import plan as pplan

    seen: dict[float, tuple[float, ev.DpEvent, float]] = {}

    def at(t: float) -> float:
        if t not in seen:
            try:
                seen[t] = selection_epsilon_at(method, cfg, candidates, t, n_train, delta)
            except ValueError as exc:  # e.g. a δ-part (approximate RDP) in a trial
                raise ValueError(f"selection: method {method.name}: {exc}") from None
        return seen[t][0]

    sel = cfg.selection
    every = every_candidate(sel)
    score = RANDOM_STOPPING_SCORE_SIGMA if sel.score_noise_multiplier is None else sel.score_noise_multiplier
    first = pplan.first_trial_target(target, delta, every_candidate=every,
                                     n_trained=sum(not c.zero_shot for c in candidates),
                                     distribution=None if every else trial_count(sel), score_sigma=score)
    best = pplan.calibrate_trial_target(at, target, first, tolerance)
    return best, seen[best][0], seen[best][1], seen[best][2]


def plan_selection(method, cfg, n_train: int, delta: float, epsilon: float):
    """The published method's plan when its settings are selected: a ``dp`` MethodPlan whose event
    is :func:`mechanism_event` (trials calibrated together so that it spends ``epsilon``: the
    method's share of the run's budget), params for the run record, and in
    ``settings['selection']`` what the trials need (per-trial target, candidates, δ)."""
    from .methods.base import MethodPlan

    sel = cfg.selection
    candidates = candidates_of(cfg, method)
    target = float(epsilon)
    t, eps, event, sigma = calibrate_trial_target(method, cfg, candidates, n_train, delta, target)
    params = {"selection.enabled": True, "selection.candidates": len(candidates), "selection.mode": sel.mode,
              "selection.metric": sel.metric, "selection.score_noise_multiplier": sigma,
              "selection.trial_target_epsilon": t}
    if not every_candidate(sel):
        dist = trial_count(sel)
        params.update({"selection.distribution": dist.name, "selection.expected_trials": float(sel.expected_trials)})
        if isinstance(dist, psel.TruncatedNegativeBinomial):
            params.update({"selection.eta": dist.eta, "selection.gamma": dist.gamma})
    params.update({f"selection.candidate_{i}": c.name for i, c in enumerate(candidates)})  # the scores' names
    data = cfg.data
    if data.user_unit:  # what the released holdout counts count, and so their sensitivity per unit
        params["selection.score_counts"] = f"one vote per {data.privacy_unit} (sensitivity 1 per {data.privacy_unit})"
    elif data.group_size:
        params["selection.score_counts"] = (f"rows, at most {data.group_size} per {data.person_field} (charged at "
                                            f"sensitivity {data.group_size} per {data.person_field})")
    settings = {"selection": {"trial_target": t, "delta": delta, "epsilon": eps, "score_noise_multiplier": sigma,
                              "candidates": [{"name": c.name, "settings": c.config, "zero_shot": c.zero_shot}
                                             for c in candidates]}}
    return MethodPlan(method.name, "dp", n_train, delta, event=event, params=params, settings=settings)


def single_run_epsilon(method, cfg, n_train: int, delta: float, trial_target: float) -> dict[str, float]:
    """What ONE trial of each trained candidate would cost on its own (its plan's ε at δ), for
    ``privprompt plan`` beside the selection's ε."""
    from privacy import accountant as acct

    out = {}
    for c in candidates_of(cfg, method):
        if not c.zero_shot:
            out[c.name] = acct.spend(_candidate_plan(method, cfg, c, trial_target, n_train, delta)[1].event,
                                     delta).epsilon
    return out


def private_logger(path) -> logging.Logger:
    """The operator's log of the trials (a file under private/; never propagated to Prefect)."""
    logger = logging.getLogger(f"privprompt.selection.private.{path}")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    if not logger.handlers:
        from .state import open_private

        open_private(path, "a").close()  # created 0600 (the trial count, scores, failures), whatever the umask
        handler = logging.FileHandler(path)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        logger.addHandler(handler)
    return logger


def per_class_counts(predicted, labels, n_classes: int, weights=None) -> np.ndarray:
    """(correct_c, wrong_c) for each class c, flattened [correct_0, wrong_0, correct_1, …]: each
    holdout row is counted once, in its own class's cell (exact: only released with noise). With
    ``weights`` (a person unit: :func:`privacy.selection.one_vote_weights`), each row adds its
    weight instead, every cell a correctly rounded sum (``math.fsum``)."""
    predicted, labels = np.asarray(predicted), np.asarray(labels)
    right = predicted == labels
    if weights is None:
        out = np.zeros((n_classes, 2), dtype=int)
        np.add.at(out, (labels, np.where(right, 0, 1)), 1)
        return out.ravel()
    weights = _row_weights(weights, labels)
    cell = 2 * labels + np.where(right, 0, 1)
    return np.array([_math.fsum(weights[cell == j].tolist()) for j in range(2 * n_classes)])


def _row_weights(weights, labels: np.ndarray) -> np.ndarray:
    weights = np.asarray(weights, dtype=float)
    if weights.shape != labels.shape:
        raise ValueError(f"weights must give one weight per holdout row, got {weights.shape} for {labels.shape}")
    return weights


def holdout_weights(cfg, holdout) -> np.ndarray | None:
    """Each holdout row's weight in the released counts: None (every row counts one: a record
    unit, or a record-level run charged per person, whose group-privacy charge covers its ≤ k rows
    of a person) or, with a person unit (``data.privacy_unit`` naming a field), one vote per person
    (:func:`privacy.selection.one_vote_weights`: 1/n_u for each of person u's n_u holdout rows), so
    that one person moves a released vector by L2 ≤ 1, the sensitivity its Gaussian event states."""
    if not cfg.data.user_unit:
        return None
    index = holdout.unit_index()
    if index is None:
        raise RuntimeError(f"selection: data.privacy_unit is {cfg.data.privacy_unit!r} but the holdout rows carry "
                           "no units: their counts cannot count one vote per person")
    return psel.one_vote_weights(index[0])


def holdout_counts(method, mctx, prompt, holdout, weights=None):
    """The holdout counts that selection releases (with noise) for ``prompt`` (None: no prompt):
    ``selection.metric: accuracy`` — (correct, wrong); ``balanced_accuracy`` — per class c
    (correct_c, wrong_c). Whole counts of rows (``weights`` None), or with a person unit sums of the
    rows' ``weights`` (:func:`holdout_weights`), of the predictions of
    :func:`tasks.methodkit.holdout.holdout_predictions`. Exact: never published as is."""
    from .methodkit import holdout as scoring
    from .methodkit.classifiers import label_indices

    cfg = mctx.cfg
    metric = cfg.selection.metric
    y = label_indices(holdout.labels, cfg.data.labels).cpu().numpy().astype(int)
    # an exactly empty holdout: no row predicted, every count 0
    predicted = (np.asarray(scoring.holdout_predictions(method, mctx, prompt, holdout)) if len(holdout)
                 else np.zeros(0, dtype=int))
    if weights is None and metric == "accuracy":
        correct = int((predicted == y).sum())
        return correct, len(holdout) - correct
    if metric == "accuracy":  # weighted: (Σ weights of the rows right, Σ of those wrong)
        w, right = _row_weights(weights, y), predicted == y
        return _math.fsum(w[right].tolist()), _math.fsum(w[~right].tolist())
    return per_class_counts(predicted, y, len(cfg.data.labels), weights)


def released_score(noisy_counts, metric: str) -> float:
    """The holdout score of released (noisy) counts (post-processing): ``accuracy`` of a (correct,
    wrong) pair (or of per-class pairs, summed); ``balanced_accuracy``, the mean over classes of
    correct_c / (correct_c + wrong_c), each clipped to [0, 1] (a class whose released total is not
    positive counts 0)."""
    pairs = np.asarray(noisy_counts, dtype=float).reshape(-1, 2)
    if metric == "accuracy":
        return released_accuracy(float(pairs[:, 0].sum()), float(pairs[:, 1].sum()))
    if metric == "balanced_accuracy":
        return float(np.mean([released_accuracy(c, w) for c, w in pairs]))
    raise ValueError(f"unknown selection metric {metric!r}: accuracy or balanced_accuracy")


def score_key(name: str) -> str:
    """The run record's name of a released holdout score: ``selection.<name>.holdout_score``
    (``name``: winner, no_prompt, best_trial, candidate_<i>); param ``selection.metric`` says
    which score it is."""
    return f"selection.{name}.holdout_score"


def train_selection(method, mctx, plan, rows, log_path, announce=None):
    """Run the selection of ``plan`` (from :func:`plan_selection`) on private ``rows`` (training
    rows, ``rows.validation`` the holdout). Returns a ``Trained``: the winner's output (None for
    "no prompt" or no winner), the mechanism's event, and the published numbers as metrics
    (released scores of noisy counts, ``selection.metric``; the winner's index in the candidate
    list, to republish it on a retry). ``announce(line)``: a public log line (Prefect). Random
    stopping: start and end only, the per-trial lines go to ``log_path`` (private: their number
    is K); every candidate: one line per candidate (the number of trials is public)."""
    from .methods.base import PrivateRows, Trained

    info = plan.settings["selection"]
    cfg = mctx.cfg
    sel = cfg.selection
    candidates = [Candidate(c["name"], c["settings"], c["zero_shot"]) for c in info["candidates"]]
    holdout = rows.validation
    if holdout is None:
        raise RuntimeError("selection: the method passed no holdout rows to score the candidates on")
    # an EXACTLY empty holdout is scored like any other (every count 0, then the noise): refusing it
    # here would be a 0-vs-1 test of one record outside ε
    weights = holdout_weights(cfg, holdout)  # one vote per person with a person unit (None: one per row)
    # the candidates' training rows, without the holdout (only the scores read it), with their units
    train_rows = PrivateRows(rows.texts, rows.labels, units=rows.units)
    plans = {c.name: _candidate_plan(method, cfg, c, info["trial_target"], plan.n_train, info["delta"])
             for c in candidates if not c.zero_shot}
    every = every_candidate(sel)
    sigma = float(info.get("score_noise_multiplier", RANDOM_STOPPING_SCORE_SIGMA))  # plans stored before it: 5
    trained_so_far = [0]

    def train(cand: Candidate, rng):
        from dataclasses import replace

        private.info("trial: training candidate %s", cand.name)
        if every and announce:
            trained_so_far[0] += 1
            announce(f"selection: training candidate {trained_so_far[0]} of {len(plans)}: {cand.name}")
        cand_cfg, cand_plan = plans[cand.name]
        return method.mechanism.train(replace(mctx, cfg=cand_cfg), cand_plan, train_rows)

    def score(cand: Candidate, trained):
        return holdout_counts(method, mctx, None if trained is None else trained.prompt, holdout, weights)

    def key(noisy: np.ndarray) -> float:
        return released_score(noisy, sel.metric)

    private = private_logger(log_path)
    rng = mctx.randomness.numpy(stream=30)
    train_event = lambda c: plans[c.name][1].event  # noqa: E731
    try:
        result, reference = _run_trials(candidates, train, score, key, sigma, rng, train_event, sel, every,
                                        len(plans), log_path, announce)
        _log_trials(private, result, sel.metric)
        if not every:
            reference = tuple(psel.release_holdout_count_vector(score(candidates[-1], None), sigma, rng))
        winner_index, metrics = published_choice(candidates, result, reference,
                                                 sel.fallback_to_no_prompt and not every, sel.metric)
        _report_failures(private, result, every, log_path, announce)
        winner_out = None if winner_index < 0 or candidates[winner_index].zero_shot else result.winner_output
        private.info("best trial: %s; published: %s", "none" if result.winner is None else result.winner.name,
                     winner_label(candidates, winner_index))
        if announce:
            announce(f"selection: finished; published candidate: {winner_label(candidates, winner_index)}")
    finally:
        for handler in list(private.handlers):  # the run's log file is closed (long-lived workers run many)
            private.removeHandler(handler)
            handler.close()
    event = mechanism_event(result.event, sigma)  # the one reserved (with the sizes' release)
    prompt = None if winner_out is None else winner_out.prompt
    steps = 0 if winner_out is None else winner_out.steps
    return Trained(prompt, event, steps, metrics, [])


def _run_trials(candidates, train, score, key, sigma: float, rng, train_event, sel, every: bool, n_trained: int,
                log_path, announce):
    """The mechanism: every candidate once, or random stopping. Returns (result, the "no prompt"
    reference's released counts; None for random stopping, released after the trials)."""
    if every:
        if announce:
            announce(f"selection: every one of {n_trained} candidate settings trained once, then each and no prompt "
                     f"scored on the holdout with noise ({sel.metric})")
        result = run_every_candidate(candidates, train, score, sigma, rng, train_event, key)
        return result, next((t.noisy_counts for t in result.trials if candidates[t.index].zero_shot), None)
    dist = trial_count(sel)
    if announce:
        announce(f"selection: {len(candidates) - 1} candidate settings + no prompt, E[K] = {dist.mean:g} trials "
                 f"({dist.name}); each trial's progress is in the private log {log_path} (the number of trials "
                 "is part of the mechanism and is not shown here)")
    return run_selection(candidates, train, score, dist, sigma, rng, train_event, key), None


def _log_trials(private, result: SelectionResult, metric: str) -> None:
    """Each trial to the private log (random stopping: operator-only, never published, not covered by the ε)."""
    for t in result.trials:
        if t.error is None:
            private.info("trial %d: candidate %s, noisy holdout %s %.4f", t.index + 1, t.candidate, metric,
                         t.noisy_score)
        else:
            private.warning("trial %d: candidate %s FAILED and was skipped: %s", t.index + 1, t.candidate, t.error)


def _report_failures(private, result: SelectionResult, every: bool, log_path, announce) -> None:
    if not result.failed:
        return
    private.warning("%d trial(s) failed and were skipped (sound only for failures that do not depend on the "
                    "private data: a model that does not load, a full disk)", len(result.failed))
    if every and announce:  # which ones, and why, only in the private log: an error's text may quote data
        announce(f"selection: {len(result.failed)} candidate(s) failed and were skipped (which, and why: the "
                 f"private log {log_path})")


def published_choice(candidates, result: SelectionResult, reference, fallback: bool,
                     metric: str = "accuracy") -> tuple[int, dict[str, float]]:
    """What is published, from released numbers only (post-processing): the best trial's candidate
    (its index in ``candidates``; −1: no winner), or — with ``fallback`` — "no prompt" when the best
    trial trained a prompt whose released holdout score is below the released no-prompt
    reference's (``reference``: its noisy counts; random stopping, where a K that never drew "no
    prompt" is likely: E[(1 − 1/C)^K], 0.38 for 7 candidates and a geometric K of mean 10). The
    metrics it publishes: the published candidate's index and released score
    (``selection.winner.*``), the reference's, after a fallback the best trial's, and when every
    candidate was tried once (``result.every_candidate``) every candidate's (``candidate_<i>``)."""
    names = [c.name for c in candidates]
    no_prompt = next(i for i, c in enumerate(candidates) if c.zero_shot)
    metrics = {}
    if reference is not None:
        metrics[score_key("no_prompt")] = released_score(reference, metric)
    # every candidate's released score — when none failed: which ones failed would otherwise show, and a
    # failure is covered by the ε only if it does not depend on the private data (then only the winner's)
    if result.every_candidate and not result.failed:
        for t in result.trials:
            metrics[score_key(f"candidate_{names.index(t.candidate)}")] = t.noisy_score
    index = -1 if result.winner is None else names.index(result.winner.name)
    if index >= 0:
        best = released_score(result.winner_noisy_counts, metric) if result.winner_noisy_counts is not None \
            else result.winner_noisy_score
        metrics[score_key("winner")] = best
        ref = metrics.get(score_key("no_prompt"))
        if fallback and not candidates[index].zero_shot and ref is not None and best < ref:
            metrics.update({"selection.fallback_to_no_prompt": 1.0, score_key("best_trial"): best,
                            "selection.best_trial_index": float(index), score_key("winner"): ref})
            index = no_prompt
    metrics.update({"selection.winner_index": float(index),
                    "selection.winner_is_no_prompt": float(index >= 0 and candidates[index].zero_shot)})
    if result.every_candidate:
        # how many candidates failed and were skipped: a count, never which or why (those stay in the
        # private log); the count Prefect's log already says. NOT under random stopping: how many
        # distinct candidates failed grows with the number of trials K, whose secrecy its ε needs (a
        # review measured P(count = 1) for one failing candidate of 7: 0.14 at K = 1, 0.77 at K = 10);
        # there the failures stay in the private log. Skipping is sound only for failures that do not
        # depend on the private data (a model that does not load, a full disk).
        metrics["selection.failed_candidates"] = float(len({t.candidate for t in result.failed}))
    return index, metrics


def failed_note(metrics: dict) -> str | None:
    """The run summary's warning when selection candidates failed and were skipped (a count only)."""
    n = int(metrics.get("selection.failed_candidates") or 0)
    if not n:
        return None
    return (f"{n} selection candidate(s) failed and were skipped: the published choice is among the others only "
            "(which, and why: the run's private selection.log)")


def fallback_note(metrics: dict, best_trial: str | None) -> str | None:
    """The run summary's line when the best trial's prompt was dropped for no prompt (None otherwise)."""
    if not metrics.get("selection.fallback_to_no_prompt"):
        return None
    return (f"the best trial ({best_trial or 'a trained prompt'}) released a holdout score of "
            f"{metrics[score_key('best_trial')]:.4f}, below no prompt's "
            f"{metrics[score_key('no_prompt')]:.4f} (both noisy, DP): no prompt was published "
            "instead (selection.fallback_to_no_prompt)")


def best_trial_name(plan, metrics: dict) -> str | None:
    """The best trial's candidate when a fallback published no prompt instead (None otherwise)."""
    if "selection.best_trial_index" not in metrics:
        return None
    return plan.settings["selection"]["candidates"][int(metrics["selection.best_trial_index"])]["name"]


def released_accuracy(noisy_correct: float, noisy_wrong: float) -> float:
    """correct / (correct + wrong) of released (noisy) counts, clipped to [0, 1]: post-processing."""
    total = noisy_correct + noisy_wrong
    if total <= 0:
        return 0.0
    return float(min(1.0, max(0.0, noisy_correct / total)))


def winner_label(candidates, index: int) -> str:
    if index < 0:
        return "none (no trial, or every trial failed): nothing trained is published"
    return candidates[index].name if not candidates[index].zero_shot else NO_PROMPT


def winner_of(plan, metrics: dict):
    """(name, settings, zero_shot) of the published winner from a selection plan and its metrics
    (None: no winner)."""
    index = int(metrics.get("selection.winner_index", -1))
    if index < 0:
        return None
    c = plan.settings["selection"]["candidates"][index]
    return c["name"], c["settings"], c["zero_shot"]


def winner_context(method, mctx, plan, metrics: dict):
    """(mctx, plan) of the winner, for post-processing its output (public data only)."""
    from dataclasses import replace

    won = winner_of(plan, metrics)
    if won is None or won[2]:
        return mctx, plan
    info = plan.settings["selection"]
    cand_cfg, cand_plan = _candidate_plan(method, mctx.cfg, Candidate(won[0], won[1]), info["trial_target"],
                                          plan.n_train, info["delta"])
    return replace(mctx, cfg=cand_cfg), cand_plan


def below_no_prompt(metrics: dict) -> str | None:
    """The run summary's warning when the published prompt's RELEASED holdout accuracy is below the
    released "no prompt" reference (None when it is not, or when "no prompt" itself won)."""
    won = metrics.get(score_key("winner"))
    ref = metrics.get(score_key("no_prompt"))
    if metrics.get("selection.winner_is_no_prompt"):
        return None
    if won is None or ref is None or won >= ref:
        return None
    return (f"the published prompt's released holdout score {won:.4f} is below the released no-prompt "
            f"reference {ref:.4f} (both noisy, DP): the model without a prompt may serve better")


def describe_plan(cfg, method, plan, sizes, delta: float) -> dict[str, float]:
    """``privprompt plan``'s numbers of a selection plan (from :func:`plan_selection`, inside the
    run's sized plan), each with the release of the split sizes and at the run's δ: the whole
    selection's ε (the run's one entry), what ONE trial alone would cost (the costliest
    candidate's training ∥ its score), and the same trials under the other ways to select:
    ⌈E[K]⌉ trials composed naively, every candidate once composed, and random stopping
    (Papernot & Steinke at E[K])."""
    from privacy import accountant as acct

    from privacy.plan import with_size_release as composed

    def with_size_release(event, sizes):
        return composed(event, sizes.event)

    info = plan.settings["selection"]
    sel = cfg.selection
    candidates = [Candidate(c["name"], c["settings"], c["zero_shot"]) for c in info["candidates"]]
    train_events = {c.name: _candidate_plan(method, cfg, c, info["trial_target"], plan.n_train,
                                            info["delta"])[1].event for c in candidates if not c.zero_shot}
    sigma = float(info.get("score_noise_multiplier", RANDOM_STOPPING_SCORE_SIGMA))  # plans stored before it: 5
    trials = [psel.trial_event(train_events[c.name], sigma) for c in candidates
              if not c.zero_shot]
    distinct = list(dict.fromkeys(trials))  # candidates differing only in lr have the same event
    spends = [acct.spend(with_size_release(t, sizes), delta).epsilon for t in distinct]
    k = _math.ceil(trial_count(sel).mean)
    # k trials of the candidate whose k-fold composition costs most (trials calibrated alike can compose
    # very differently: more steps at more noise compose worse)
    naive = max(acct.spend(with_size_release(psel._composed(t, k), sizes), delta).epsilon for t in distinct)
    every = every_candidate_event(candidates, lambda c: train_events[c.name], sigma)
    stopping = mechanism_event(selection_event(candidates, lambda c: train_events[c.name], trial_count(sel), sigma),
                               sigma)
    return {"selection_epsilon": float(acct.spend(plan.event, delta).epsilon), "trial_epsilon": float(max(spends)),
            "mode": sel.mode, "metric": sel.metric, "score_noise_multiplier": sigma,
            "naive_epsilon": float(naive), "naive_trials": k, "expected_trials": float(trial_count(sel).mean),
            "candidates": len(candidates),
            "naive_candidates_epsilon": float(acct.spend(with_size_release(every, sizes), delta).epsilon),
            "random_stopping_epsilon": float(acct.spend(with_size_release(stopping, sizes), delta).epsilon)}


def trial_work(cfg, method, plan) -> dict:
    """A selection plan's expected model work for ``privprompt plan``'s estimate (public: the config
    and the released sizes): ``trainings`` — (steps, expected batch) of each training it expects (every
    trained candidate once; random stopping: E[K] trials of a candidate drawn uniformly, each counted at
    the candidates' mean) — and ``scores``, the holdout passes (one per candidate or trial, and no
    prompt's)."""
    info = plan.settings["selection"]
    candidates = [Candidate(c["name"], c["settings"], c["zero_shot"]) for c in info["candidates"]]
    work = []
    for c in candidates:
        if not c.zero_shot:
            settings = _candidate_plan(method, cfg, c, info["trial_target"], plan.n_train, info["delta"])[1].settings
            work.append((settings.get("steps"), settings.get("expected_batch")))
    if every_candidate(cfg.selection):
        return {"trainings": work, "scores": float(len(candidates))}
    k = float(trial_count(cfg.selection).mean)
    share = k / max(len(candidates), 1)  # each trial draws any of the candidates (no prompt among them)
    return {"trainings": work, "weight": share, "scores": k + 1.0}
