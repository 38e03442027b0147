"""DP-OPT on a learned-position LM (tiny-gpt2, context 256): every private text of a meta-prompt is
cut to a PUBLIC token budget (``text_prompts.meta_text_budget``; up to 2k rows per member), and every
text scored by the forward pass (ŷ, the DP-argmax's holdout rows) to the room its instruction leaves
(``forward_text_budget``). One record that tokenizes long (48 very long words, a CJK "word" of 5,000
characters) neither crashes a query (an IndexError on D, a run on D′: a one-record test outside ε)
nor changes another member's meta-prompt or another row's count. The old code (48 whitespace words
only) raised IndexError here."""

import random
import string

import numpy as np
import pytest
import torch

from tasks.methods import PrivateRows, get_method
from tasks.methods.dp_opt import text_prompts

from tests.methods.test_method_contract import SHARED, _config

random.seed(11)
LONG_WORDS = " ".join("".join(random.choice(string.ascii_letters + string.digits) for _ in range(90))
                      for _ in range(48))
CJK = "".join(chr(random.randint(0x4E00, 0x9FFF)) for _ in range(5000))
BASE = PrivateRows(["a fine , moving film", "dull and tedious", "a joy to watch", "painfully bad"],
                   ["positive", "negative", "positive", "negative"])
INSTRUCTION = "Classify the input text as positive or negative."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tasks.config import parse_config

    if not (SHARED / "sst2").is_dir():
        pytest.skip("../shared/data is not available")
    cfg = parse_config(_config(tmp_path_factory.mktemp("dpopt_budget"), "dp_opt"))
    return cfg, text_prompts.engine_for(cfg)


def _members(cfg, engine, rows):
    """One query's meta-prompt bodies (q = 1: every row joins a member), the same secret draws."""
    from tasks.methods.dp_opt.method import _Proposer

    block = getattr(cfg.methods, "dp_opt")
    proposer = _Proposer(engine, cfg, block, INSTRUCTION, rows, np.random.default_rng(3),
                         np.random.default_rng(4), 1.0)
    return proposer.draw_bodies(), block


@pytest.mark.parametrize("record", [LONG_WORDS, CJK], ids=["48-long-words", "cjk-5000"])
def test_a_record_that_tokenizes_long_changes_its_member_only_and_every_query_runs(tiny, record):
    from tasks.methods.dp_opt.templates import backward_head

    cfg, engine = tiny
    context = engine.model.config.n_positions
    assert context == 256 and len(engine.ids(record)) > context  # the record alone outgrows the model
    base, _ = _members(cfg, engine, BASE)
    more, block = _members(cfg, engine, PrivateRows(BASE.texts + [record], BASE.labels + ["positive"]))
    assert len(base) == len(more) == block.meta_prompts
    assert sum(a != b for a, b in zip(base, more)) == 1  # the record's member; the others bitwise the same
    prefix = engine.encode_prefix(backward_head(INSTRUCTION))
    generated = engine.ids("the")[:1] * (block.max_new_tokens - 1)  # the longest query a candidate makes
    assert all(prefix.length + len(b) + len(generated) + 1 <= context for b in more)
    logits = engine.last_logits([b + generated for b in more], prefix)  # the old code: IndexError
    assert logits.shape[0] == len(more) and bool(logits.isfinite().all())


@pytest.mark.parametrize("batch_rows", [False, True], ids=["alone", "row-own-batches"])
@pytest.mark.parametrize("record", [LONG_WORDS, CJK], ids=["48-long-words", "cjk-5000"])
def test_the_dp_argmax_scores_a_long_holdout_row_and_moves_each_count_by_at_most_one(tiny, record, batch_rows,
                                                                                     monkeypatch):
    """Each row's prediction is its own on either path (batch_rows: the accelerator's, forced here):
    the added record moves each count by 0 or +1, and the other rows' predictions not at all."""
    cfg, engine = tiny
    monkeypatch.setattr(engine, "batch_rows", batch_rows)
    candidates = [INSTRUCTION, "rate the review", ""]
    counts = text_prompts.correct_counts(engine, cfg, candidates, BASE.texts, BASE.labels)
    more = text_prompts.correct_counts(engine, cfg, candidates, BASE.texts + [record], BASE.labels + ["positive"])
    assert set((more - counts).tolist()) <= {0.0, 1.0}
    first = text_prompts.label_logprobs(engine, cfg, INSTRUCTION, BASE.texts, rowwise=True)
    assert torch.equal(text_prompts.label_logprobs(engine, cfg, INSTRUCTION, [record] + BASE.texts, rowwise=True)[1:],
                       first)
    assert text_prompts.predictions(engine, cfg, INSTRUCTION, [record])[0] in cfg.data.labels  # ŷ of it


def test_a_scored_text_is_cut_alone_to_the_room_its_instruction_leaves(tiny):
    from tasks.methodkit.token_budget import clip_text

    cfg, engine = tiny
    room = text_prompts.forward_text_budget(engine, cfg, INSTRUCTION)
    assert 64 < room < 256 and text_prompts.forward_text_budget(engine, cfg, "") > room
    for text in (LONG_WORDS, CJK):
        assert 0 < len(engine.ids(clip_text(engine, text, room))) <= room
    assert clip_text(engine, BASE.texts[0], room) == BASE.texts[0]  # what fits is left alone


def test_settings_that_leave_no_room_are_refused_before_any_private_read(tmp_path):
    from tasks.config import parse_config
    from tasks.errors import ConfigError

    if not (SHARED / "sst2").is_dir():
        pytest.skip("../shared/data is not available")
    raw = _config(tmp_path, "dp_opt")
    raw["methods"]["dp_opt"] = {**raw["methods"]["dp_opt"], "demos": 5, "max_new_tokens": 30}
    with pytest.raises(ConfigError, match="dp_opt: up to 10 demos per meta-prompt.*context of 256 tokens"):
        get_method("dp_opt").mechanism.preflight(parse_config(raw), None)
