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


# ---- the paper's subsampled variant: a fresh Poisson sample per query ---------------------------

def test_poisson_subsets_sample_each_row_at_q_into_uniform_disjoint_subsets():
    from scipy.stats import binomtest, chisquare

    from tasks.dp_icl import poisson_subsets

    rng = np.random.default_rng(11)
    n, q, m, shots, draws = 400, 0.05, 4, 100, 300  # shots large: no truncation, every sampled row kept
    counts, per_subset = np.zeros(n), np.zeros(m)
    for _ in range(draws):
        parts = poisson_subsets(n, q, m, shots, rng)
        flat = [i for part in parts for i in part]
        assert len(flat) == len(set(flat))  # each row in at most one subset
        counts[flat] += 1
        per_subset += [len(p) for p in parts]
    assert binomtest(int(counts.sum()), n * draws, q).pvalue > 1e-3
    assert chisquare(per_subset).pvalue > 1e-3
    # truncated: at most `shots` rows per subset
    assert all(len(p) <= 2 for p in poisson_subsets(n, 0.5, m, 2, rng))


def test_adding_one_row_changes_only_its_own_subset_whatever_the_draws():
    """Under coupled draws (every shared row keeps its own inclusion, subset and priority), adding a
    row to the data changes at most one subset's content — what makes each vote's histogram move by
    L2 ≤ √2, so a query is PoissonSampled(q, Gaussian(σ))."""
    from tasks.dp_icl import subsets_of_draws

    rng = np.random.default_rng(5)
    changed_any = 0
    for _ in range(2000):
        n, m, shots, q = int(rng.integers(1, 30)), int(rng.integers(2, 6)), int(rng.integers(1, 4)), rng.uniform(0.1, 1)
        inc, sub, pri = rng.random(n + 1), rng.integers(0, m, n + 1), rng.random(n + 1)
        without = subsets_of_draws(inc[:n], sub[:n], pri[:n], q, m, shots)
        with_row = subsets_of_draws(inc, sub, pri, q, m, shots)
        differ = [g for g in range(m) if without[g] != with_row[g]]
        assert differ in ([], [int(sub[n])])
        changed_any += bool(differ)
    assert changed_any > 100  # the added row did land in a prompt often


def test_a_subsampled_query_is_dpsgds_step_and_matches_dp_accountings_rdp():
    import dp_accounting
    from dp_accounting import rdp

    from privacy.events import PoissonSampledEvent, dpsgd_event
    from tasks.dp_icl import noise_for_queries

    assert batch_event(2.0, 50, 0.01) == dpsgd_event(0.01, 2.0, 50)
    assert batch_event(2.0, 50, 0.01).event == PoissonSampledEvent(0.01, batch_event(2.0, 1).event)
    assert batch_event(2.0, 50, None) == batch_event(2.0, 50)
    ours = acct.spend(batch_event(1.2, 1000, 0.01), 1e-5).epsilon
    independent = rdp.RdpAccountant().compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.2)), 1000)).get_epsilon(1e-5)
    assert ours <= independent + 1e-9 and ours >= 0.8 * independent  # RDP is an upper bound, and not loose by 20 %
    # amplification: the same σ on q = 1 % spends far less than on every row
    assert ours < 0.2 * acct.spend(batch_event(1.2, 1000), 1e-5).epsilon
    sigma = noise_for_queries(3.0, 1e-5, 1000, 0.01)
    assert acct.spend(batch_event(sigma, 1000, 0.01), 1e-5).epsilon <= 3.0 + 1e-9


def test_a_sampled_server_charges_the_subsampled_event_and_its_votes_stay_within_sqrt2(engine, tmp_path, monkeypatch):
    import tasks.dp_icl as dp_icl
    from privacy.events import PoissonSampledEvent

    settings = DPICLSettings(subsets=3, shots=2, noise_multiplier=2.0, sample_rate=0.3)
    ledger = _ledger(tmp_path, 100.0)
    server = DPICLServer(engine, ["negative", "positive"], ROWS, settings, ledger, "fp-icl", DpRandomness())
    assert len(server.answer(["great", "awful"])) == 2
    (entry,) = [e for e in ledger.entries() if e["kind"] == "dp"]
    assert entry["event"] == event_to_dict(SelfComposedEvent(PoissonSampledEvent(0.3, batch_event(2.0, 1).event), 2))
    # coupled draws: the same draws for the shared rows, one more row added → one vote moves at most
    more = PrivateRows(ROWS.texts + ["an extra record , a film"], ROWS.labels + ["positive"])
    rng = np.random.default_rng(9)
    for _ in range(3):
        n = len(more.texts)
        inc, sub, pri = rng.random(n), rng.integers(0, 3, n), rng.random(n)
        hists = []
        for rows in (ROWS, more):
            k = len(rows.texts)
            monkeypatch.setattr(dp_icl, "poisson_subsets", lambda n_, q, m, s, _rng, k=k:
                                dp_icl.subsets_of_draws(inc[:k], sub[:k], pri[:k], q, m, s))
            srv = DPICLServer(engine, ["negative", "positive"], rows, settings, ledger, "fp-icl", DpRandomness())
            hists.append(srv.histogram("a movie"))
        assert np.linalg.norm(hists[0] - hists[1]) <= math.sqrt(2) + 1e-12


@pytest.mark.parametrize("sample_rate", [None, 1.0])
def test_a_long_query_is_answered_whatever_the_private_demonstrations_lengths(engine, tmp_path, sample_rate):
    """Privacy review F1: a query longer than the room the demonstrations' budget leaves it overflowed
    a learned-position model's context when a neighbour held one long record (IndexError: the batch
    charged, no answer) and was answered without it — a noiseless test of that record. The query is
    clipped to QUERY_TOKENS (public), so both neighbours answer every query length."""
    from tasks.dp_icl import QUERY_TOKENS

    settings = DPICLSettings(subsets=2, shots=2, noise_multiplier=2.0, sample_rate=sample_rate)
    short = PrivateRows(["good"], ["positive"])
    long_row = PrivateRows(["good", " ".join(["unbelievably"] * 48)], ["positive", "negative"])
    for rows in (short, long_row):
        server = DPICLServer(engine, ["negative", "positive"], rows, settings, _ledger(tmp_path / str(id(rows)), 1e3),
                             "fp-icl", DpRandomness())
        for words in (35, 48):
            query = " ".join(["xq9zv7"] * words)
            assert len(server._query_ids(query)) <= QUERY_TOKENS
            assert server.histogram(query).sum() >= 1


@pytest.mark.parametrize("sample_rate", [None, 0.9])
def test_long_labels_and_full_budget_rows_fit_the_context_for_every_neighbour(engine, tmp_path, sample_rate):
    """Privacy review 10, F1: the demonstrations' token budget left out the labels' tokens; with
    10-token labels one more long record made a subset's prompt outgrow tiny-gpt2's 256 positions
    (IndexError: the batch charged, nothing answered) where its neighbour answered. The budget now
    counts each demonstration's label and seam: every subset's prompt plus the longest query fits,
    and every subset votes on both neighbours, partition and Poisson alike."""
    import random

    from tasks.dp_icl import QUERY_TOKENS

    labels = ["negative " + " ".join(["very"] * 9), "positive " + " ".join(["very"] * 9)]  # 10 tokens each
    rng = random.Random(0)
    blob = lambda: " ".join("".join(rng.choice("QZXJKqzxjk0123456789") for _ in range(40))  # noqa: E731
                            for _ in range(48))  # 48 "words" of many tokens each: cut to the token budget
    texts = [blob() for _ in range(7)]
    settings = DPICLSettings(subsets=2, shots=4, noise_multiplier=2.0, sample_rate=sample_rate)
    query = blob()
    context = engine.max_positions
    histograms = []
    for n in (6, 7):  # D and D + one long record (the same secret key: the partition's)
        rows = PrivateRows(texts[:n], [labels[i % 2] for i in range(n)])
        server = DPICLServer(engine, labels, rows, settings, _ledger(tmp_path / f"{n}-{sample_rate}", 1e3), "fp-icl",
                             DpRandomness(seeded=True, seed=11))
        for _ in range(3):
            prefixes = server._query_prefixes()
            assert all(len(p.ids) + QUERY_TOKENS <= context for p in prefixes)  # the budget, not the guard
        if sample_rate is None:
            histograms.append(server.histogram(query))
            assert histograms[-1].sum() == 2  # both subsets vote
    if sample_rate is None:  # one record moves one subset's vote: L2 ≤ √2, the sensitivity charged
        assert np.linalg.norm(histograms[1] - histograms[0]) <= math.sqrt(2) + 1e-12


@pytest.mark.parametrize("sample_rate", [None, 0.9])
def test_a_template_whose_sides_merge_without_the_text_still_fits_every_neighbour(engine, tmp_path, sample_rate):
    """Review 10b, G1: tiny-gpt2's WordPiece makes a word of over 100 characters one [UNK], so the template
    without its text (52 letters a side, joined: 1 token) counted far fewer tokens than its sides around a
    text: one long record then crashed its subset's prefix forward (before the guard) where the neighbour
    without it answered. The sides are now counted apart, and a subset that would still outgrow the context
    abstains BEFORE its prefix runs. Sides too long for any text are refused in one line on every neighbour."""
    import random

    from tasks.dp_icl import QUERY_TOKENS
    from tasks.errors import ConfigError

    rng = random.Random(1)
    long_row = ". " + " ".join("".join(rng.choice("qzxjk0123456789") for _ in range(12)) for _ in range(46)) + " ."
    template = "xq" * 26 + "{text}" + "zk" * 26
    for n, rows in (("D", PrivateRows([], [])), ("D+1", PrivateRows([long_row], ["positive"]))):
        settings = DPICLSettings(subsets=2, shots=1, noise_multiplier=2.0, template=template, sample_rate=sample_rate)
        server = DPICLServer(engine, ["negative", "positive"], rows, settings, _ledger(tmp_path / f"{n}-{sample_rate}", 1e3),
                             "fp-icl", DpRandomness(seeded=True, seed=0))
        prefixes = [p for _ in range(3) for p in server._query_prefixes()]
        assert all(len(p.ids) + QUERY_TOKENS <= engine.max_positions for p in prefixes), n
        assert (len(prefixes) > 0) == (n == "D+1")  # the long record's subset runs (it fits): not an abstention
        server.histogram("a fine film")
        too_long = DPICLSettings(subsets=2, shots=2, noise_multiplier=2.0, template="xq" * 38 + "{text}" + "zk" * 38)
        with pytest.raises(ConfigError, match="leave no room for a private text"):
            DPICLServer(engine, ["negative", "positive"], rows, too_long, _ledger(tmp_path / f"{n}-{sample_rate}-long", 1e3),
                        "fp-icl", DpRandomness(seeded=True, seed=0))


def test_labels_sharing_their_first_token_are_refused(engine, tmp_path):
    """dp_icl votes on each label's first token: 'very negative' and 'very positive' would tie on
    'very' and the second could never win (review 10, F6) — refused with one line."""
    from tasks.errors import ConfigError

    with pytest.raises(ConfigError, match="begin with the same token"):
        DPICLServer(engine, ["very negative", "very positive"], ROWS, SETTINGS, _ledger(tmp_path, 1e3), "fp-icl",
                    DpRandomness())


def test_the_size_release_rides_on_the_first_charged_batch_only(engine, tmp_path):
    """A poisson server's q comes from the released sizes: their release is charged once, with the
    first batch the ledger accepts — a refused first batch leaves it pending; later batches carry votes only."""
    from privacy.events import AdaptiveEvent, GaussianEvent

    from tasks.dp_icl import first_batch_event

    size = GaussianEvent(50.0)
    settings = DPICLSettings(subsets=2, shots=2, noise_multiplier=2.0, sample_rate=0.5)
    tiny = _ledger(tmp_path / "tiny", 1e-3)
    server = DPICLServer(engine, ["negative", "positive"], ROWS, settings, tiny, "fp-icl", DpRandomness(), size_event=size)
    with pytest.raises(BudgetExceededError):
        server.answer(["great"])
    assert server.events([1])[0] == first_batch_event(2.0, 1, 0.5, size)  # still pending
    ledger = _ledger(tmp_path / "big", 1e3)
    server = DPICLServer(engine, ["negative", "positive"], ROWS, settings, ledger, "fp-icl", DpRandomness(), size_event=size)
    server.answer(["great", "awful"])
    server.answer(["fine"])
    first, second = [e["event"] for e in ledger.entries() if e["kind"] == "dp"]
    assert first == event_to_dict(AdaptiveEvent(size, batch_event(2.0, 2, 0.5)))
    assert second == event_to_dict(batch_event(2.0, 1, 0.5))


@pytest.mark.slow  # ~6 s of PLD accounting
def test_sigma_with_the_size_release_keeps_the_composition_within_the_target():
    from privacy.events import GaussianEvent

    from tasks.dp_icl import first_batch_event, noise_for_queries, noise_with_release

    size = GaussianEvent(5.0)  # a large size release: ε ≈ 1 at δ = 1e-5
    sigma = noise_with_release(3.0, 1e-5, 200, 0.05, size)
    assert sigma > noise_for_queries(3.0, 1e-5, 200, 0.05)
    composed = acct.spend(first_batch_event(sigma, 200, 0.05, size), 1e-5).epsilon
    assert 0.95 * 3.0 < composed <= 3.0


def test_answers_already_charged_are_kept_whatever_stops_the_next_batch(engine, tmp_path, monkeypatch):
    from tasks.dp_icl import Served, answer_all

    server = _server(engine, _ledger(tmp_path, 1e3))
    real, calls = server.answer, []

    def flaky(texts, keep=None):
        calls.append(texts)
        if len(calls) == 2:
            raise MemoryError("out of memory")
        return real(texts, keep)

    monkeypatch.setattr(server, "answer", flaky)
    answers, failure = answer_all(Served(server, 1e-5, "toy", 1e3), ["a", "b", "c", "d"], 2)
    assert len(answers) == 2 and isinstance(failure, MemoryError)


def test_the_shared_token_clip_cuts_demonstrations_as_the_server_did(engine):
    """Review 6 F4: dp_icl's clip moved to ``tasks/methodkit/token_budget`` (shared with dp_fewshot and
    DP-OPT). On this tokenizer its cuts are the server's old ones, bit for bit (the first ``limit``
    tokens decoded), for long words, a CJK run without spaces and what already fits; every cut
    re-encodes within its limit and depends on the text alone."""
    import random
    import string

    from tasks.methodkit.token_budget import clip_text, clip_tokens, clip_words

    rnd = random.Random(5)
    texts = [" ".join("".join(rnd.choice(string.ascii_letters + string.digits) for _ in range(60)) for _ in range(48)),
             "".join(chr(rnd.randint(0x4E00, 0x9FFF)) for _ in range(2000)), "a short review", ""]
    for text in texts:
        ids = engine.ids(text)
        for limit in (1, 4, 17, 60, 200):
            old = text if len(ids) <= limit else engine.tok.decode(ids[:limit])
            assert clip_tokens(engine, text, limit) == old
            assert len(engine.ids(old)) <= limit
        assert clip_text(engine, text, None) == clip_words(text)
