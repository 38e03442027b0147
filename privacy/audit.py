"""Membership-inference audit statistics: ROC / AUC, TPR at low FPR, LiRA, one-run ε lower bounds.

Pure numpy / scipy: no torch, Prefect, MLflow or scikit-learn here.

Conventions
-----------
* ``scores``: higher = more likely a member (an attack's "in" direction).
* ``is_member`` / ``is_included``: boolean, or numbers in {0, 1}.
* Thresholds are applied as ``score >= t`` (predicted member); ties between a member and a
  non-member therefore move the ROC curve diagonally, and count 1/2 in the AUC.
* TPR at FPR x is the highest TPR over data-chosen thresholds whose FPR is **≤ x** (no
  interpolation between ROC points). It needs at least 1/x non-members to mean anything; the
  result carries ``sufficient`` and :func:`require_enough_nonmembers` enforces it.

LiRA (Carlini et al. 2022, "Membership Inference Attacks From First Principles")
----------------------------------------------------------------------------------
Per example, Gaussians are fitted to the shadow models' logit-scaled confidences on it: the
"in" shadows (trained on it) and the "out" shadows. Online: the score is the log-likelihood ratio
``log N(x; μ_in, σ_in) − log N(x; μ_out, σ_out)``. Offline (out shadows only): the one-sided test
``log Φ((x − μ_out) / σ_out)``. Both: higher = more likely member.

One-run audit (Steinke, Nasr, Jagielski 2023, "Privacy Auditing with One (1) Training Run")
------------------------------------------------------------------------------------------
m canaries, each included independently with probability ½; the auditor guesses "in" / "out"
on r of them (abstaining on the rest) and gets v right. Under (ε, δ)-DP (their Theorem 5.2 / the
p-value of their Appendix D)::

    P[V ≥ v] ≤ P[Bin(r, q) ≥ v] + 2 m δ · max_{1≤i≤v} P[v − i ≤ Bin(r, q) < v] / i,
    q = e^ε / (1 + e^ε).

The lower bound at confidence 1 − β is ``sup{ε ≥ 0 : p-value(ε) < β}`` (0 when even ε = 0 is not
rejected). For δ = 0 this is closed form: ``logit`` of the one-sided Clopper–Pearson lower bound
of the accuracy, ``Beta.ppf(β; v, r − v + 1)``. An implementation whose audited lower bound
exceeds its accountant's ε is broken (NOTES.md) — up to the β chance of a false alarm.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import special, stats

from . import calibrate
from .validation import check_count, check_nonnegative, check_rate

__all__ = [
    "roc_curve",
    "auc",
    "auc_with_ci",
    "tpr_at_fpr",
    "require_enough_nonmembers",
    "min_nonmembers",
    "mia_metrics",
    "fpr_key",
    "logit_confidence",
    "lira_scores_online",
    "lira_scores_offline",
    "one_run_p_value",
    "one_run_epsilon_lower_bound",
    "one_run_audit",
    "best_one_run_audit",
]


# --------------------------------------------------------------------------------------------
# argument checks
# --------------------------------------------------------------------------------------------


def _check_confidence(value, name: str = "confidence") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) or not (
        0.0 < float(value) < 1.0
    ):
        raise ValueError(f"{name} must lie in (0, 1), got {value!r}")
    return float(value)


def _as_int(value):
    """numpy integers pass as Python ints; anything else is left for ``check_count`` to reject."""
    if isinstance(value, np.integer):
        return int(value)
    return value


def _as_scores(scores, name: str = "scores") -> np.ndarray:
    try:
        arr = np.asarray(scores, dtype=float)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a 1-D array of numbers, got {scores!r}") from exc
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} is empty")
    if not np.all(np.isfinite(arr)):
        bad = int(np.count_nonzero(~np.isfinite(arr)))
        raise ValueError(f"{name} must be finite, got {bad} NaN/inf value(s)")
    return arr


def _as_membership(is_member, n: int, name: str = "is_member") -> np.ndarray:
    arr = np.asarray(is_member)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.shape[0] != n:
        raise ValueError(f"{name} has length {arr.shape[0]} but scores has length {n}")
    if arr.dtype == bool:
        return arr
    if arr.dtype.kind not in "iuf":
        raise ValueError(f"{name} must be boolean or 0/1, got dtype {arr.dtype}")
    bad = ~np.isin(arr, (0, 1))
    if np.any(bad):
        raise ValueError(
            f"{name} must be boolean or 0/1, got value(s) {np.unique(arr[bad])[:5].tolist()}"
        )
    return arr.astype(bool)


def _scores_and_labels(scores, is_member, need_both: bool = True):
    s = _as_scores(scores)
    y = _as_membership(is_member, s.size)
    if need_both:
        n_members = int(np.count_nonzero(y))
        if n_members == 0:
            raise ValueError("is_member has no members (all False): need at least one of each")
        if n_members == y.size:
            raise ValueError("is_member has no non-members (all True): need at least one of each")
    return s, y


# --------------------------------------------------------------------------------------------
# ROC / AUC
# --------------------------------------------------------------------------------------------


def _roc_counts(s: np.ndarray, y: np.ndarray):
    """(fp, tp, thresholds) at every distinct score, descending, with (0, 0, +inf) first."""
    order = np.argsort(-s, kind="mergesort")
    s_sorted = s[order]
    y_sorted = y[order]
    # last index of each run of equal scores
    distinct = np.flatnonzero(np.diff(s_sorted) != 0)
    ends = np.r_[distinct, s_sorted.size - 1]
    tp = np.cumsum(y_sorted)[ends]
    fp = (ends + 1) - tp
    tp = np.r_[0, tp]
    fp = np.r_[0, fp]
    thresholds = np.r_[np.inf, s_sorted[ends]]
    return fp, tp, thresholds


def roc_curve(scores, is_member):
    """Exact ROC curve: ``(fpr, tpr, thresholds)``, one point per distinct score plus (0, 0).

    ``thresholds`` is descending; the point i is the rule "member iff score >= thresholds[i]"
    (``thresholds[0] = +inf`` predicts no member). Tied scores form one point, so ties move the
    curve diagonally. No intermediate points are dropped.
    """
    s, y = _scores_and_labels(scores, is_member)
    fp, tp, thresholds = _roc_counts(s, y)
    return fp / fp[-1], tp / tp[-1], thresholds


def _auc_from_sorted(s: np.ndarray, y: np.ndarray) -> float:
    ranks = stats.rankdata(s)  # average ranks: a tie counts 1/2
    n1 = int(np.count_nonzero(y))
    n0 = y.size - n1
    return float((ranks[y].sum() - n1 * (n1 + 1) / 2.0) / (n1 * n0))


def auc(scores, is_member) -> float:
    """Area under the ROC curve, P[score(member) > score(non-member)] + ½ P[tie] (Mann–Whitney)."""
    s, y = _scores_and_labels(scores, is_member)
    return _auc_from_sorted(s, y)


def auc_with_ci(scores, is_member, n_bootstrap: int = 1000, confidence: float = 0.95, rng=None):
    """``(auc, low, high)``: AUC with a stratified-bootstrap percentile interval.

    Members and non-members are resampled separately (with replacement, keeping their counts),
    ``n_bootstrap`` times; the interval is the (α/2, 1 − α/2) percentiles of the resampled AUCs.
    ``rng`` is a ``numpy.random.Generator`` (required, so runs are reproducible).
    """
    s, y = _scores_and_labels(scores, is_member)
    n_bootstrap = check_count(_as_int(n_bootstrap), "n_bootstrap", minimum=1)
    confidence = _check_confidence(confidence)
    if not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng must be a numpy.random.Generator, got {rng!r}")
    point = _auc_from_sorted(s, y)
    pos = s[y]
    neg = s[~y]
    n1, n0 = pos.size, neg.size
    # chunk so that a chunk holds about 4M scores
    chunk = max(1, min(n_bootstrap, 4_000_000 // (n1 + n0)))
    boots = []
    done = 0
    while done < n_bootstrap:
        b = min(chunk, n_bootstrap - done)
        sample = np.concatenate(
            [pos[rng.integers(0, n1, size=(b, n1))], neg[rng.integers(0, n0, size=(b, n0))]],
            axis=1,
        )
        ranks = stats.rankdata(sample, axis=1)
        boots.append((ranks[:, :n1].sum(axis=1) - n1 * (n1 + 1) / 2.0) / (n1 * n0))
        done += b
    boots = np.concatenate(boots)
    alpha = 1.0 - confidence
    low, high = np.quantile(boots, [alpha / 2.0, 1.0 - alpha / 2.0])
    return point, float(low), float(high)


# --------------------------------------------------------------------------------------------
# TPR at low FPR
# --------------------------------------------------------------------------------------------


def min_nonmembers(max_fpr: float) -> int:
    """Smallest number of non-members for which FPR ≤ ``max_fpr`` is resolvable: ⌈1/max_fpr⌉."""
    max_fpr = check_rate(max_fpr, "max_fpr")
    return int(math.ceil(1.0 / max_fpr - 1e-9))


def require_enough_nonmembers(n_nonmembers: int, max_fpr: float) -> None:
    """Raise ``ValueError`` unless ``n_nonmembers >= 1/max_fpr``."""
    n_nonmembers = check_count(_as_int(n_nonmembers), "n_nonmembers", minimum=0)
    needed = min_nonmembers(max_fpr)
    if n_nonmembers < needed:
        raise ValueError(
            f"a TPR estimate needs at least {needed} non-members for FPR <= {max_fpr:g}, "
            f"got {n_nonmembers}"
        )


def _clopper_pearson(k: int, n: int, confidence: float) -> tuple[float, float]:
    alpha = 1.0 - confidence
    low = 0.0 if k == 0 else float(stats.beta.ppf(alpha / 2.0, k, n - k + 1))
    high = 1.0 if k == n else float(stats.beta.ppf(1.0 - alpha / 2.0, k + 1, n - k))
    return low, high


def tpr_at_fpr(scores, is_member, max_fpr: float, confidence: float = 0.95) -> dict:
    """Highest TPR over thresholds "member iff score >= t" whose FPR is ≤ ``max_fpr``.

    Thresholds are chosen on the same data (no interpolation, no randomised rules). Returns a
    dict: ``tpr``, ``fpr`` (the achieved FPR: the smallest FPR reaching that TPR), ``max_fpr``,
    ``n_members``, ``n_nonmembers``, ``tpr_low`` / ``tpr_high`` (two-sided Clopper–Pearson
    interval of the TPR as a binomial proportion over the members — it does not account for the
    threshold having been picked on the non-members), and ``sufficient`` (``n_nonmembers >=
    1/max_fpr``; when False the number is still computed but is not a meaningful FPR-x figure).
    """
    s, y = _scores_and_labels(scores, is_member)
    max_fpr = check_rate(max_fpr, "max_fpr")
    confidence = _check_confidence(confidence)
    fp, tp, _ = _roc_counts(s, y)
    n1, n0 = int(tp[-1]), int(fp[-1])
    ok = np.flatnonzero(fp / n0 <= max_fpr)  # non-empty: the (0, 0) point always qualifies
    best_tp = int(tp[ok[-1]])
    first = ok[np.argmax(tp[ok] == best_tp)]  # smallest fp reaching best_tp
    low, high = _clopper_pearson(best_tp, n1, confidence)
    return {
        "tpr": best_tp / n1,
        "fpr": int(fp[first]) / n0,
        "max_fpr": max_fpr,
        "n_members": n1,
        "n_nonmembers": n0,
        "tpr_low": low,
        "tpr_high": high,
        "sufficient": bool(n0 >= min_nonmembers(max_fpr)),
    }


def fpr_key(max_fpr: float) -> str:
    """Metric name of a TPR at FPR: 0.01 -> ``tpr_at_1pct_fpr``, 0.001 -> ``tpr_at_0.1pct_fpr``."""
    pct = float(f"{max_fpr * 100:.10g}")
    return f"tpr_at_{pct:g}pct_fpr"


def mia_metrics(
    scores,
    is_member,
    rng,
    fprs: Sequence[float] = (0.01, 0.001),
    n_bootstrap: int = 1000,
    confidence: float = 0.95,
) -> dict:
    """Flat dict of float metrics for one attack (callers prefix keys with ``mia.<attack>.``).

    Keys: ``auc``, ``auc_low``, ``auc_high``; per FPR x in ``fprs`` (see :func:`fpr_key`):
    ``tpr_at_<x>pct_fpr`` and its ``_low``, ``_high`` (Clopper–Pearson) and ``_sufficient``
    (1.0 / 0.0: enough non-members for that FPR; the TPR is reported either way); and
    ``n_members``, ``n_nonmembers``. Comparison is FPR ≤ x.
    """
    s, y = _scores_and_labels(scores, is_member)
    value, low, high = auc_with_ci(s, y, n_bootstrap=n_bootstrap, confidence=confidence, rng=rng)
    out = {"auc": value, "auc_low": low, "auc_high": high}
    for x in fprs:
        res = tpr_at_fpr(s, y, x, confidence=confidence)
        key = fpr_key(res["max_fpr"])
        out[key] = float(res["tpr"])
        out[f"{key}_low"] = float(res["tpr_low"])
        out[f"{key}_high"] = float(res["tpr_high"])
        out[f"{key}_sufficient"] = 1.0 if res["sufficient"] else 0.0
    n1 = int(np.count_nonzero(y))
    out["n_members"] = float(n1)
    out["n_nonmembers"] = float(y.size - n1)
    return out


# --------------------------------------------------------------------------------------------
# LiRA
# --------------------------------------------------------------------------------------------


def logit_confidence(p_true, eps: float = 1e-12):
    """``log(p / (1 − p))`` of the true-label probability, with p clipped to [eps, 1 − eps]."""
    eps = _check_clip_eps(eps)
    p = np.asarray(p_true, dtype=float)
    if np.any(np.isnan(p)) or np.any((p < 0) | (p > 1)):
        raise ValueError("p_true must be probabilities in [0, 1]")
    p = np.clip(p, eps, 1.0 - eps)
    out = np.log(p) - np.log1p(-p)
    return float(out) if out.ndim == 0 else out


def _check_clip_eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0.0 < eps < 0.5):
        raise ValueError(f"eps must lie in (0, 0.5), got {eps!r}")
    return float(eps)


def _lira_inputs(target_scores, shadow_scores, shadow_in_mask):
    x = _as_scores(target_scores, "target_scores")
    sh = np.asarray(shadow_scores, dtype=float)
    if sh.ndim != 2:
        raise ValueError(f"shadow_scores must be 2-D (n_shadows, n_examples), got shape {sh.shape}")
    if sh.shape[1] != x.size:
        raise ValueError(
            f"shadow_scores has {sh.shape[1]} examples but target_scores has {x.size}"
        )
    if sh.shape[0] == 0:
        raise ValueError("shadow_scores has no shadow models")
    if not np.all(np.isfinite(sh)):
        raise ValueError("shadow_scores must be finite")
    mask = np.asarray(shadow_in_mask)
    if mask.shape != sh.shape:
        raise ValueError(
            f"shadow_in_mask has shape {mask.shape} but shadow_scores has shape {sh.shape}"
        )
    if mask.dtype != bool:
        if mask.dtype.kind not in "iuf" or np.any(~np.isin(mask, (0, 1))):
            raise ValueError("shadow_in_mask must be boolean or 0/1")
        mask = mask.astype(bool)
    return x, sh, mask


def _gaussian_fit(sh: np.ndarray, sel: np.ndarray, fix_variance: bool, which: str):
    """Per-example mean and std of ``sh`` over the shadows where ``sel``; global fallbacks.

    * mean: per-example mean; examples with no selected shadow get the global mean of all
      selected scores.
    * std: ``fix_variance`` → one pooled within-example std (deviations from each example's own
      mean, over examples with ≥ 2 selected shadows; if there are none, the std of all selected
      scores). Otherwise per-example std (ddof=1), falling back to the pooled std for examples
      with fewer than 2 selected shadows.
    """
    count = sel.sum(axis=0)
    if count.sum() == 0:
        raise ValueError(f"shadow_in_mask leaves no {which} shadow score for any example")
    total = np.where(sel, sh, 0.0).sum(axis=0)
    global_mean = total.sum() / count.sum()
    mean = np.where(count > 0, total / np.maximum(count, 1), global_mean)
    dev2 = np.where(sel, (sh - mean) ** 2, 0.0).sum(axis=0)
    multi = count >= 2
    if np.any(multi):
        pooled_var = dev2[multi].sum() / (count[multi] - 1).sum()
    else:
        pooled_var = np.where(sel, (sh - global_mean) ** 2, 0.0).sum() / max(count.sum() - 1, 1)
    tiny = 1e-30
    pooled_std = math.sqrt(max(pooled_var, 0.0)) + tiny
    if fix_variance:
        std = np.full(sh.shape[1], pooled_std)
    else:
        per = np.sqrt(dev2 / np.maximum(count - 1, 1)) + tiny
        std = np.where(multi, per, pooled_std)
    return mean, std


def lira_scores_online(target_scores, shadow_scores, shadow_in_mask, fix_variance: bool = True):
    """Online LiRA: ``log N(x; μ_in, σ_in) − log N(x; μ_out, σ_out)`` per example.

    ``target_scores`` (n_examples,): the target model's logit-scaled confidence
    (:func:`logit_confidence`) on each example; ``shadow_scores`` (n_shadows, n_examples): the
    same for each shadow model; ``shadow_in_mask`` (n_shadows, n_examples): whether each shadow
    trained on each example. ``fix_variance=True`` (the paper's choice with few shadows) uses one
    pooled within-example std per side; False fits per-example stds. Examples with no in (or no
    out) shadow use the global mean of that side; per-example stds with fewer than 2 shadows use
    the pooled std. Higher = more likely member.
    """
    x, sh, mask = _lira_inputs(target_scores, shadow_scores, shadow_in_mask)
    mu_in, sd_in = _gaussian_fit(sh, mask, fix_variance, "in")
    mu_out, sd_out = _gaussian_fit(sh, ~mask, fix_variance, "out")
    return stats.norm.logpdf(x, mu_in, sd_in) - stats.norm.logpdf(x, mu_out, sd_out)


def lira_scores_offline(target_scores, shadow_scores, shadow_in_mask, fix_variance: bool = True):
    """Offline LiRA (out shadows only): ``log Φ((x − μ_out) / σ_out)`` per example.

    The one-sided test of the paper: the log-probability that an out-model's score is below the
    observed one. Same inputs and fallbacks as :func:`lira_scores_online` (``shadow_in_mask``
    only selects the out shadows). Higher = more likely member.
    """
    x, sh, mask = _lira_inputs(target_scores, shadow_scores, shadow_in_mask)
    mu_out, sd_out = _gaussian_fit(sh, ~mask, fix_variance, "out")
    return stats.norm.logcdf((x - mu_out) / sd_out)


def unit_scores(scores, units, how: str = "sum") -> np.ndarray:
    """Per-unit attack scores from per-example ones (membership of a UNIT: its records were in
    training, issue 28): ``units`` (n,) unit index 0..U-1 per example; ``sum`` (log-likelihood
    ratios such as LiRA's: the unit's likelihood ratio, its records taken as independent) or
    ``mean`` (losses, confidences). Returns (U,)."""
    scores, units = np.asarray(scores, dtype=float), np.asarray(units, dtype=np.int64)
    if scores.shape != units.shape:
        raise ValueError(f"scores {scores.shape} and units {units.shape} must have one entry per example")
    if how not in ("sum", "mean"):
        raise ValueError(f"how must be 'sum' or 'mean', got {how!r}")
    total = np.bincount(units, weights=scores)
    return total if how == "sum" else total / np.bincount(units)


def unit_labels(member, units) -> np.ndarray:
    """(U,) membership of each unit from its examples' (all equal within a unit, else an error)."""
    member, units = np.asarray(member, dtype=bool), np.asarray(units, dtype=np.int64)
    n_in = np.bincount(units, weights=member.astype(float))
    n = np.bincount(units)
    if np.any((n_in > 0) & (n_in < n)):
        raise ValueError("a unit's examples must be all members or all non-members")
    return n_in > 0


# --------------------------------------------------------------------------------------------
# one-run audit
# --------------------------------------------------------------------------------------------


def _check_guess_counts(num_guesses, num_correct, delta, num_canaries):
    r = check_count(_as_int(num_guesses), "num_guesses", minimum=0)
    v = check_count(_as_int(num_correct), "num_correct", minimum=0)
    if v > r:
        raise ValueError(f"num_correct must be <= num_guesses={r}, got {v}")
    delta = check_nonnegative(delta, "delta")
    if delta >= 1.0:
        raise ValueError(f"delta must lie in [0, 1), got {delta!r}")
    m = None
    if num_canaries is not None:
        m = check_count(_as_int(num_canaries), "num_canaries", minimum=0)
        if m < r:
            raise ValueError(f"num_canaries must be >= num_guesses={r}, got {m}")
    if delta > 0 and m is None:
        raise ValueError("num_canaries is required when delta > 0 (the δ term scales with m)")
    return r, v, delta, m


def _p_value(r: int, v: int, epsilon: float, delta: float, m: int | None) -> float:
    if v == 0:
        return 1.0
    q = float(special.expit(epsilon))
    beta = float(stats.binom.sf(v - 1, r, q))  # P[Bin(r, q) >= v]
    if delta == 0.0:
        return min(beta, 1.0)
    # S_i = P[v - i <= Bin(r, q) < v] for i = 1..v; alpha = max_i S_i / i
    pmf = stats.binom.pmf(np.arange(v - 1, -1, -1), r, q)  # pmf(v-1), pmf(v-2), ..., pmf(0)
    s_i = np.cumsum(pmf)
    alpha = float(np.max(s_i / np.arange(1, v + 1)))
    return min(beta + 2.0 * m * delta * alpha, 1.0)


def one_run_p_value(
    num_guesses: int,
    num_correct: int,
    epsilon: float,
    delta: float = 0.0,
    num_canaries: int | None = None,
) -> float:
    """Upper bound on P[≥ num_correct correct of num_guesses] for any (ε, δ)-DP algorithm.

    Steinke, Nasr, Jagielski (2023), Theorem 5.2 (δ = 0: Theorem 3.1). ``num_canaries`` (m, all
    canaries including abstentions) is needed only when ``delta > 0``.
    """
    r, v, delta, m = _check_guess_counts(num_guesses, num_correct, delta, num_canaries)
    epsilon = check_nonnegative(epsilon, "epsilon")
    return _p_value(r, v, epsilon, delta, m)


def one_run_epsilon_lower_bound(
    num_guesses: int,
    num_correct: int,
    delta: float = 0.0,
    confidence: float = 0.95,
    num_canaries: int | None = None,
) -> float:
    """Largest ε such that (ε, δ)-DP is rejected at level β = 1 − confidence; 0.0 if none.

    ε_lb = sup{ε ≥ 0 : p-value(ε) < β} with :func:`one_run_p_value`. δ = 0 is closed form
    (Clopper–Pearson); δ > 0 (which needs ``num_canaries``) is found by bisection to ~1e-9.
    """
    r, v, delta, m = _check_guess_counts(num_guesses, num_correct, delta, num_canaries)
    beta = 1.0 - _check_confidence(confidence)
    if v == 0:
        return 0.0
    if delta == 0.0:
        # P[Bin(r, q) >= v] = I_q(v, r - v + 1) increases in q; it equals β at the CP bound
        q_star = float(stats.beta.ppf(beta, v, r - v + 1))
        if q_star <= 0.5:
            return 0.0
        return max(0.0, float(special.logit(q_star)))
    if _p_value(r, v, 0.0, delta, m) >= beta:
        return 0.0
    def rejected(eps: float) -> bool:  # (ε, δ)-DP is rejected at level β: ε is below the bound
        return _p_value(r, v, eps, delta, m) < beta

    # invariant: p(lo) < β; hi doubled from 1 while rejected (q rounds to 1 well before 64, where p = 1)
    last, hi = calibrate.walk(rejected, 1.0, lambda e: None if 2.0 * e > 64.0 else 2.0 * e)
    if hi is None:
        return last
    lo = 0.0 if last is None else last
    return calibrate.search(rejected, good=lo, bad=hi, good_is_high=False, propose=calibrate.arithmetic,
                            narrow=calibrate.width_within(1e-9), max_tests=100).good


def one_run_audit(
    scores,
    is_included,
    k_positive: int,
    k_negative: int,
    delta: float = 0.0,
    confidence: float = 0.95,
) -> dict:
    """One-run audit with fixed guess counts: the ``k_positive`` highest scores are guessed "in",
    the ``k_negative`` lowest "out", the rest abstained on; ties in score are broken by position.

    ``scores``: one per canary (higher = looks included); ``is_included``: the canaries' actual
    inclusion, which must have been drawn independently with probability ½ each. Choose
    ``k_positive`` / ``k_negative`` before looking at the outcome (or use
    :func:`best_one_run_audit`, which corrects for trying several). Returns
    ``epsilon_lower_bound``, ``num_guesses``, ``num_correct``, ``k_positive``, ``k_negative``.
    """
    s = _as_scores(scores)
    inc = _as_membership(is_included, s.size, "is_included")
    m = s.size
    k_pos = check_count(_as_int(k_positive), "k_positive", minimum=0)
    k_neg = check_count(_as_int(k_negative), "k_negative", minimum=0)
    if k_pos + k_neg > m:
        raise ValueError(
            f"k_positive + k_negative must be <= the number of canaries {m}, got {k_pos + k_neg}"
        )
    order = np.argsort(-s, kind="mergesort")  # descending, stable
    guessed_in = order[:k_pos]
    guessed_out = order[m - k_neg:] if k_neg else order[:0]
    v = int(np.count_nonzero(inc[guessed_in]) + np.count_nonzero(~inc[guessed_out]))
    r = k_pos + k_neg
    eps_lb = one_run_epsilon_lower_bound(
        r, v, delta=delta, confidence=confidence, num_canaries=m
    )
    return {
        "epsilon_lower_bound": eps_lb,
        "num_guesses": r,
        "num_correct": v,
        "k_positive": k_pos,
        "k_negative": k_neg,
    }


def best_one_run_audit(
    scores,
    is_included,
    ks: Sequence[tuple[int, int]] | None = None,
    delta: float = 0.0,
    confidence: float = 0.95,
    correct_for_multiple: bool = True,
) -> dict:
    """Try several ``(k_positive, k_negative)`` pairs and return the best :func:`one_run_audit`.

    Picking the best k after seeing the outcome inflates the bound; with
    ``correct_for_multiple=True`` (default) each try runs at level β / len(ks) (Bonferroni), so
    the reported bound keeps confidence ``confidence`` overall. With False the result is the
    optimistic post-hoc maximum, valid only if the caller accepts that. ``ks`` defaults to
    k_positive = k_negative = m/20, m/10, m/4, m/2 (rounded down, at least 1, duplicates dropped).
    The result adds ``num_tried`` and ``confidence_per_try`` to :func:`one_run_audit`'s keys.
    """
    s = _as_scores(scores)
    m = s.size
    confidence = _check_confidence(confidence)
    if ks is None:
        ks = list(dict.fromkeys((max(1, m // d), max(1, m // d)) for d in (20, 10, 4, 2)))
        ks = [k for k in ks if k[0] + k[1] <= m] or [(m // 2, m - m // 2)]
    ks = list(ks)
    if not ks:
        raise ValueError("ks must hold at least one (k_positive, k_negative) pair, got []")
    for k in ks:
        if not (isinstance(k, (tuple, list)) and len(k) == 2):
            raise ValueError(f"ks must hold (k_positive, k_negative) pairs, got {k!r}")
    beta = 1.0 - confidence
    per_try = 1.0 - beta / len(ks) if correct_for_multiple else confidence
    best = None
    for k_pos, k_neg in ks:
        res = one_run_audit(s, is_included, k_pos, k_neg, delta=delta, confidence=per_try)
        if best is None or res["epsilon_lower_bound"] > best["epsilon_lower_bound"]:
            best = res
    best = dict(best)
    best["num_tried"] = len(ks)
    best["confidence_per_try"] = per_try
    return best


def precision_at_lowest_loss(scores, is_member, fraction: float = 0.01) -> dict:
    """Privacy-Flat §4.2: the share of members among the ``fraction`` of examples the attack
    ranks most member-like (highest score = lowest loss), beside the base rate (the share of
    members overall). Keys: ``precision_at_<x>pct``, ``precision_base_rate``, ``precision_n``."""
    s, y = _scores_and_labels(scores, is_member)
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must lie in (0, 1], got {fraction}")
    k = max(1, int(round(fraction * s.size)))
    top = np.argsort(-s, kind="stable")[:k]
    label = f"{100 * fraction:g}".replace(".", "_")
    return {f"precision_at_{label}pct": float(np.mean(y[top])), "precision_base_rate": float(np.mean(y)),
            "precision_n": float(k)}
