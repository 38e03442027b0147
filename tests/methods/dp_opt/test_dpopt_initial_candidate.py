"""Issue 38: DP-OPT (and OPT, DLN-1) never publish below the initial instruction — it is always one
of the selection's candidates (public: the DP-argmax's event is unchanged), counted like any other,
and the run record says whether the published prompt is generated or the initial one."""

from types import SimpleNamespace

import numpy as np
import pytest

from privacy import accountant as acct
from tasks.methods import get_method
from tasks.methods.dp_opt import method as dpopt_method
from tasks.methods.dp_opt import text_prompts
from tasks.methods.dp_opt.templates import initial_instruction
from tasks.methods.dp_opt.text_prompts import source_of, with_initial

from tests.methods.test_method_contract import ROWS, SHARED, _config

INITIAL = initial_instruction("sst2")


def test_initial_instruction_and_no_instruction_are_always_the_last_candidates_once():
    assert with_initial([], INITIAL) == [INITIAL, ""]
    assert with_initial(["a", "b"], INITIAL) == ["a", "b", INITIAL, ""]
    assert with_initial(["a", INITIAL, "b", " "], INITIAL) == ["a", "b", INITIAL, ""]  # kept once
    assert with_initial(["a"], "") == ["a", ""]  # an empty initial instruction is no instruction


def test_no_instruction_is_zero_shots_prompt_and_says_so():
    """An empty instruction renders as the forward template alone — the zero-shot prompt, not an
    "Instruction:" line with nothing after it — and the run record calls it ``none``."""
    from models.prompts import TextPrompt

    from tasks.methods.dp_opt.templates import eval_prefix

    base = "Input: {text}\n\nOutput:"
    assert TextPrompt("").template(base) == base and eval_prefix("") == ""
    assert TextPrompt("rate it").template(base) == "Instruction: rate it\n\n" + base
    assert source_of(text_prompts.source_metric("", INITIAL)) == "none"
    assert source_of(text_prompts.source_metric(INITIAL, INITIAL)) == "initial"
    assert source_of(text_prompts.source_metric("gen", INITIAL)) == "generated"


def test_selection_event_does_not_depend_on_the_number_of_candidates():
    """The DP-argmax is Gumbel noise on monotone sensitivity-1 counts: its event names no candidate
    count, so one more (public) candidate leaves the plan's event and ε as they were."""
    from tasks.methods.dp_opt.events import selection_event

    event = selection_event(2.0)
    assert 1.9 < acct.spend(event, 1e-5).epsilon <= 2.0 + 1e-9
    assert "candidates" not in repr(event)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tasks.config import parse_config
    from tasks.methods import MethodContext
    from tasks.randomness import DpRandomness
    from tasks.state import state_paths

    if not (SHARED / "sst2").is_dir():
        pytest.skip("../shared/data is not available")
    state = tmp_path_factory.mktemp("initial")
    paths = state_paths(str(state)).create()

    def mctx(method):
        cfg = parse_config(_config(state, method))
        return MethodContext(cfg, paths, {}, DpRandomness(), 0, dataset_key=f"initial-{method}")
    return mctx


@pytest.mark.slow  # ~18 s on 2 shared cores (a tiny LM scores 45 rows one by one)
def test_counts_include_the_initial_instruction_monotone_sensitivity_one(tiny):
    """On a tiny LM: the initial instruction's count is its own correct-count (as if scored alone), and
    adding one record moves every count, the initial's included, by 0 or +1."""
    mctx = tiny("dp_opt")
    engine = text_prompts.engine_for(mctx.cfg)
    cands = with_initial(["rate the review", "say positive"], INITIAL)
    texts, labels = ROWS.texts[:6], ROWS.labels[:6]
    counts = text_prompts.correct_counts(engine, mctx.cfg, cands, texts, labels)
    assert cands[-2:] == [INITIAL, ""]  # the initial instruction, then no instruction (zero-shot's template)
    alone = text_prompts.correct_counts(engine, mctx.cfg, [INITIAL, ""], texts, labels)
    assert counts[-2] == alone[0] and counts[-1] == alone[1]
    more = text_prompts.correct_counts(engine, mctx.cfg, cands, texts + [ROWS.texts[6]], labels + [ROWS.labels[6]])
    assert set((more - counts).tolist()) <= {0.0, 1.0}


def _fake_generation(monkeypatch, generated):
    out = {"candidates": list(generated), "queries": 3, "bottoms": 0, "tokens": 4, "stops": {"eos": 2}}
    monkeypatch.setattr(dpopt_method._Proposer, "candidates", lambda self, *a, **k: dict(out))
    monkeypatch.setattr(dpopt_method, "_leakage", lambda cfg, cands, texts, progress=None: {})


def _scripted_counts(monkeypatch, counts_of, seen):
    def counts(engine, cfg, candidates, texts, labels, units=None):
        seen.append(list(candidates))
        return np.array([counts_of(c) for c in candidates], dtype=float)
    monkeypatch.setattr(text_prompts, "correct_counts", counts)


@pytest.mark.parametrize("initial_wins", [True, False])
def test_dp_opt_publishes_the_initial_instruction_when_it_scores_best(tiny, monkeypatch, initial_wins):
    mctx = tiny("dp_opt")
    method = get_method("dp_opt")
    plan = method.mechanism.plan(mctx.cfg, len(ROWS), 1e-5)
    _fake_generation(monkeypatch, ["gen one", "gen two"])
    seen = []
    # counts far apart (the DP-argmax's Gumbel noise has scale 1/ε ≈ 0.13): the best always wins
    _scripted_counts(monkeypatch, lambda c: (1000 if initial_wins else 0) if c == INITIAL else
                     (500 if c == "gen two" else 0), seen)
    trained = method.mechanism.train(mctx, plan, ROWS)
    assert seen == [["gen one", "gen two", INITIAL, ""]]  # the vote counted the initial and no instruction
    assert trained.prompt.instruction == (INITIAL if initial_wins else "gen two")
    # the event is the plan's (the extra public candidate costs nothing)
    assert acct.spend(trained.event, 1e-5).epsilon <= acct.spend(plan.event, 1e-5).epsilon * (1 + 1e-9)
    choice = method.mechanism.chosen(mctx, plan, trained.metrics)
    assert choice.params == {"prompt.source": "initial" if initial_wins else "generated"}
    assert choice.meta["prompt.source"] == choice.params["prompt.source"]


@pytest.mark.parametrize("winner", [INITIAL, ""])
def test_dp_opt_with_nothing_generated_votes_between_the_initial_and_no_instruction(tiny, monkeypatch, winner):
    mctx = tiny("dp_opt")
    method = get_method("dp_opt")
    plan = method.mechanism.plan(mctx.cfg, len(ROWS), 1e-5)
    _fake_generation(monkeypatch, [])
    seen = []
    _scripted_counts(monkeypatch, lambda c: 1000 if c == winner else 0, seen)
    trained = method.mechanism.train(mctx, plan, ROWS)
    assert seen == [[INITIAL, ""]] and trained.prompt.instruction == winner
    assert source_of(trained.metrics) == ("initial" if winner else "none")


@pytest.mark.parametrize("name,scorer", [("opt", "correct_counts"), ("dln1", "label_loglik")])
def test_opt_and_dln1_select_the_initial_instruction_too(tiny, monkeypatch, name, scorer):
    mctx = tiny(name)
    method = get_method(name)
    plan = method.mechanism.plan(mctx.cfg, len(ROWS), 1e-5)
    monkeypatch.setattr(type(method.mechanism), "_generate", lambda self, m, rows, members, t: (None, ["g1", "g2"], INITIAL))
    monkeypatch.setattr(dpopt_method, "_leakage", lambda cfg, cands, texts, progress=None: {})
    seen = []
    monkeypatch.setattr(text_prompts, scorer, lambda engine, cfg, cands, texts, labels, *a: (
        seen.append(list(cands)) or np.array([5.0 if c == INITIAL else 1.0 for c in cands])))
    trained = method.mechanism.train(mctx, plan, ROWS)
    assert seen == [["g1", "g2", INITIAL, ""]] and trained.prompt.instruction == INITIAL
    # beside another published method, the baseline's source is labelled under its own name
    other = SimpleNamespace(cfg=SimpleNamespace(method="dp_opt"))
    assert method.mechanism.chosen(other, plan, trained.metrics).params == {f"audit.baseline.{name}.prompt.source": "initial"}
