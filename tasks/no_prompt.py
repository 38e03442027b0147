"""Never worse than nothing (issue 41): a dp run's output compared with no prompt on the private
holdout through one released, accounted number, and what the run publishes after it.

The release (``privacy.plan.no_prompt_comparison``, its ε ``fallback.epsilon_share`` of the run's
target, in the plan as the release ``no_prompt``): D = Σ over the holdout rows of w·(right with the
prompt − right with no prompt), plus N(0, σ²) drawn from the run's SECRET DP randomness
(``tasks/randomness.py``, never the logged seed). A record moves D by ≤ 1; with a person unit each of a
person's n holdout rows weighs 1/n (``privacy.selection.one_vote_weights``), so a person moves it by
≤ 1; a record-level run charged per person (≤ k rows each) is charged the group event (σ/k). The
holdout is the partition's: each record (or person) is assigned by a keyed hash of itself alone,
disjoint from training (``tasks.data``). The prompt is scored as trained, on the model it was trained
on (``tasks.methodkit.holdout.holdout_predictions``: a row's prediction is a function of that row alone — row-own public
shapes on an accelerator and for an encoder on a CPU, else one row per pass, ``models.scoring.row_wise_logits``), as a
selection scores its candidates.

What follows is post-processing of the released D̃ (no further ε): the prompt loses when D̃ < 0; the
comparison is conclusive when |D̃| > 1.96 σ (a 95% two-sided band of the noise alone), else
inconclusive (a small holdout: noise dominates, and the run never calls the prompt "better"). With
``fallback.enabled`` (the default) a prompt that loses is not published: no prompt file, no
registered model; the published result is the model without a prompt (what the run's test accuracy
then measures). Conclusive or not, D̃ < 0 falls back: on a tie the safe choice is no prompt.

Public numbers only leave this module: D̃, σ, D̃ over the RELEASED holdout size and the decision.
"""

from __future__ import annotations

import numpy as np

from privacy.mechanisms import difference_with_and_without, gaussian_mechanism

from .methodkit import holdout as scoring
from .methods import PrivateRows

CONCLUSIVE_Z = 1.96  # |D̃| above z·σ: the noise alone exceeds it with probability 5%
DIFFERENCE = "no_prompt.released_difference"  # D̃ (records, or people with a person unit)
SIGMA = "no_prompt.noise_sigma"  # σ of its noise (records, or people)
GAIN = "no_prompt.released_gain"  # D̃ / the released holdout size: the accuracy gain over no prompt, noisy
FALLBACK = "no_prompt.fallback"  # 1: the prompt lost and no prompt was published
CONCLUSIVE = "no_prompt.conclusive"  # 1: |D̃| > 1.96 σ
TAG_FALLBACK = "result.fallback_to_no_prompt"
TAG_BELOW = "result.below_no_prompt"


def holdout_rows(part) -> PrivateRows:
    """The partition's private holdout rows (texts, labels, units)."""
    from .data import read_partition_split, read_partition_units

    return PrivateRows(*read_partition_split(part.holdout_path), units=read_partition_units(part.holdout_path))


def holdout_weights(cfg, holdout: PrivateRows) -> np.ndarray | None:
    """None (each row counts 1: a record unit, or a record-level run charged per person by group
    privacy) or, with a person unit, 1/n_u for each of person u's n_u rows (one vote per person)."""
    from privacy.selection import one_vote_weights

    if not cfg.data.user_unit:
        return None
    index = holdout.unit_index()
    if index is None:
        raise RuntimeError(f"the comparison with no prompt: data.privacy_unit is {cfg.data.privacy_unit!r} but the "
                           "holdout rows carry no units")
    return one_vote_weights(index[0])


def exact_difference(cfg, predict, prompt, holdout: PrivateRows) -> float:
    """D on ``holdout``: ``predict(prompt_or_None, rows)`` gives each row's label index. EXACT: a
    statistic of private data, released only by :func:`release` (and computed on synthetic rows by
    the neighbour harness)."""
    if not len(holdout):
        return 0.0
    labels = list(cfg.data.labels)
    y = np.array([labels.index(label) for label in holdout.labels])
    without = np.asarray(predict(None, holdout)) == y
    right = without if prompt is None else np.asarray(predict(prompt, holdout)) == y
    return difference_with_and_without(right, without, holdout_weights(cfg, holdout))


def release(mctx, plan, method, prompt, part, n_holdout: int) -> dict[str, float]:
    """The plan's ``no_prompt`` release for the trained ``prompt``: D̃ = D + N(0, σ²) (secret noise), its
    σ, and D̃ over the released holdout size ``n_holdout``. Stored with the run's DP output before the
    commit (a retry republishes it, never draws again)."""
    sigma = float(plan.no_prompt.event.noise_multiplier)
    holdout = holdout_rows(part)

    def predict(p, rows):
        return scoring.holdout_predictions(method, mctx, p, rows)

    exact = exact_difference(mctx.cfg, predict, prompt, holdout)
    noisy = float(gaussian_mechanism(exact, sigma, 1.0, mctx.randomness.numpy()))
    del exact, holdout
    return {DIFFERENCE: noisy, SIGMA: sigma, GAIN: noisy / max(int(n_holdout), 1)}


def decide(cfg, metrics: dict) -> dict[str, float]:
    """The decision from the released numbers (post-processing): {} without a comparison."""
    if DIFFERENCE not in metrics:
        return {}
    noisy, sigma = metrics[DIFFERENCE], metrics[SIGMA]
    return {FALLBACK: float(bool(cfg.fallback.enabled) and noisy < 0),
            CONCLUSIVE: float(abs(noisy) > CONCLUSIVE_Z * sigma)}


def note(metrics: dict) -> tuple[str | None, dict[str, str]]:
    """The run summary's line about the comparison (None: the prompt beat no prompt conclusively, or
    there was none) and the parent's tags (public numbers only)."""
    if DIFFERENCE not in metrics:
        return None, {}
    noisy, sigma = metrics[DIFFERENCE], metrics[SIGMA]
    conclusive = bool(metrics.get(CONCLUSIVE, abs(noisy) > CONCLUSIVE_Z * sigma))
    numbers = (f"released difference with no prompt on the holdout D̃ = {noisy:+.2f} (noise σ = {sigma:.2f}; "
               f"{'conclusive' if conclusive else f'inconclusive: within {CONCLUSIVE_Z} σ of 0, the holdout is small for the noise'})")
    if metrics.get(FALLBACK):
        return (f"the prompt lost to no prompt: {numbers}; NO prompt was published (fallback.enabled): the model "
                "without a prompt is the result", {TAG_FALLBACK: "true"})
    if noisy < 0:
        return (f"the prompt scored below no prompt: {numbers}; published anyway (fallback.enabled: false): the "
                "model without a prompt may serve better", {TAG_BELOW: "true"})
    if not conclusive:
        return f"the prompt is not shown to beat no prompt: {numbers}", {}
    return None, {}
