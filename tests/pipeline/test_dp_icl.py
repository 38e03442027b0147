"""DP-ICL as a served model (tasks/dp_icl.py): the ledger's spend grows with answered batches exactly
as planned, a batch past the cap is refused with one line and nothing answered, the vote histogram
moves by at most √2 when one record is added, and the queries-within-ε count agrees with the
accountant and an independent analytic computation."""

import math

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.stats import norm

from privacy import accountant as acct
from privacy.events import SelfComposedEvent, event_to_dict
from privacy.ledger import Ledger
from privacy.ledger.errors import BudgetExceededError
from tasks.dp_icl import DPICLServer, DPICLSettings, batch_event, queries_within
from tasks.methods import PrivateRows
from tasks.randomness import DpRandomness

ROWS = PrivateRows(["a fine , moving film", "dull and tedious", "a joy to watch", "painfully bad", "warm and witty",
                    "a total mess", "lovely work", "boring"] * 2,
                   ["positive", "negative", "positive", "negative", "positive", "negative", "positive", "negative"] * 2)
SETTINGS = DPICLSettings(subsets=4, shots=2, noise_multiplier=2.0, instruction="Classify the review.")


@pytest.fixture(scope="module")
def engine():
    from models.backbones import load_backbone
    from tasks.methodkit.causal_engine import CausalEngine

    bb = load_backbone("tiny-gpt2", "cpu", seed=3)
    return CausalEngine(bb.model, bb.tokenizer, max_batch=4)


def _server(engine, ledger, rows=ROWS, seed=5):
    return DPICLServer(engine, ["negative", "positive"], rows, SETTINGS, ledger, "fp-icl",
                       DpRandomness(seeded=True, seed=seed))


def _ledger(tmp_path, cap):
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.register_dataset("fp-icl", "toy", cap, 1e-5)
    return ledger


def test_spend_grows_per_answered_batch_exactly_as_planned(engine, tmp_path):
    ledger = _ledger(tmp_path, 100.0)
    server = _server(engine, ledger)
    answers = server.answer(["great", "awful", "fine"])
    assert len(answers) == 3 and set(answers) <= {"negative", "positive"}
    assert ledger.spent("fp-icl").epsilon == pytest.approx(acct.spend(batch_event(2.0, 3), 1e-5).epsilon, rel=1e-6)
    server.answer(["so so", "bad"])
    entries = [e for e in ledger.entries() if e["kind"] == "dp"]
    assert [e["status"] for e in entries] == ["committed", "committed"]
    assert [e["event"] for e in entries] == [event_to_dict(batch_event(2.0, 3)), event_to_dict(batch_event(2.0, 2))]
    # two batches (3 + 2 queries) compose to five Gaussian votes
    assert ledger.spent("fp-icl").epsilon == pytest.approx(
        acct.spend(SelfComposedEvent(batch_event(2.0, 1).event, 5), 1e-5).epsilon, rel=1e-3)
    assert all("inference-time spend" in e["description"] for e in entries)


def test_a_batch_past_the_cap_is_refused_and_nothing_is_answered(engine, tmp_path, monkeypatch):
    one = acct.spend(batch_event(2.0, 2), 1e-5).epsilon
    ledger = _ledger(tmp_path, one * 1.05)  # room for one batch of two, not for a second
    server = _server(engine, ledger)
    server.answer(["great", "awful"])
    voted = []
    monkeypatch.setattr(server, "_vote", lambda text: voted.append(text) or "positive")
    before = ledger.entries()
    with pytest.raises(BudgetExceededError) as err:
        server.answer(["one more", "and another"])
    assert "\n" not in str(err.value) and voted == []
    assert ledger.entries() == before  # nothing recorded for the refused batch


@pytest.mark.slow  # ~5 s: 4 queries × 2 servers × 4 subsets scored one by one
def test_adding_one_record_moves_the_vote_histogram_by_at_most_sqrt2(engine, tmp_path):
    ledger = _ledger(tmp_path, 100.0)
    a = _server(engine, ledger)
    more = PrivateRows(ROWS.texts + ["an extra record , a film"], ROWS.labels + ["positive"])
    b = _server(engine, ledger, rows=more)  # same seeded key: the same partition of the shared rows
    for query in ["great", "awful", "a movie", "meh"]:
        ha, hb = a.histogram(query), b.histogram(query)
        assert ha.sum() <= SETTINGS.subsets and hb.sum() <= SETTINGS.subsets
        assert np.linalg.norm(ha - hb) <= math.sqrt(2) + 1e-12


def _analytic_epsilon(sigma, queries, delta):
    s = sigma / math.sqrt(queries)
    return brentq(lambda e: norm.cdf(1 / (2 * s) - e * s) - math.exp(e) * norm.cdf(-1 / (2 * s) - e * s) - delta,
                  0.0, 200.0)


@pytest.mark.slow  # ~3.5 s of PLD accounting
def test_queries_within_a_budget_agree_with_the_accountant_and_the_analytic_gaussian():
    b = queries_within(8.0, 1e-5, 2.0)
    assert b >= 1
    assert acct.spend(batch_event(2.0, b), 1e-5).epsilon <= 8.0 < acct.spend(batch_event(2.0, b + 1), 1e-5).epsilon
    assert _analytic_epsilon(2.0, b, 1e-5) <= 8.0 + 1e-6
    assert _analytic_epsilon(2.0, b + 2, 1e-5) > 8.0 * 0.99  # the accountant is nearly exact here
    assert queries_within(0.01, 1e-5, 0.5) == 0


def test_every_batch_is_charged_even_from_threads_or_a_restarted_server(engine, tmp_path):
    """A batch id is fresh (never a counter): concurrent batches, and a server restarted under the
    same serve_id, each make their own ledger entry — none meets the ledger's idempotent retry,
    which would return the old entry, charge nothing, and let the batch be answered (review F1)."""
    from concurrent.futures import ThreadPoolExecutor

    ledger = _ledger(tmp_path, 1000.0)
    servers = [DPICLServer(engine, ["negative", "positive"], ROWS, SETTINGS, ledger, "fp-icl",
                           DpRandomness(seeded=True, seed=5), serve_id="privprompt.toy.dp_icl/1") for _ in range(2)]
    with ThreadPoolExecutor(4) as pool:
        answered = list(pool.map(lambda i: servers[i % 2].answer(["great", "awful"]), range(4)))
    assert sum(len(a) for a in answered) == 8
    entries = [e for e in ledger.entries() if e["kind"] == "dp"]
    assert len(entries) == 4 and len({e["run_id"] for e in entries}) == 4
    assert ledger.spent("fp-icl").epsilon == pytest.approx(
        acct.spend(SelfComposedEvent(batch_event(2.0, 1).event, 8), 1e-5).epsilon, rel=1e-3)


def test_a_dataset_of_people_is_refused(engine, tmp_path):
    """The subsets are keyed by record: one person's records land in many subsets and move many
    votes, so the √2 charged per query would hold for one record only (review F2)."""
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.register_dataset("fp-icl", "toy", 10.0, 1e-5, unit="author")
    with pytest.raises(ValueError, match="privacy unit is 'author'.*refused"):
        _server(engine, ledger)
    people = PrivateRows(ROWS.texts, ROWS.labels, units=[f"p{i % 3}" for i in range(len(ROWS))])
    with pytest.raises(ValueError, match="refused"):
        _server(engine, _ledger(tmp_path / "other", 10.0), rows=people)
