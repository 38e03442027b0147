"""dp_icl under the neighbour harness's datasets (review 10, F2: the harness iterates the registered
methods' plans, and dp_icl — served per query, not a method — was never among them). On the harness's
source D and every neighbour D′ of its record unit (one record added or removed, in training or in
test), the REAL server (tasks/dp_icl.py: the project's split rule, its keyed partition under the same
secret key, the real prompts on tiny-gpt2) answers the same public queries: each query's vote
histogram moves by at most √2 in L2 — the sensitivity its Gaussian is charged for. Every person unit
of the harness is refused in one line before anything is read."""

import math
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from tasks import neighbours
from tests.claims.test_neighbour_harness import BASE_TEST, BASE_TRAIN, KEY, UNITS, _config, _source, neighbours_of

QUERIES = ["a good film , warm and fine", "dull , awful and cold", "great"]


@pytest.fixture(scope="module")
def engine():
    from models.backbones import load_backbone
    from tasks.methodkit.causal_engine import CausalEngine

    bb = load_backbone("tiny-gpt2", "cpu", seed=3)
    return CausalEngine(bb.model, bb.tokenizer, max_batch=4)


def _served(engine, source, cfg, tmp_path):
    """(each query's vote histogram, the subsets' prompts as token tuples) of the real server on ``source``."""
    from privacy.ledger import Ledger
    from tasks.dp_icl import DPICLServer, DPICLSettings
    from tasks.randomness import DpRandomness

    ledger = Ledger(tmp_path / f"ledger-{len(list(tmp_path.iterdir()))}.sqlite")
    ledger.register_dataset("fp", "people", 1e3, 1e-4)
    rows = neighbours.training_rows(source, cfg, KEY)
    server = DPICLServer(engine, list(cfg.data.labels), rows, DPICLSettings(subsets=4, shots=2, noise_multiplier=2.0),
                         ledger, "fp", DpRandomness(seeded=True, seed=7))  # the same secret partition key on D and D′
    return np.stack([server.histogram(q) for q in QUERIES]), Counter(tuple(p.ids) for p in server._query_prefixes())


def test_one_record_moves_one_subsets_prompt_and_each_histogram_by_at_most_root_two(engine, tmp_path):
    from tasks.config import parse_config

    cfg = parse_config(_config(tmp_path, "prompt_dpsgd", "record", "off"))
    here, prompts = _served(engine, _source(BASE_TRAIN, BASE_TEST), cfg, tmp_path)
    assert (here.sum(axis=1) >= 1).all()
    changed = []
    for how, other in neighbours_of("record").items():
        there, their_prompts = _served(engine, other, cfg, tmp_path)
        for a, b in zip(here, there):  # whatever the model votes: one vote moved at most
            assert float(np.linalg.norm(a - b)) <= math.sqrt(2) + 1e-12, how
        gone, new = prompts - their_prompts, their_prompts - prompts  # one subset's prompt replaced, or one (dis)appears
        assert sum(gone.values()) <= 1 and sum(new.values()) <= 1, how
        changed.append(sum(gone.values()) + sum(new.values()))
    assert max(changed) > 0  # the neighbours do change a subset's prompt: the check is not vacuous


@pytest.mark.parametrize("unit", [u for u in UNITS if u != "record"])
def test_every_person_unit_is_refused_before_any_read(unit, tmp_path):
    from tasks.config import parse_config
    from tasks.dp_icl import check_unit
    from tasks.errors import ConfigError

    cfg = parse_config(_config(tmp_path, "prompt_dpsgd", unit, "off"))
    with pytest.raises(ConfigError, match="holds for one record, not one person"):
        check_unit(cfg)


@pytest.mark.parametrize("queries", [2, 13, 50])  # fewer than the holdout's 26 rows (a swap), and more (padding)
def test_the_comparison_with_zero_shot_moves_by_at_most_two(engine, tmp_path, queries):
    """The released count of the comparison with zero-shot (tasks/dp_icl.py, DPICLServer.compare, run
    with its noise drawn as 0 on the partition's real holdout of D and of every record neighbour D′, the same secret
    key): each row scores +1 or −1 (adversarially: every row counts), and one record changes the H rows
    of lowest keyed hash by at most one swap — D moves by ≤ 2, the sensitivity its Gaussian is charged
    for. The votes here are a function of the query alone: what one training record does to them is the
    histogram test above (each answer is a charged query)."""
    from privacy.ledger import Ledger
    from tasks.config import parse_config
    from tasks.dp_icl import DPICLServer, DPICLSettings
    from tasks.randomness import DpRandomness

    cfg = parse_config(_config(tmp_path, "prompt_dpsgd", "record", "off"))

    def released(source):
        _, rows = neighbours.split_rows(source, cfg, KEY)
        texts, labels, _ = rows.holdout
        ledger = Ledger(tmp_path / f"ledger-{len(list(tmp_path.iterdir()))}.sqlite")
        ledger.register_dataset("fp", "records", 1e4, 1e-4)
        server = DPICLServer(engine, list(cfg.data.labels), neighbours.training_rows(source, cfg, KEY),
                             DPICLSettings(subsets=4, shots=2, noise_multiplier=2.0), ledger, "fp",
                             DpRandomness(seeded=True, seed=7))
        truth = dict(zip(texts, labels))
        right = lambda t: len(t) % 2 == 1  # noqa: E731 - the vote right on odd-length texts, zero-shot on even
        other = lambda y: next(x for x in cfg.data.labels if x != y)  # noqa: E731
        server._vote = lambda t: truth[t] if t in truth and right(t) else other(truth.get(t, cfg.data.labels[0]))
        server.zero_shot = lambda ts: [truth[t] if t in truth and not right(t) else other(truth.get(t, cfg.data.labels[0]))
                                       for t in ts]
        server.noise = SimpleNamespace(standard_normal=lambda: 0.0, permutation=lambda n: list(range(n)))  # D̃ = D
        return server.compare(texts, labels, queries, 1.0, KEY)["difference"], len(texts)

    here, n_holdout = released(_source(BASE_TRAIN, BASE_TEST))
    moves = []
    for how, other_source in neighbours_of("record").items():
        there, _ = released(other_source)
        assert abs(here - there) <= 2, how
        moves.append(abs(here - there))
    if queries >= n_holdout // 2:
        assert max(moves) > 0  # the neighbours do move D: the check is not vacuous
