"""DP-OPT's engine and loops on tiny random causal LMs: padding, KV reuse and caching change
nothing; the generation loop obeys ⊥ / retry / stop / budget and counts its queries."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tasks.methods.dp_opt.engine import CausalEngine, SharedPrefix
from tasks.methods.dp_opt.generate import dp_generate, ensemble_generate, reencode_generate
from models.backbones import load_backbone


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-gpt2"])
def engine(request):
    bb = load_backbone(request.param, "cpu", seed=3)
    return CausalEngine(bb.model, bb.tokenizer, max_batch=4, bucket_width=3, batch_rows=True)  # the GPU's path, on CPU


def _rows(engine, texts):
    return [engine.ids(t) for t in texts]


TEXTS = ["the movie was fine", "awful", "a long and winding review of a film that went on", "ok then"]


def test_left_padded_buckets_equal_one_by_one(engine):
    rows = _rows(engine, TEXTS)
    batched = engine.last_logits(rows)
    alone = torch.stack([engine.last_logits([r])[0] for r in rows])
    assert torch.allclose(batched, alone, atol=1e-4)


def test_a_members_vote_and_a_rows_label_are_its_own(engine, monkeypatch):
    """Review 6, F1: with ``last_logits``, a row's logits move with its companions' lengths (float
    rounding), so at a near-tie one record could flip another member's vote or another row's cached
    ŷ. ``last_logits_rowwise`` (the votes, and ŷ) gives each row bit for bit the logits it gets
    whatever its companions and its place among them, batched; the proposer labels through it."""
    from types import SimpleNamespace

    from tasks.methods.dp_opt import method as dpm

    prefix = engine.encode_prefix("instruction : classify the review")
    rows = _rows(engine, TEXTS) + [engine.ids("x " * k) for k in (2, 5, 9, 11, 13)]
    for batch_rows in (True, False):  # public batched shapes (an accelerator's default) / alone (a CPU's)
        engine.batch_rows = batch_rows
        try:
            own = engine.last_logits_rowwise(rows, prefix)
            for j, r in enumerate(rows):
                others = [engine.ids("y " * (3 + 4 * j))] + rows[:j] + rows[j + 1:]
                assert torch.equal(engine.last_logits_rowwise(others + [r], prefix)[-1], own[j])
                assert torch.equal(engine.last_logits_rowwise([r], prefix)[0], own[j])
            assert torch.allclose(own, engine.last_logits(rows, prefix), atol=1e-4)  # the same numbers, up to rounding
        finally:
            engine.batch_rows = True
    calls = []
    monkeypatch.setattr("tasks.methods.dp_opt.text_prompts.predictions",
                        lambda engine, cfg, instruction, texts, rowwise=False: calls.append((len(texts), rowwise))
                        or ["positive"] * len(texts))
    gen = SimpleNamespace(texts=TEXTS, labels=["positive"] * 4)
    proposer = dpm._Proposer.__new__(dpm._Proposer)
    proposer.engine, proposer.cfg, proposer.instruction, proposer.gen, proposer.yhat = engine, None, "i", gen, {}
    proposer.demos_of(np.array([0, 1, 2]))
    proposer.demos_of(np.array([2, 3]))
    assert calls == [(3, True), (1, True)]  # each new row once, row by row's own


def test_on_a_cpu_rows_run_alone_at_their_own_length_and_nothing_is_checked(engine):
    """The CPU default (bench_dpopt --mixed: batching bought nothing there and its padding, fill
    rows and checks cost several times the query): each row is exactly its own pass."""
    cpu = CausalEngine(engine.model, engine.tok, max_batch=4, bucket_width=3)
    assert cpu.batch_rows is False
    prefix = cpu.encode_prefix("instruction : classify the review")
    rows = _rows(cpu, TEXTS)
    got = cpu.last_logits_rowwise(rows, prefix)
    assert torch.equal(got, torch.cat([cpu._forward_left_padded([r], prefix) for r in rows]))
    assert not cpu.row_checks and got.shape == (len(rows), engine.last_logits(rows[:1], prefix).shape[1])


def test_a_shape_that_fails_the_row_check_runs_its_rows_alone(engine, monkeypatch):
    """If a device's kernels made a row depend on its companions for some batch shape, the first
    batch of that shape is caught (reverse order / beside pad rows) and its rows run alone."""
    rows = _rows(engine, ["the movie was fine", "awful movie", "ok then", "a joy"])
    real = engine._forward_left_padded

    def coupled(batch, prefix, length=None):  # a row's logits move with the first row's last token
        out = real(batch, prefix, length)
        return out + 1e-3 * batch[0][-1] if len(batch) > 1 else out
    # (the check runs on public probe rows, so which path a shape takes never depends on the data)

    fresh = CausalEngine(engine.model, engine.tok, max_batch=4, bucket_width=64, batch_rows=True)
    monkeypatch.setattr(fresh, "_forward_left_padded", coupled)
    got = fresh.last_logits_rowwise(rows)
    alone = torch.cat([real([r], SharedPrefix([], None), 64) for r in rows])
    assert torch.equal(got, alone) and not all(fresh.row_checks.values())


def test_shared_prefix_kv_equals_full_reencode(engine):
    prefix = engine.encode_prefix("instruction : classify the review")
    rows = _rows(engine, TEXTS)
    reused = engine.last_logits(rows, prefix)
    full = torch.stack([engine.last_logits([prefix.ids + r])[0] for r in rows])
    assert torch.allclose(reused, full, atol=1e-4)
    # the prefix cache is not consumed by a query
    assert torch.allclose(engine.last_logits(rows, prefix), reused, atol=1e-6)


def test_kv_cache_generation_equals_reencoding(engine):
    prefix = engine.ids("improve the instruction")
    bodies = _rows(engine, TEXTS[:3])
    a = ensemble_generate(engine, prefix, bodies, max_tokens=6, eos_ids={-1})
    b = reencode_generate(engine, prefix, bodies, max_tokens=6, eos_ids={-1})
    assert a.tokens == b.tokens and len(a.tokens) == 6


def test_same_generator_same_output(engine):
    rows = _rows(engine, TEXTS)
    logits = engine.last_logits(rows)
    a = engine.propose(logits, 1.1, torch.Generator().manual_seed(5))
    b = engine.propose(logits, 1.1, torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


def test_a_member_with_non_finite_logits_casts_no_vote(engine):
    """Review 6, F2: one member's logits NaN (+inf, or all -inf) propose -1 (no vote) at every
    temperature instead of failing the query; the other members' proposals are those they make
    beside a finite row (the same draws)."""
    logits = engine.last_logits(_rows(engine, TEXTS[:3]))
    for temperature in (0.0, 1.1):
        base = engine.propose(logits, temperature, torch.Generator().manual_seed(7))
        for bad in (float("nan"), float("inf"), float("-inf")):
            broken = logits.clone()
            broken[1] = bad if bad != float("inf") else broken[1]
            if bad == float("inf"):
                broken[1, 0] = bad
            got = engine.propose(broken, temperature, torch.Generator().manual_seed(7))
            assert got[1].item() == -1
            assert got[0] == base[0] and got[2] == base[2]


def test_a_tiny_temperature_overflow_casts_no_vote_instead_of_failing_the_query(engine):
    """Review 7, G2: finite logits divided by a tiny temperature overflow to inf (NaN after softmax):
    the row is screened after the division and proposes -1; the query does not raise."""
    logits = torch.tensor([[0.1, 0.2, 0.3], [40.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    got = engine.propose(logits, 1e-37, torch.Generator().manual_seed(0))
    assert got[1].item() == -1 and got.shape == (3,)


def _dp_loop(engine, answers, budget=100, max_tokens=8):
    """dp_generate with a scripted `select` (returns the next answer) and counting callbacks."""
    calls = {"draw": 0, "select": 0}

    def draw():
        calls["draw"] += 1
        return _rows(engine, TEXTS[:2])

    def select(counts):
        calls["select"] += 1
        assert counts.sum() == 2  # one vote per meta-prompt
        return answers.pop(0) if answers else 7

    out = dp_generate(engine, SharedPrefix([], None), draw, select, lambda n: n <= budget, max_tokens,
                      eos_ids={99})
    return out, calls


def test_bottom_retries_once_and_two_in_a_row_end_the_prompt(engine):
    out, calls = _dp_loop(engine, [5, None, 6, None, None])
    assert out.tokens == [5, 6] and out.bottoms == 3 and out.stop_reason == "two_bottoms"
    assert out.queries == calls["select"] == calls["draw"] == 5  # a fresh subsample per query


def test_eos_and_max_tokens_end_the_prompt(engine):
    out, _ = _dp_loop(engine, [5, 99])
    assert out.tokens == [5] and out.stop_reason == "eos" and out.queries == 2
    out, _ = _dp_loop(engine, [], max_tokens=3)
    assert out.tokens == [7, 7, 7] and out.stop_reason == "max_tokens" and out.queries == 3


def test_budget_exhaustion_stops_before_an_unaffordable_query(engine):
    out, calls = _dp_loop(engine, [], budget=4, max_tokens=10)
    assert out.queries == calls["select"] == 4 and out.stop_reason == "budget" and len(out.tokens) == 4


def test_empty_subsample_still_queries(engine):
    seen = []
    out = dp_generate(engine, SharedPrefix([], None), lambda: [], lambda c: seen.append(c.sum()) or None,
                      lambda n: True, 5, eos_ids={99})
    assert out.queries == 2 and out.bottoms == 2 and seen == [0, 0]


@pytest.mark.parametrize("model", ["tiny-llama", "minilm"])
def test_a_long_text_prompt_does_not_eat_the_inputs_token_budget(model, tmp_path):
    """ICL's prompt (instruction + demos) can be longer than models.max_length: the evaluation
    encodes each input with the same text budget as without a prompt (it once failed with
    'max_length leaves no room for text')."""
    from models.prompts import TextPrompt
    from tasks.config import parse_config
    from tasks.methodkit.classifiers import input_length, prompted

    cfg = parse_config({"method": "icl", "experiment": "x", "state_dir": str(tmp_path),
                        "allow_nonprivate_baselines": True,
                        "data": {"name": "sst2", "labels": ["negative", "positive"]},
                        "models": {"local": model, "max_length": 16}})
    long_prompt = TextPrompt("Classify the review. " + " ".join(f"Input: review number {i} was fine\nOutput: positive"
                                                                for i in range(12)))
    bare, _ = prompted(cfg, model, None)
    clf, _ = prompted(cfg, model, long_prompt)
    assert clf.template_tokens > cfg.models.max_length  # the prompt alone is longer than max_length
    texts = ["a quite long review " * 10, "short"]
    with_prompt = clf.encode(texts, max_length=input_length(cfg, model, clf))
    without = bare.encode(texts, max_length=input_length(cfg, model, bare))
    assert input_length(cfg, model, bare) == cfg.models.max_length
    text_tokens = lambda enc, c: (enc["attention_mask"].sum(1) - c.template_tokens).tolist()  # noqa: E731
    assert text_tokens(with_prompt, clf) == text_tokens(without, bare)
    assert text_tokens(without, bare)[0] == cfg.models.max_length - bare.template_tokens  # truncated to the budget


def test_leakage_report_names_are_audit_statistics():
    """Exact statistics of private texts are published only under ``audit.`` (RUN_RECORD.md)."""
    from tasks.methods.dp_opt.leakage import leakage_report

    private = ["the quick brown fox jumps over the lazy dog", "a b"]
    report = leakage_report(["say: the quick brown fox jumps over the lazy dog!", "classify it"], private)
    assert report == {"audit.leakage.exact_copies": 1.0, "audit.leakage.prompts": 2.0}


def test_a_template_whose_sides_merge_without_the_text_leaves_room_for_them():
    """Review 10b, G2: on tiny-gpt2's WordPiece the input template without its text ('xq'×30 + 'zk'×30 joined:
    one word of over 100 characters) counted one [UNK] where around a text its sides are 60 tokens, so a long
    private row scored alone (ŷ, the DP-argmax's holdout) outgrew the 256 positions. Counted apart, the
    sides leave the row room: a long record is scored on both paths and changes no other row."""
    from tasks.methods.dp_opt.text_prompts import forward_text_budget, label_logprobs

    bb = load_backbone("tiny-gpt2", "cpu", seed=3)
    engine = CausalEngine(bb.model, bb.tokenizer, max_batch=4)
    cfg = SimpleNamespace(models=SimpleNamespace(template="xq" * 30 + "{text}" + "zk" * 30),
                          data=SimpleNamespace(labels=["negative", "positive"]))
    room = forward_text_budget(engine, cfg, "Classify the review.")
    assert room <= 256 - 60  # the sides' 60 tokens are counted
    rows = ["a fine film", "boring", "i liked it a lot"]
    long_row = " ".join("qzx%dkjw%dvvb" % (i, i * 7) for i in range(48))
    for rowwise in (False, True):
        base = label_logprobs(engine, cfg, "Classify the review.", rows, rowwise=rowwise)
        more = label_logprobs(engine, cfg, "Classify the review.", rows + [long_row], rowwise=rowwise)
        assert more.shape == (4, 2)
        if rowwise:
            assert torch.equal(more[:3], base)


@pytest.mark.parametrize("template, record", [
    ("Input: x{text}\n\nOutput:", " ".join(["physics" * 13] + ["qzx%dkjw%dvvb" % (i, i * 7) for i in range(47)])),
    ("{text}", "\u200b"),
], ids=["a-letter-glued-to-the-text", "a-record-of-no-token"])
def test_one_record_never_makes_a_scored_forward_raise(template, record):
    """Privacy review 10c: a letter glued before {text} merges with a record's first word (13 tokens alone, 40
    glued) past the budget's seam slack, and a record of only zero-width characters in a template with nothing
    around it tokenizes to nothing — either raised in the forward (ŷ, the DP-argmax holdout) on D′ where D
    ran. The engine fits every scored row (its last tokens; a public stand-in for none): both paths score the
    added record and move no other row."""
    from tasks.methods.dp_opt.text_prompts import label_logprobs

    bb = load_backbone("tiny-gpt2", "cpu", seed=3)
    engine = CausalEngine(bb.model, bb.tokenizer, max_batch=4)
    cfg = SimpleNamespace(models=SimpleNamespace(template=template), data=SimpleNamespace(labels=["negative", "positive"]))
    rows = ["a fine film", "boring"]
    for rowwise in (False, True):
        base = label_logprobs(engine, cfg, "Classify the review.", rows, rowwise=rowwise)
        more = label_logprobs(engine, cfg, "Classify the review.", rows + [record], rowwise=rowwise)
        assert more.shape == (3, 2) and torch.isfinite(more).all()
        if rowwise:
            assert torch.equal(more[:2], base)


def test_a_head_longer_than_the_context_leaves_a_row_room():
    """Review 10d, L1: a released candidate that re-encodes longer than its generated tokens can fill the
    context on its own; scoring a holdout of one row then raised where an empty holdout did not (a 0-vs-1
    test). The shared head keeps its first tokens up to the context less HEAD_ROOM: a row always fits."""
    from tasks.methodkit.causal_engine import HEAD_ROOM
    from tasks.methods.dp_opt.templates import eval_prefix
    from tasks.methods.dp_opt.text_prompts import label_logprobs

    bb = load_backbone("tiny-gpt2", "cpu", seed=3)
    engine = CausalEngine(bb.model, bb.tokenizer, max_batch=4)
    cfg = SimpleNamespace(models=SimpleNamespace(template="Input: {text}\n\nOutput:"),
                          data=SimpleNamespace(labels=["negative", "positive"]))
    instruction = " ".join(["physics"] * 300)  # a public candidate of ≈ 300 tokens, over the 256 positions
    for rowwise in (False, True):
        scores = label_logprobs(engine, cfg, instruction, ["a fine film"], rowwise=rowwise)
        assert scores.shape == (1, 2) and torch.isfinite(scores).all()
    assert engine._head(eval_prefix(instruction)).length == engine.max_positions - HEAD_ROOM


def test_leakage_audit_shows_tenths_never_the_private_count():
    """The near-copy pass over every private text (minutes on a CPU at the paper's scale) reports its
    progress in tenths under its own stage name: the same ten steps for any number of texts, never a count
    (nor a number of chunks) that would give the training set's size."""
    from models.backbones import load_backbone
    from tasks.methods.dp_opt.leakage import leakage_report

    private = [f"private review number {i}" for i in range(5000)]  # 3 chunks of 2,048
    calls = []
    bb = load_backbone("tiny-bert")  # its BERT encoder stands in for MiniLM (same mean-pooled recipe)
    encoder = SimpleNamespace(tokenizer=bb.tokenizer, model=bb.model.bert, device=bb.device)
    report = leakage_report(["classify the review"], private, encoder,
                            progress=lambda step, total, **kw: calls.append((step, total, kw)))
    assert [c[0] for c in calls] == list(range(1, 11)) and {c[1] for c in calls} == {10}
    assert {c[2]["stage"] for c in calls} == {"leakage audit"}
    assert report["audit.leakage.prompts"] == 1.0 and -1.0 <= report["audit.leakage.max_similarity"] <= 1.0
    for n in (7, 0):  # a few texts, or none: the same ten lines (a count of chunks would give the size's bucket)
        few = []
        leakage_report(["classify the review"], private[:n], encoder, progress=lambda step, total, **kw: few.append(step))
        assert few == list(range(1, 11))


def test_attention_backends_leave_out_cudnn_on_cuda_only():
    """CUDA forwards of the engine run without cuDNN attention (a plan per new shape: fresh shapes are
    most of DP-OPT's calls); the switches come back as they were; on the CPU nothing changes."""
    from tasks.methods.dp_opt.engine import attention_backends

    cuda = torch.backends.cuda
    before = (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(),
              cuda.math_sdp_enabled())
    assert before[0], "torch enables cuDNN attention by default"
    with attention_backends(torch.device("cuda")):
        assert not cuda.cudnn_sdp_enabled()
        assert cuda.flash_sdp_enabled() and cuda.mem_efficient_sdp_enabled() and cuda.math_sdp_enabled()
    with attention_backends(torch.device("cpu")):
        assert cuda.cudnn_sdp_enabled()
    assert (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(),
            cuda.math_sdp_enabled()) == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_engine_on_cuda_runs_without_cudnn_attention_and_matches_one_by_one():
    bb = load_backbone("tiny-llama", "cuda", seed=3)
    eng = CausalEngine(bb.model, bb.tokenizer, max_batch=4, bucket_width=3)
    seen = []
    handle = bb.model.register_forward_pre_hook(lambda *_: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    try:
        prefix = eng.encode_prefix("instruction : classify the review")
        rows = _rows(eng, TEXTS)
        batched = eng.last_logits(rows, prefix)
        alone = torch.stack([eng.last_logits([r], prefix)[0] for r in rows])
        state = eng.start(rows)
        eng.step(state, torch.zeros(len(rows), dtype=torch.long))
    finally:
        handle.remove()
    assert seen and not any(seen)
    assert torch.allclose(batched, alone, atol=1e-4)
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_a_row_scored_alone_does_not_depend_on_the_other_rows(engine):
    """DP-argmax's counts are scored one row per call (text_prompts.correct_counts): a row's label
    log-probabilities are then the same, bit for bit, whatever else was scored — so adding one
    holdout record moves each candidate's count by at most one, and only up (batched, float
    rounding with the neighbours' padding could flip another row)."""
    words = [" good", " bad"]

    def template(t):
        return f"Input: {t}\nOutput:"

    alone = [engine.label_logprobs("Instruction: classify\n\n", [t], words, template) for t in TEXTS]
    engine.label_logprobs("Instruction: classify\n\n", ["an added, much longer record " * 8] + TEXTS, words, template)
    again = [engine.label_logprobs("Instruction: classify\n\n", [t], words, template) for t in TEXTS]
    assert all(torch.equal(a, b) for a, b in zip(alone, again))


def test_a_longrope_model_gives_a_row_the_same_bits_beside_a_longer_record():
    """Review 9b, G1: longrope RoPE picks its long or short factors from the batch's LARGEST position
    id; numbered from each row's mask, that was the longest record's length, so one record switched
    the other rows' factors (and the probe check, its first probe always full length, passed). Padding
    now sits at the shape's last position: the largest position id is public."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = load_backbone("tiny-llama", "cpu").tokenizer
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                      rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
                                       "long_factor": [4.0] * 4, "original_max_position_embeddings": 32})
    eng = CausalEngine(LlamaForCausalLM(cfg).eval(), tok, batch_rows=True)
    prefix = eng.encode_prefix("one two three four five six seven eight nine ten")
    a, b = [200 + i for i in range(18)], [300 + i for i in range(31)]  # one bucket; head + b passes 32, head + a not
    assert prefix.length + len(a) < 32 < prefix.length + len(b)
    assert torch.equal(eng.last_logits_rowwise([a], prefix)[0], eng.last_logits_rowwise([a, b], prefix)[0])


def test_rows_that_mix_at_a_fixed_shape_are_never_batched():
    """Review 9b, G2/G3: LLM.int8 picks outlier columns over the whole batch, and a mixture of experts
    routes tokens over it — a row's bits depend on its companions' values, which no probe check can
    rule out: such models score every row alone, on every device."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from models.row_own import batch_rows_default, rows_mix
    from models.scoring import row_wise_logits

    tok = load_backbone("tiny-llama", "cpu").tokenizer
    moe = MixtralForCausalLM(MixtralConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
                                           num_experts_per_tok=2)).eval()
    assert "experts" in rows_mix(moe) and not batch_rows_default("cuda", moe)
    assert CausalEngine(moe, tok, batch_rows=True).batch_rows is False
    dense = load_backbone("tiny-llama", "cpu").model
    assert rows_mix(dense) is None and batch_rows_default("cuda", dense)
    int8 = torch.nn.Linear(2, 2)
    int8.quantization_config = {"load_in_8bit": True}  # bitsandbytes' default threshold, 6.0
    assert "8-bit" in rows_mix(int8)
    int8.quantization_config = {"load_in_8bit": True, "llm_int8_threshold": 0.0}  # no outlier columns
    assert rows_mix(int8) is None
    int8.quantization_config = {"load_in_4bit": True}  # NF4: per-weight blocks, rows stay their own
    assert rows_mix(int8) is None
    from models.classifiers import VerbalizerCausalLM
    from models.backbones import Backbone

    clf = VerbalizerCausalLM(Backbone("moe", "causal", moe, tok, 16), ["negative", "positive"])
    row_wise_logits(clf, ["a fine film", "dull"], 32, batch_rows=True)
    assert not clf.row_checks  # forced batching refused: every row ran alone
