"""dp_fewshot (Tang et al. 2024): the aggregate against its distribution, the accountant against an
independent (analytic Gaussian) computation, the keyed partition under add/remove of one record,
and the generated tokens coming from the DP aggregate (with the noise dominating, the output no
longer depends on the private data)."""

import dataclasses
import math

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.stats import norm

from privacy import accountant as acct
from privacy.mechanisms import DISTRIBUTION_SENSITIVITY, clip_distributions, distribution_vote
from tasks.methods import PrivateRows, get_method
from tasks.methods.dp_fewshot.events import generation_event
from tasks.methodkit.keyed_partition import keyed_subsets

from tests.methods.test_method_contract import ROWS, parsed_config


# ---- the mechanism ------------------------------------------------------------------------------

def test_vote_is_the_argmax_of_the_sum_plus_gaussian_noise_of_scale_sigma_sqrt2():
    rng = np.random.default_rng(0)
    P = rng.dirichlet(np.ones(7), size=5)
    for seed in range(20):
        expected = np.argmax(P.sum(0) + np.random.default_rng(seed).normal(0, 0.7 * math.sqrt(2), 7))
        assert distribution_vote(P, 0.7, np.random.default_rng(seed)) == expected


def test_vote_frequencies_match_the_gaussian_argmax_distribution():
    """Two tokens, sums (3, 1), σ = 1: P[token 0] = Φ(2 / (σ√2·√2)) = Φ(1)."""
    P = np.array([[1.0, 0.0], [1.0, 0.0], [0.5, 0.5], [0.5, 0.5]])
    rng = np.random.default_rng(1)
    wins = np.mean([distribution_vote(P, 1.0, rng) == 0 for _ in range(4000)])
    assert abs(wins - norm.cdf(1.0)) < 0.025


def test_one_subset_changed_moves_the_sum_by_at_most_sqrt2():
    rng = np.random.default_rng(2)
    for _ in range(200):
        P = rng.dirichlet(np.ones(9) * 0.1, size=4) * rng.uniform(0.5, 1.5, size=(4, 1))  # some over-full rows
        Q = P.copy()
        Q[rng.integers(4)] = rng.dirichlet(np.ones(9) * 0.1) * 3.0
        a, b = clip_distributions(P).sum(0), clip_distributions(Q).sum(0)
        assert np.linalg.norm(a - b) <= DISTRIBUTION_SENSITIVITY + 1e-12
        gone = clip_distributions(np.delete(P, 0, axis=0)).sum(0)  # a subset that empties
        assert np.linalg.norm(a - gone) <= 1.0 + 1e-12


# ---- the accountant -----------------------------------------------------------------------------

def _analytic_gaussian_epsilon(sigma: float, tokens: int, delta: float) -> float:
    """T Gaussian queries at noise multiplier σ are one Gaussian at σ/√T; its exact (ε, δ) curve
    (Balle & Wang 2018): δ(ε) = Φ(1/(2s) − εs) − e^ε Φ(−1/(2s) − εs), s = σ/√T."""
    s = sigma / math.sqrt(tokens)
    return brentq(lambda e: norm.cdf(1 / (2 * s) - e * s) - math.exp(e) * norm.cdf(-1 / (2 * s) - e * s) - delta,
                  0.0, 100.0)


@pytest.mark.parametrize("epsilon,tokens", [(1.0, 8), pytest.param(8.0, 24, marks=pytest.mark.slow)])
def test_plan_sigma_spends_the_target_by_an_independent_computation(epsilon, tokens):
    delta = 1e-5
    sigma = acct.calibrate_noise_multiplier(epsilon, delta, 1.0, tokens)
    exact = _analytic_gaussian_epsilon(sigma, tokens, delta)
    assert exact <= epsilon + 1e-6 and exact > 0.97 * epsilon  # within the target, and not wasteful
    spent = acct.spend(generation_event(sigma, tokens), delta).epsilon
    assert exact - 1e-6 <= spent <= epsilon * (1 + 1e-9)


# ---- the partition ------------------------------------------------------------------------------

KEY = bytes(range(32))
TEXTS = [f"review number {i} of a film" for i in range(40)]
LABELS = ["positive" if i % 3 else "negative" for i in range(40)]


def _as_texts(parts, texts):
    return [sorted(texts[i] for i in p) for p in parts]


def test_adding_or_removing_one_record_changes_exactly_one_subset():
    base = _as_texts(keyed_subsets(TEXTS, LABELS, "positive", KEY, 6, 2), TEXTS)
    for extra in ("a brand new review", "another one entirely", "zzz"):
        more = _as_texts(keyed_subsets(TEXTS + [extra], LABELS + ["positive"], "positive", KEY, 6, 2),
                         TEXTS + [extra])
        assert sum(a != b for a, b in zip(base, more)) <= 1
    for gone in range(0, 40, 5):
        texts, labels = TEXTS[:gone] + TEXTS[gone + 1:], LABELS[:gone] + LABELS[gone + 1:]
        fewer = _as_texts(keyed_subsets(texts, labels, "positive", KEY, 6, 2), texts)
        assert sum(a != b for a, b in zip(base, fewer)) <= 1
    # another label's record changes nothing here; the order of rows changes nothing; the key does
    other = _as_texts(keyed_subsets(TEXTS + ["x"], LABELS + ["negative"], "positive", KEY, 6, 2), TEXTS + ["x"])
    assert other == base
    rev = _as_texts(keyed_subsets(TEXTS[::-1], LABELS[::-1], "positive", KEY, 6, 2), TEXTS[::-1])
    assert rev == base
    assert _as_texts(keyed_subsets(TEXTS, LABELS, "positive", bytes(32), 6, 2), TEXTS) != base
    with pytest.raises(ValueError, match="128 secret bits"):
        keyed_subsets(TEXTS, LABELS, "positive", b"short", 6, 2)


# ---- the method on a tiny LM --------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return parsed_config(tmp_path_factory, "dp_fewshot", {"demos_per_label": 1, "subsets": 3, "shots": 2,
                                                           "max_new_tokens": 4, "public_top_k": 12}, "fewshot")


def _train(tiny, rows, sigma=None, randomness=None):
    from tasks.methods import MethodContext
    from tasks.randomness import DpRandomness

    cfg, paths = tiny
    method = get_method("dp_fewshot")
    plan = method.mechanism.plan(cfg, len(rows), 1e-5)
    if sigma is not None:
        plan = dataclasses.replace(plan, settings={**plan.settings, "noise_multiplier": sigma})
    mctx = MethodContext(cfg, paths, {}, randomness or DpRandomness(), 0, dataset_key="fewshot")
    return plan, method.mechanism.train(mctx, plan, rows)


OTHER = PrivateRows(["the plot is a mess", "wonderful acting", "i fell asleep", "a delight"] * 5,
                    ["negative", "positive", "negative", "positive"] * 5)


@pytest.mark.slow  # two runs on a tiny LM: about a minute on 2 shared cores
def test_with_the_noise_dominating_the_output_does_not_depend_on_the_private_rows(tiny):
    from tasks.randomness import DpRandomness

    _, a = _train(tiny, ROWS, sigma=1e7, randomness=DpRandomness(seeded=True, seed=4))
    _, b = _train(tiny, OTHER, sigma=1e7, randomness=DpRandomness(seeded=True, seed=4))
    assert a.prompt == b.prompt and a.metrics == b.metrics


def test_every_token_is_the_aggregate_of_the_subsets_distributions(tiny, monkeypatch):
    """A test double for the DP aggregate: it sees one row per non-empty subset, each a distribution
    over the public top-k, and its answer is the token; the run charges the plan's event."""
    import privacy.mechanisms as mech

    seen = []

    def double(distributions, sigma, rng):
        seen.append(np.asarray(distributions))
        return len(seen) % 2  # second-best, best, ... of the domain: not what a plain argmax would give

    monkeypatch.setattr(mech, "distribution_vote", double)
    plan, trained = _train(tiny, ROWS)
    assert len(seen) == trained.steps == trained.metrics["dpfewshot.queries"] and 2 <= len(seen) <= 8
    for P in seen:
        assert P.shape[1] == 12 and 1 <= P.shape[0] <= 3
        assert np.allclose(P.sum(axis=1), 1.0)
    assert trained.event == plan.event == generation_event(plan.settings["noise_multiplier"], 4)
    assert trained.prompt.instruction.startswith("Classify the input text as negative or positive.")
