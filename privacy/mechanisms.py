"""Randomised mechanisms: the noise that the events in ``events.py`` account for.

Every mechanism takes an explicit ``rng: numpy.random.Generator``; nothing here touches a global
random state. Build one with :func:`make_rng` (seeded for reproducible experiments, OS-entropy
seeded for production).

Mapping to the accounting events (``privacy/events.py``):

==========================================================  ==========================================
mechanism call                                              event
==========================================================  ==========================================
``gumbel_argmax(scores, 1/e, rng)`` (score sensitivity 1)   ``ExponentialEvent(2e, False)``, or
                                                            ``ExponentialEvent(e, True)`` if monotone
``exponential_mechanism(scores, eps, rng, Δ, monotone)``    ``ExponentialEvent(eps, monotone)``
                                                            (``exponential_mechanism_event``)
``dp_argmax(counts, eps, rng)``                             ``ExponentialEvent(eps, monotone=True)``
``limited_domain_top1(counts, eps0, delta0, rng)``          ``LimitedDomainEvent(eps0, delta0)``
``gaussian_mechanism(x, σ, Δ, rng)``                        ``GaussianEvent(σ)`` (Δ = L2 sensitivity)
``distribution_vote(P, σ, rng)`` (one row per disjoint      ``GaussianEvent(σ)``
subset)
``dx_privatize_*(…, eta, rng)``                             d_X privacy (metric DP); no (ε, δ) event
==========================================================  ==========================================

References
----------
[MT07] McSherry & Talwar, FOCS 2007 (exponential mechanism). [DR14] Dwork & Roth 2014 (Def. 3.4 /
Thm. 3.10: exponential mechanism; Thm. 3.22: Gaussian mechanism). [DuR19] Durfee & Rogers, NeurIPS
2019 (Gumbel-max = exponential mechanism; LimitedDomain). [Hong24] Hong et al., DP-OPT, ICLR 2024
(LimitedDomain token generation; DP-argmax prompt selection). [Fey20] Feyisetan et al., WSDM 2020
(d_X noise: radius ~ Gamma(d, 1/η), uniform direction). [Tang24] Tang et al., DP few-shot
generation, ICLR 2024 (Gaussian-noised aggregate of next-token distributions). [Li23] Li et al.,
RAPT, 2023 (token-level d_X privatisation by nearest-neighbour replacement).

Caveat: the samplers are numpy's floating-point PCG64 draws. ``make_rng(secure=True)`` (``rng.secret_rng``) seeds
the generator from the OS CSPRNG, but the generator itself is not a CSPRNG, and floating-point
sampling has the known side-channels (Mironov, CCS 2012); fine for research, not a hardened
implementation.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import softmax

from .rng import secret_rng, seeded_rng
from .validation import check_count, check_delta, check_epsilon, check_positive

# Largest number of float entries a chunked computation materialises at once (~32 MiB of float64).
_CHUNK_ELEMENTS = 1 << 22


# ---- helpers ----------------------------------------------------------------------------------

def _scalar(value):
    """numpy scalars -> Python scalars, so the shared validation helpers accept them."""
    return value.item() if isinstance(value, np.generic) else value


def _check_rng(rng) -> np.random.Generator:
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator (see make_rng), got {rng!r}")
    return rng


def _check_scores(scores, name: str = "scores") -> np.ndarray:
    """A non-empty 1-D array of finite floats."""
    try:
        arr = np.asarray(scores, dtype=float)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a 1-D array of numbers, got {scores!r}") from None
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array, got shape {arr.shape}: {scores!r}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite, got {scores!r}")
    return arr


def make_rng(seed: int | None = None, secure: bool = False) -> np.random.Generator:
    """The random generator every mechanism takes (kept for callers; see ``privacy/rng.py``).

    * ``seed=<int>``: :func:`privacy.rng.seeded_rng`, reproducible (tests/debug only).
    * ``secure=True`` or ``seed=None``: :func:`privacy.rng.secret_rng`, 256 bits of OS entropy.
    """
    if secure and seed is not None:
        raise ValueError(f"seed must be None when secure=True, got {seed!r}")
    if seed is None:
        return secret_rng()
    return seeded_rng(_scalar(seed))


# ---- exponential mechanism via Gumbel-max -----------------------------------------------------

def gumbel_argmax(scores, noise_scale: float, rng: np.random.Generator) -> int:
    """argmax_i (score_i + G_i), G_i i.i.d. Gumbel(0, ``noise_scale``).

    The Gumbel-max trick [DuR19]: the winner is distributed exactly as
    P[i] ∝ exp(score_i / noise_scale), i.e. the exponential mechanism [MT07]. With score
    sensitivity 1 and ``noise_scale = 1/e`` this is ``ExponentialEvent(e, monotone)``:
    2e-DP for general scores, e-DP for monotone scores.
    """
    return int(gumbel_argmax_many(scores, noise_scale, rng, size=1)[0])


def gumbel_argmax_many(scores, noise_scale: float, rng: np.random.Generator, size: int) -> np.ndarray:
    """``size`` independent :func:`gumbel_argmax` draws on the same scores (int array)."""
    scores = _check_scores(scores)
    noise_scale = check_positive(_scalar(noise_scale), "noise_scale")
    size = check_count(_scalar(size), "size", minimum=1)
    rng = _check_rng(rng)
    rows = max(1, _CHUNK_ELEMENTS // scores.size)
    out = np.empty(size, dtype=np.int64)
    for start in range(0, size, rows):
        stop = min(size, start + rows)
        noise = rng.gumbel(0.0, noise_scale, size=(stop - start, scores.size))
        out[start:stop] = np.argmax(scores + noise, axis=1)
    return out


def exponential_mechanism_noise_scale(epsilon: float, sensitivity: float = 1.0,
                                      monotone: bool = False) -> float:
    """Gumbel scale giving an ε-DP exponential mechanism [DR14, Thm. 3.10].

    General scores: P ∝ exp(ε·s/(2Δ)) -> scale 2Δ/ε. Monotone scores (all scores move in the
    same direction between neighbours, e.g. counts): P ∝ exp(ε·s/Δ) -> scale Δ/ε.
    """
    epsilon = check_epsilon(_scalar(epsilon), "epsilon")
    sensitivity = check_positive(_scalar(sensitivity), "sensitivity")
    return (1.0 if monotone else 2.0) * sensitivity / epsilon


def exponential_mechanism(scores, epsilon: float, rng: np.random.Generator,
                          sensitivity: float = 1.0, monotone: bool = False) -> int:
    """ε-DP exponential mechanism [MT07]: index i with P ∝ exp(ε·s_i/(2Δ)) (monotone: exp(ε·s_i/Δ)).

    ``epsilon`` is the pure-DP guarantee in both cases, and the accounting event of the call is
    ``exponential_mechanism_event(epsilon, monotone)`` = ``ExponentialEvent(epsilon, monotone)``
    — the same ε, never ε/2 (an earlier docstring said ε/2 for general scores: that under-counts
    the measured privacy loss two-fold; tests measure it on neighbouring inputs).
    """
    scale = exponential_mechanism_noise_scale(epsilon, sensitivity, monotone)
    return gumbel_argmax(scores, scale, rng)


def exponential_mechanism_event(epsilon: float, monotone: bool = False):
    """The event that accounts one :func:`exponential_mechanism` call with these arguments."""
    from .events import ExponentialEvent

    return ExponentialEvent(check_epsilon(_scalar(epsilon), "epsilon"), bool(monotone))


def exponential_mechanism_probabilities(scores, epsilon: float, sensitivity: float = 1.0,
                                        monotone: bool = False) -> np.ndarray:
    """The exact output distribution of :func:`exponential_mechanism` (a softmax)."""
    scale = exponential_mechanism_noise_scale(epsilon, sensitivity, monotone)
    return softmax(_check_scores(scores) / scale)


def dp_argmax(counts, epsilon: float, rng: np.random.Generator) -> int:
    """DP-OPT's private prompt selection [Hong24]: Gumbel(1/ε) noise on the validation
    correct-counts, return the noisy argmax. Counts are monotone with sensitivity 1, so this is
    ε-DP, accounted as ``ExponentialEvent(ε, monotone=True)`` (= ``tasks.methods.dp_opt.events.selection_event(ε)``)."""
    epsilon = check_epsilon(_scalar(epsilon), "epsilon")
    return gumbel_argmax(counts, 1.0 / epsilon, rng)


# ---- LimitedDomain (Durfee & Rogers 2019), as used by DP-OPT -----------------------------------

def _check_limited_domain_args(counts, epsilon0, delta0, k_bar, l0_sensitivity, domain_size):
    counts = _check_scores(counts, "counts")
    if np.any(counts < 0):
        raise ValueError(f"counts must be >= 0 (vote counts), got {counts.tolist()!r}")
    epsilon0 = check_epsilon(_scalar(epsilon0), "epsilon0")
    delta0 = check_delta(_scalar(delta0), "delta0")
    k_bar = check_count(_scalar(k_bar), "k_bar", minimum=1)
    l0_sensitivity = check_count(_scalar(l0_sensitivity), "l0_sensitivity", minimum=1)
    d = counts.size if domain_size is None else check_count(_scalar(domain_size), "domain_size", minimum=1)
    if d < counts.size:
        raise ValueError(f"domain_size must be >= len(counts) = {counts.size}, got {domain_size!r}")
    return counts, epsilon0, delta0, k_bar, l0_sensitivity, d


def _top_counts(counts: np.ndarray, how_many: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices, counts) of the ``how_many`` largest counts of the domain, largest first.

    The domain has ``d`` tokens: ``counts[i]`` for i < len(counts), 0 for the rest. Ties go to
    the lower index, so a missing token (count 0, index >= len(counts)) only enters the top when
    fewer than ``how_many`` counts were given.
    """
    how_many = min(how_many, d)
    order = np.argsort(-counts, kind="stable")[:how_many]
    pad = how_many - order.size
    indices = np.concatenate([order, np.arange(counts.size, counts.size + pad)])
    return indices, np.concatenate([counts[order], np.zeros(pad)])


# How far above h(k̄+1) a token of the top k̄ can stand and still leave the top k̄ in a neighbour:
# 2 when one record can MOVE a vote (its count −1 and a token two below it +1, winning the tie);
# 1 would do only if votes were never moved, just added or removed. See limited_domain_top1.
_BOUNDARY_GAP = 2.0


def _threshold(counts, epsilon0, delta0, k_bar, l0_sensitivity, d) -> float | None:
    if k_bar >= d:
        return None
    _, top = _top_counts(counts, k_bar + 1, d)
    return float(top[k_bar] + _BOUNDARY_GAP
                 + limited_domain_noise_scale(epsilon0)
                 * math.log(min(l0_sensitivity, k_bar, d - k_bar) / delta0))


def limited_domain_noise_scale(epsilon0: float) -> float:
    """Gumbel scale 2Δ∞/ε0 (Δ∞ = 1: one record moves one vote) of DP-OPT's Algorithm 4.

    This makes each query the ε0-DP exponential mechanism that ``LimitedDomainEvent(ε0, δ0)``
    accounts for. DP-OPT's reference code uses scale 1/ε0 (NOTES.md) with the same accounting;
    a moved vote changes two counts, so that noise is only 2ε0-DP and its ε is not a bound.
    """
    return 2.0 / epsilon0


def limited_domain_threshold(counts, epsilon0: float, delta0: float, k_bar: int = 10,
                             l0_sensitivity: int = 2, domain_size: int | None = None) -> float | None:
    """The noiseless threshold h⊥ = h(k̄+1) + 2 + (2/ε0)·ln(min(Δ0, k̄, d−k̄)/δ0).

    h(k̄+1) is the (k̄+1)-th largest count of the domain (0 when fewer counts are given), Δ0 the
    ℓ0 sensitivity of the histogram (how many counts one record can change: 2 when a vote can
    move), d the domain size. ``None`` when k̄ >= d: every token is a candidate, no threshold.

    Durfee & Rogers (2019) and DP-OPT [Hong24, Algorithm 4] write "+ 1" (and the reference code
    Gumbel scale 1/ε0, NOTES.md). "+ 1" holds when a record adds or removes one vote; when it
    MOVES one (one count −1, another +1), a token at h(k̄+1) + 2 can leave the top k̄ on a tie
    and its probability under one dataset has no counterpart under the other: the realised δ
    reaches e^{ε0/2}·δ0/2 per bad token (2.24·δ0 at ε0 = 3). The proof of (ε0, δ0) with "+ 2" is
    in :func:`limited_domain_top1`; ``tests/accounting/test_limited_domain_exact.py`` checks it exactly.
    """
    return _threshold(*_check_limited_domain_args(counts, epsilon0, delta0, k_bar,
                                                  l0_sensitivity, domain_size))


def limited_domain_top1(counts, epsilon0: float, delta0: float, rng: np.random.Generator,
                        k_bar: int = 10, l0_sensitivity: int = 2,
                        domain_size: int | None = None) -> int | None:
    """LimitedDomain top-1 [DuR19], DP-OPT's per-token vote aggregation [Hong24].

    1. Take the k̄ largest counts h(1) >= … >= h(k̄) of the domain (ties to the lower index).
    2. Add i.i.d. Gumbel(0, b) noise, b = 2/ε0 (:func:`limited_domain_noise_scale`), to each of
       them and, with its own draw, to the threshold h⊥ (:func:`limited_domain_threshold`).
    3. Return the index of the noisy maximum if it is >= the noisy threshold, else ``None`` (⊥).
       When k̄ >= d there is no threshold: plain Gumbel-max over the domain, never ⊥.

    ``counts`` is the histogram over the domain (e.g. the vocabulary), dense. With
    ``domain_size`` > len(counts) the remaining tokens have count 0 and carry the indices
    len(counts), …, d−1. Accounting: ``LimitedDomainEvent(ε0, δ0)``.

    **Privacy** ((ε0, δ0)-DP for neighbouring histograms: one vote moved, added or removed).
    By the Gumbel-max trick the output is exactly the softmax of s/b over the outcomes
    T(D) ∪ {⊥}, T(D) the top-k̄ set, s_⊥ = h⊥(D). Let D' be a neighbour, B = T(D) ∖ T(D'),
    m = min(Δ0, k̄, d−k̄).

    (a) |B| <= m: |B| = |T(D') ∖ T(D)| <= k̄ and <= d − k̄. A token of T(D) whose count did not
        fall leaves only if the one token whose count rose passes it, which can push out just
        the k̄-th; with the one token whose count fell, at most 2 = Δ0 leave.
    (b) Every o in B has s_o(D) <= h(k̄+1)(D) + 2: in D' at least k̄ tokens rank at or above o,
        whose counts in D are >= s_o(D') − 1 >= s_o(D) − 2 (at most one count rises, at most
        one falls), so k̄ + 1 tokens of D have counts >= s_o(D) − 2. Hence
        h⊥(D) − s_o(D) >= b·ln(m/δ0), and P_D[o] <= P[o's noisy count beats ⊥'s]
        = 1/(1 + e^{(h⊥ − s_o)/b}) < δ0/m. So P_D[B] < δ0.
    (c) For o in T(D) ∩ T(D') or ⊥: every score moves by at most 1 (counts, and h(k̄+1), an
        order statistic), so e^{s_o/b} <= e^{1/b}·e^{s'_o/b}. For the normalisers, pair each
        token entering T(D') with a distinct one of B: it ranked below it in D, so its new
        count is <= that token's count + 1; hence Z_{D'} <= e^{1/b}·Z_D, and
        P_D[o] <= e^{2/b}·P_{D'}[o] = e^{ε0}·P_{D'}[o].
    So for every set E of outcomes, P_D[E] <= e^{ε0}·P_{D'}[E ∖ B] + P_D[B] <= e^{ε0}·P_{D'}[E] + δ0,
    and the same with D, D' swapped (the relation is symmetric). With k̄ >= d there is no B and
    (c) alone gives ε0-DP.

    For DP-OPT the vote histogram must have these neighbours: one record changes at most one
    member's vote (``tasks/methods/dp_opt/method.py`` assigns each record to a member on its own).
    """
    rng = _check_rng(rng)
    args = _check_limited_domain_args(counts, epsilon0, delta0, k_bar, l0_sensitivity, domain_size)
    counts, epsilon0, _, k_bar, _, d = args
    threshold = _threshold(*args)
    indices, top = _top_counts(counts, k_bar, d)
    scale = limited_domain_noise_scale(epsilon0)
    noisy = top + rng.gumbel(0.0, scale, size=top.size)
    best = int(np.argmax(noisy))
    if threshold is not None and noisy[best] < threshold + rng.gumbel(0.0, scale):
        return None
    return int(indices[best])


# ---- d_X privacy on embeddings (RAPT) ---------------------------------------------------------

def dx_privatize_embeddings(embeddings, eta: float, rng: np.random.Generator) -> np.ndarray:
    """d_X-private embeddings [Fey20; Li23]: x + r·u for every vector x (last axis, dimension d),
    r ~ Gamma(shape=d, scale=1/η), u uniform on the unit sphere (a normalised standard Gaussian).

    The noise density is ∝ exp(−η‖z‖), so the release is η·‖x − x'‖-private (metric DP).
    Larger η means less noise.
    """
    eta = check_positive(_scalar(eta), "eta")
    rng = _check_rng(rng)
    x = np.asarray(embeddings)
    if x.ndim == 0 or x.shape[-1] == 0 or not np.issubdtype(x.dtype, np.number):
        raise ValueError(f"embeddings must be an array of vectors (..., d), got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError("embeddings must be finite")
    direction = rng.standard_normal(x.shape)
    direction /= np.linalg.norm(direction, axis=-1, keepdims=True)
    radius = rng.gamma(shape=x.shape[-1], scale=1.0 / eta, size=x.shape[:-1])
    dtype = np.result_type(x.dtype, np.float32)
    return (x + radius[..., None] * direction).astype(dtype, copy=False)


def nearest_neighbor_tokens(noisy, vocab_embeddings, exclude=None) -> np.ndarray:
    """Index of the Euclidean-nearest row of ``vocab_embeddings`` (V × d) for every vector of
    ``noisy`` (..., d), never one of the ``exclude`` ids. Computed in chunks of rows so that
    at most ~4M distances exist at once."""
    vocab = np.asarray(vocab_embeddings)
    if vocab.ndim != 2 or vocab.shape[0] == 0:
        raise ValueError(f"vocab_embeddings must be a non-empty (V, d) array, got shape {vocab.shape}")
    queries = np.asarray(noisy)
    if queries.ndim == 0 or queries.shape[-1] != vocab.shape[1]:
        raise ValueError(f"noisy must have last dimension {vocab.shape[1]}, got shape {queries.shape}")
    penalty = np.sum(vocab.astype(np.float64) ** 2, axis=1)  # ‖v‖²; ‖q‖² is constant per query
    if exclude is not None:
        excluded = np.unique(np.asarray(exclude, dtype=np.int64).ravel())
        if excluded.size and (excluded.min() < 0 or excluded.max() >= vocab.shape[0]):
            raise ValueError(f"exclude must hold ids in [0, {vocab.shape[0]}), got {exclude!r}")
        penalty[excluded] = np.inf
        if np.all(np.isinf(penalty)):
            raise ValueError(f"exclude must leave at least one token, got {exclude!r}")
    flat = queries.reshape(-1, vocab.shape[1])
    out = np.empty(flat.shape[0], dtype=np.int64)
    rows = max(1, _CHUNK_ELEMENTS // vocab.shape[0])
    for start in range(0, flat.shape[0], rows):
        chunk = flat[start:start + rows].astype(np.float64)
        out[start:start + rows] = np.argmin(penalty - 2.0 * (chunk @ vocab.T), axis=1)
    return out.reshape(queries.shape[:-1])


def dx_privatize_tokens(token_ids, vocab_embeddings, eta: float, rng: np.random.Generator,
                        exclude=None) -> np.ndarray:
    """RAPT's token privatisation [Li23]: perturb each token's embedding with d_X noise
    (:func:`dx_privatize_embeddings`) and map it back to the nearest vocabulary token that is not
    in ``exclude`` (e.g. special tokens). Positions that hold an excluded id (padding, BOS, …)
    are structure, not user text: they are passed through unchanged."""
    ids = np.asarray(token_ids)
    vocab = np.asarray(vocab_embeddings)
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token_ids must be integers, got dtype {ids.dtype}")
    if vocab.ndim != 2:
        raise ValueError(f"vocab_embeddings must be a (V, d) array, got shape {vocab.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab.shape[0]):
        raise ValueError(f"token_ids must lie in [0, {vocab.shape[0]}), got {token_ids!r}")
    noisy = dx_privatize_embeddings(vocab[ids], eta, rng)
    new_ids = nearest_neighbor_tokens(noisy, vocab, exclude)
    if exclude is not None:
        keep = np.isin(ids, np.asarray(exclude, dtype=np.int64))
        new_ids = np.where(keep, ids, new_ids)
    return new_ids


def replacement_rate(original, privatized) -> float:
    """Fraction of positions whose token changed (RAPT reports it against η, Table 4)."""
    a, b = np.asarray(original), np.asarray(privatized)
    if a.shape != b.shape:
        raise ValueError(f"privatized must have the shape of original {a.shape}, got {b.shape}")
    if a.size == 0:
        raise ValueError("original must hold at least one token, got none")
    return float(np.mean(a != b))


# ---- Gaussian mechanism -----------------------------------------------------------------------

def gaussian_noise(shape, noise_multiplier: float, sensitivity: float, rng: np.random.Generator) -> np.ndarray:
    """N(0, (σ·Δ)²) samples of the given shape (σ = ``noise_multiplier``, Δ = L2 sensitivity)."""
    sigma = check_positive(_scalar(noise_multiplier), "noise_multiplier")
    sensitivity = check_positive(_scalar(sensitivity), "sensitivity")
    return _check_rng(rng).normal(0.0, sigma * sensitivity, size=shape)


def gaussian_mechanism(value, noise_multiplier: float, sensitivity: float, rng: np.random.Generator):
    """value + N(0, (σΔ)² I) [DR14, Thm. 3.22]; the privacy of σ is computed by the accountant
    (``GaussianEvent(σ)``, the noise relative to the L2 sensitivity Δ)."""
    x = np.asarray(value, dtype=float)
    if not np.all(np.isfinite(x)):
        raise ValueError(f"value must be finite, got {value!r}")
    noisy = x + gaussian_noise(x.shape, noise_multiplier, sensitivity, rng)
    return float(noisy) if noisy.ndim == 0 else noisy


DISTRIBUTION_SENSITIVITY = math.sqrt(2.0)


def clip_distributions(distributions) -> np.ndarray:
    """(m, K) rows made sub-distributions: negatives to 0, a row whose sum exceeds 1 scaled down
    to sum 1. Two such rows differ by at most √2 in L2 (‖p − p'‖₂² ≤ ‖p − p'‖₁·‖p − p'‖∞ ≤ 2·1)."""
    p = np.asarray(distributions, dtype=float)
    if p.ndim != 2 or not np.all(np.isfinite(p)):
        raise ValueError(f"distributions must be a finite (m, K) array, got shape {p.shape}")
    p = np.clip(p, 0.0, None)
    total = p.sum(axis=1, keepdims=True)
    return p / np.maximum(total, 1.0)


def distribution_vote(distributions, noise_multiplier: float, rng: np.random.Generator) -> int:
    """DP few-shot generation's aggregate [Tang24]: each of m disjoint subsets gives a next-token
    distribution over a public domain of K tokens (one row of ``distributions``, clipped by
    :func:`clip_distributions`); their SUM + N(0, (σ·√2)² I_K) is the released vector and its
    argmax (post-processing) the token. Adding or removing one record changes one subset, so one
    row (replaced, or appearing / vanishing): the sum moves by L2 ≤ √2 =
    ``DISTRIBUTION_SENSITIVITY``, and the release is ``GaussianEvent(σ)``. The paper adds noise to
    the mean over a fixed m: the same mechanism scaled by 1/m. With m = 0 (no subset has rows) the
    noise alone decides: the query is made all the same."""
    p = np.asarray(distributions, dtype=float)
    if p.ndim != 2 or p.shape[1] == 0:
        raise ValueError(f"distributions must be an (m, K) array with K ≥ 1, got shape {p.shape}")
    total = clip_distributions(p).sum(axis=0)
    noisy = gaussian_mechanism(total, noise_multiplier, DISTRIBUTION_SENSITIVITY, _check_rng(rng))
    return int(np.argmax(np.atleast_1d(noisy)))


# ---- released sizes ---------------------------------------------------------------------------

def release_counts(counts, noise_multiplier: float, rng: np.random.Generator) -> list[int]:
    """Counts of DISJOINT parts of a dataset (a partition's train / holdout / test sizes) released
    with one Gaussian mechanism: c + N(0, σ² I), then rounded and floored at 1.

    Privacy: under add/remove of one record of the source, exactly one of the disjoint counts moves,
    by one (or none, when the record lands in no part), so the vector's L2 sensitivity is Δ = 1 and
    the release is the Gaussian mechanism ``GaussianEvent(σ)`` [DR14, Thm. 3.22; its ε at δ is the
    accountant's]. Rounding and the floor are post-processing. ``rng`` must be a secret stream."""
    c = np.asarray(counts, dtype=float)
    if c.ndim != 1 or c.size == 0 or not np.all(np.isfinite(c)) or np.any(c < 0) or np.any(c != np.round(c)):
        raise ValueError(f"counts must be a non-empty list of non-negative integers, got {counts!r}")
    noisy = gaussian_mechanism(c, noise_multiplier, 1.0, rng)
    return [max(1, int(round(float(x)))) for x in np.atleast_1d(noisy)]


def count_release_event(noise_multiplier: float):
    """The privacy event of :func:`release_counts` (L2 sensitivity 1)."""
    from .events import GaussianEvent

    return GaussianEvent(float(noise_multiplier))


# ---- the comparison with no prompt ------------------------------------------------------------

def gaussian_delta(epsilon: float, noise_multiplier: float) -> float:
    """The exact δ(ε) of the Gaussian mechanism of noise σ (L2 sensitivity 1): Φ(1/(2σ) − εσ) −
    e^ε Φ(−1/(2σ) − εσ) (Balle & Wang 2018, Thm. 8, the analytic Gaussian mechanism)."""
    from scipy.stats import norm

    s = float(noise_multiplier)
    return float(norm.cdf(0.5 / s - epsilon * s) - math.exp(epsilon) * norm.cdf(-0.5 / s - epsilon * s))


def analytic_gaussian_sigma(epsilon: float, delta: float) -> float:
    """The smallest σ (to 1e-9 relative) at which one Gaussian release of L2 sensitivity 1 is (ε, δ)-DP
    exactly (:func:`gaussian_delta`, decreasing in σ): a bisection on a closed form, instant."""
    check_epsilon(epsilon, "epsilon")
    check_delta(delta, "delta")
    lo, hi = 1e-6, 1.0
    while gaussian_delta(epsilon, hi) > delta:
        lo, hi = hi, hi * 2.0
    while hi - lo > 1e-9 * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if gaussian_delta(epsilon, mid) > delta else (lo, mid)
    return hi


def difference_with_and_without(right_with, right_without, weights=None) -> float:
    """D = Σ_i w_i (right_with_i − right_without_i) over the holdout rows: how many more rows (or,
    with ``weights`` 1/n_u per row of unit u, people) the prompt classifies right than no prompt does.
    One row moves D by ≤ 1 (|right_with − right_without| ≤ 1); one unit of weights summing to 1, by ≤ 1.
    EXACT: a statistic of private data, only released through :func:`gaussian_mechanism`."""
    a = np.asarray(right_with, dtype=float)
    b = np.asarray(right_without, dtype=float)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"right_with and right_without must be two vectors of one length, got {a.shape}, {b.shape}")
    w = np.ones_like(a) if weights is None else np.asarray(weights, dtype=float)
    if w.shape != a.shape or np.any(w < 0):
        raise ValueError(f"weights must give one non-negative weight per row, got shape {w.shape}")
    return math.fsum((w * (a - b)).tolist())
