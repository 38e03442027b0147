"""POST model layer: student construction, distillation, public-data prompt transfer, student
save/load (tiny random models on CPU; MiniLM only for a layer-copy check, no training)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from models import SoftPrompt, build_classifier, load_backbone, select_rows
from models.classifiers import CosineEncoderClassifier
from tasks.methods.post.distill import (
    DistillConfig,
    _layer_container,
    _mask_tokens,
    build_student,
    distill,
    distill_losses,
    freeze,
    load_student,
    num_layers,
    save_student,
    student_layer_indices,
)
from models.backbones import Backbone, ModelLoadError
from models.prompt_transfer import (
    TransferConfig,
    fixed_outputs,
    init_target_prompt,
    transfer_loss,
    PublicObjective,
    transfer_objective,
    transfer_prompt,
    vocab_logits,
)

DEV = "cpu"
LABELS = ["negative", "positive"]
TWEETS = Path(__file__).resolve().parents[4] / "shared" / "data" / "tweet_sentiment" / "validation.jsonl"
TEXTS = [
    "a great movie",
    "terrible , boring and far too long , i walked out before the end",
    "ok",
    "the acting was wonderful and the story moving",
    "bad",
    "not my kind of film but the music was nice",
]
ARCHS = ["gpt2", "llama", "bert-masked", "bert-encoder"]
KIND = {"gpt2": "causal", "llama": "causal", "bert-masked": "masked", "bert-encoder": "encoder"}


def _tokenizer():
    return load_backbone("tiny-bert", DEV).tokenizer  # the MiniLM WordPiece tokenizer, shared read-only


def make_teacher(arch: str, n_layers: int = 4, seed: int = 0, init_range: float = 0.2) -> Backbone:
    """A frozen tiny random teacher with ``n_layers`` layers (the registry's tiny models have 2),
    initialised 10x wider than usual so that its outputs depend visibly on a prompt."""
    from transformers import BertConfig, BertForMaskedLM, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    tok = _tokenizer()
    special = dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.cls_token_id,
                   eos_token_id=tok.sep_token_id, initializer_range=init_range)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if arch == "gpt2":
            model = GPT2LMHeadModel(GPT2Config(n_positions=128, n_embd=32, n_layer=n_layers, n_head=2, **special))
        elif arch == "llama":
            model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=n_layers,
                                                 num_attention_heads=4, num_key_value_heads=2,
                                                 max_position_embeddings=128, tie_word_embeddings=False, **special))
        else:
            cfg = BertConfig(hidden_size=32, num_hidden_layers=n_layers, num_attention_heads=2, intermediate_size=64,
                             max_position_embeddings=128, **special)
            model = BertForMaskedLM(cfg) if arch == "bert-masked" else BertModel(cfg)
    model.requires_grad_(False).eval()
    return Backbone(f"tiny4-{arch}", KIND[arch], model, tok, 32)


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _encode(bb: Backbone, texts=TEXTS, max_length: int = 24):
    return bb.tokenizer(list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt")


def _outputs(bb: Backbone, enc) -> torch.Tensor:
    with torch.no_grad():
        out = bb.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
    return out.last_hidden_state if bb.kind == "encoder" else out.logits


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread for these tiny models (two threads on a shared 2-core machine run
    several times slower); restored afterwards."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def public_texts() -> list[str]:
    if not TWEETS.is_file():
        pytest.skip(f"{TWEETS} is not available")
    with TWEETS.open() as f:
        rows = [json.loads(line)["text"] for _, line in zip(range(64), f)]
    return rows


# ---------------------------------------------------------------------------- student construction


def test_student_layer_indices():
    assert student_layer_indices(12, 2) == [0, 11]
    assert student_layer_indices(6, 2) == [0, 5]
    assert student_layer_indices(48, 4) == [0, 1, 46, 47]
    assert student_layer_indices(4, 3) == [0, 1, 3]
    assert student_layer_indices(4, 1) == [0]
    assert student_layer_indices(4, 4) == [0, 1, 2, 3]
    for bad in (0, 5):
        with pytest.raises(ValueError):
            student_layer_indices(4, bad)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("n", [2, 3])
def test_build_student_copies_first_and_last_layers(arch, n):
    teacher = make_teacher(arch)
    before = _snapshot(teacher.model)
    student = build_student(teacher, n)
    expected = student_layer_indices(4, n)
    assert list(student.copied_layers) == expected
    assert student.teacher_name == teacher.name and student.kind == teacher.kind
    assert student.tokenizer is teacher.tokenizer and student.embed_dim == teacher.embed_dim
    assert num_layers(student) == n and student.model.config.num_hidden_layers == n
    if arch == "gpt2":
        assert student.model.config.n_layer == n
    t_layers, s_layers = _layer_container(teacher.model)[2], _layer_container(student.model)[2]
    for s_idx, t_idx in enumerate(expected):
        t_sd, s_sd = t_layers[t_idx].state_dict(), s_layers[s_idx].state_dict()
        assert t_sd.keys() == s_sd.keys()
        for k in t_sd:
            assert torch.equal(t_sd[k], s_sd[k]), (s_idx, t_idx, k)
            assert t_sd[k].data_ptr() != s_sd[k].data_ptr()  # a copy, not shared storage
        for sub in s_layers[s_idx].modules():  # KV-cache slots renumbered
            if isinstance(getattr(sub, "layer_idx", None), int):
                assert sub.layer_idx == s_idx
    # the copied layers are different teacher layers (not all the same one)
    flat = lambda m: torch.cat([q.flatten() for q in m.parameters()])  # noqa: E731
    assert not torch.equal(flat(t_layers[expected[0]]), flat(t_layers[expected[-1]]))
    # everything outside the layer list (embeddings, final norm, pooler, LM head) is copied
    t_sd, s_sd = teacher.model.state_dict(), student.model.state_dict()
    t_other = {k: v for k, v in t_sd.items() if ".layer." not in k and ".h." not in k and ".layers." not in k}
    s_other = {k: v for k, v in s_sd.items() if ".layer." not in k and ".h." not in k and ".layers." not in k}
    assert t_other.keys() == s_other.keys() and len(t_other) > 0
    assert all(torch.equal(t_other[k], s_other[k]) for k in t_other)
    assert torch.equal(student.model.get_input_embeddings().weight, teacher.model.get_input_embeddings().weight)
    if teacher.kind != "encoder":
        t_head, s_head = teacher.model.get_output_embeddings(), student.model.get_output_embeddings()
        assert torch.equal(t_head.weight, s_head.weight)
        tied = t_head.weight is teacher.model.get_input_embeddings().weight
        assert (s_head.weight is student.model.get_input_embeddings().weight) == tied
    # student trainable; teacher untouched and still frozen
    assert all(p.requires_grad for p in student.model.parameters())
    assert not any(p.requires_grad for p in teacher.model.parameters())
    assert num_layers(teacher) == 4 and teacher.model.config.num_hidden_layers == 4
    assert _same_state(before, _snapshot(teacher.model))
    # the student runs, standalone and as a prompt classifier
    enc = _encode(student)
    assert torch.isfinite(_outputs(student, enc)).all()
    clf = build_classifier(freeze(student), LABELS)
    logits = clf(clf.encode(TEXTS[:3], 24), SoftPrompt(3, 32).weight)
    assert logits.shape == (3, 2) and torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_full_depth_student_matches_teacher(arch):
    teacher = make_teacher(arch)
    student = build_student(teacher, 4)
    enc = _encode(teacher)
    assert torch.equal(_outputs(teacher, enc), _outputs(student, enc))
    # a 2-layer student is a different function
    assert not torch.allclose(_outputs(teacher, enc), _outputs(build_student(teacher, 2), enc))


def test_llama_student_generates_with_kv_cache():
    student = freeze(build_student(make_teacher("llama"), 2))
    ids = _encode(student, TEXTS[:1])["input_ids"]
    out = student.model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (1, ids.shape[1] + 3)


def test_minilm_student_first_and_last_layer():
    try:
        teacher = load_backbone("minilm", DEV)
    except ModelLoadError as e:
        pytest.skip(str(e))
    student = build_student(teacher, 2)
    assert list(student.copied_layers) == [0, 5] and student.kind == "encoder"
    t_layers, s_layers = _layer_container(teacher.model)[2], _layer_container(student.model)[2]
    assert len(t_layers) == 6 and len(s_layers) == 2
    for s_idx, t_idx in enumerate([0, 5]):
        for (k, a), (_, b) in zip(t_layers[t_idx].state_dict().items(), s_layers[s_idx].state_dict().items()):
            assert torch.equal(a, b), k
    clf = CosineEncoderClassifier(freeze(student), LABELS)
    assert clf(clf.encode(TEXTS[:2], 32), None).shape == (2, 2)


# ---------------------------------------------------------------------------- distillation


def test_mask_tokens_skips_specials_and_padding():
    tok = _tokenizer()
    enc = _encode(make_teacher("bert-masked"), TEXTS * 4, 32)
    ids, attn = enc["input_ids"], enc["attention_mask"]
    g = torch.Generator().manual_seed(0)
    corrupted, labels = _mask_tokens(ids, attn, tok, len(tok), 0.15, g)
    sel = labels != -100
    special = torch.tensor(tok.all_special_ids)
    assert sel.any() and not torch.isin(ids[sel], special).any() and attn[sel].all()
    assert torch.equal(labels[sel], ids[sel])
    assert torch.equal(corrupted[~sel], ids[~sel])  # only selected tokens change
    frac = sel.sum() / (attn.bool() & ~torch.isin(ids, special)).sum()
    assert 0.05 < float(frac) < 0.3
    assert (corrupted[sel] == tok.mask_token_id).float().mean() > 0.5


@pytest.mark.parametrize("arch", ["gpt2", "bert-masked", "bert-encoder"])
def test_distill_losses_vanish_for_identical_student(arch):
    """A full-depth copy in eval mode reproduces the teacher: the KL and cosine terms are ~0."""
    teacher = make_teacher(arch)
    student = build_student(teacher, 4)
    enc = _encode(teacher)
    cfg = DistillConfig(steps=1)
    labels = None
    ids = enc["input_ids"]
    if arch == "bert-masked":
        ids, labels = _mask_tokens(ids, enc["attention_mask"], teacher.tokenizer, len(teacher.tokenizer), 0.15,
                                   torch.Generator().manual_seed(0))
    loss, terms = distill_losses(teacher, student, ids, enc["attention_mask"], cfg, labels)
    assert terms["cos"] < 1e-5
    if arch == "bert-encoder":
        assert set(terms) == {"cos", "pool"} and terms["pool"] < 1e-5
    else:
        assert set(terms) == {"ce", "lm", "cos"} and terms["ce"] < 1e-5
        assert terms["lm"] > 5.0  # a random model's LM loss is ~ln(30522)
    # a 2-layer student differs from the teacher
    _, terms2 = distill_losses(teacher, build_student(teacher, 2), ids, enc["attention_mask"], cfg, labels)
    assert terms2["cos"] > 1e-6 and terms2["cos"] > 10 * terms["cos"]


@pytest.mark.slow  # suite time: runs with -m slow
@pytest.mark.parametrize("arch", ["gpt2", "bert-masked", "bert-encoder"])
def test_distillation_reduces_loss_and_leaves_teacher_alone(arch, public_texts):
    teacher = make_teacher(arch)
    before = _snapshot(teacher.model)
    student = build_student(teacher, 2)
    calls = []
    cfg = DistillConfig(steps=20, batch_size=8, lr=2e-3, max_length=32, log_every=10, seed=0)
    result = distill(teacher, student, public_texts, cfg, progress=lambda s, t, l: calls.append((s, t, l)))
    assert result.steps == 20 and len(result.history) == 20
    losses = [h["loss"] for h in result.history]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first * 0.95, (first, last)
    key = "cos" if arch == "bert-encoder" else "lm"
    assert sum(h[key] for h in result.history[-5:]) < sum(h[key] for h in result.history[:5])
    assert [c[0] for c in calls] == [10, 20] and all(c[1] == 20 for c in calls)
    assert _same_state(before, _snapshot(teacher.model))
    assert all(p.grad is None and not p.requires_grad for p in teacher.model.parameters())
    assert not student.model.training and all(p.requires_grad for p in student.model.parameters())
    freeze(student)
    assert not any(p.requires_grad for p in student.model.parameters())


@pytest.mark.slow  # suite time: runs with -m slow
def test_distillation_replays_from_its_seed_dropout_included(public_texts):
    """Dropout is seeded by the distillation's seed (a seeded debug run replays compressed_pt),
    and the caller's global torch stream is left as it was."""
    teacher = make_teacher("bert-masked")
    cfg = DistillConfig(steps=4, batch_size=8, lr=2e-3, max_length=32, seed=5)

    def run(global_seed):
        student = build_student(teacher, 2)
        assert any(m.p > 0 for m in student.model.modules() if isinstance(m, torch.nn.Dropout))
        torch.manual_seed(global_seed)  # whatever the caller's global stream holds
        distill(teacher, student, public_texts, cfg)
        after = torch.rand(1)
        torch.manual_seed(global_seed)
        assert torch.equal(after, torch.rand(1))  # the global stream is left as it was
        return _snapshot(student.model)

    a = run(123)
    assert _same_state(a, run(456))  # dropout from the distillation's seed, not the global stream
    student = build_student(teacher, 2)
    distill(teacher, student, public_texts, DistillConfig(steps=4, batch_size=8, lr=2e-3, max_length=32, seed=6))
    assert not _same_state(a, _snapshot(student.model))


def test_distill_rejects_frozen_or_shared_student():
    teacher = make_teacher("gpt2")
    with pytest.raises(ValueError):
        distill(teacher, teacher, TEXTS, DistillConfig(steps=1))
    with pytest.raises(ValueError):
        distill(teacher, freeze(build_student(teacher, 2)), TEXTS, DistillConfig(steps=1))


# ---------------------------------------------------------------------------- transfer


def _clf(arch: str, seed: int = 0, n_layers: int = 2):
    return build_classifier(freeze(build_student(make_teacher(arch, seed=seed), n_layers)), LABELS)


def test_transfer_loss_formula():
    g = torch.Generator().manual_seed(0)
    zs, zs0, zt, zt0 = (torch.randn(5, 3, generator=g) for _ in range(4))
    T = 2.0
    p = F.softmax(zs / T, -1)
    kl1 = (p * (F.log_softmax(zs / T, -1) - F.log_softmax(zt / T, -1))).sum(-1).mean() * T * T
    dp = F.softmax((zs - zs0) / T, -1)
    kl2 = (dp * (F.log_softmax((zs - zs0) / T, -1) - F.log_softmax((zt - zt0) / T, -1))).sum(-1).mean() * T * T
    out = transfer_loss(zs, zs0, zt, zt0, alpha=0.3, temperature=T)
    assert torch.allclose(out.kl_prompted, kl1) and torch.allclose(out.kl_delta, kl2)
    assert torch.allclose(out.loss, 0.7 * kl1 + 0.3 * kl2)
    # the source is the reference distribution: swapping source and target changes the value
    assert not torch.allclose(transfer_loss(zt, zt0, zs, zs0, 0.3, T).kl_prompted, kl1)
    assert transfer_loss(zs, None, zt, None, alpha=0.0).kl_delta == 0


@pytest.mark.parametrize("arch,mode", [("gpt2", "labels"), ("gpt2", "vocab"), ("bert-masked", "labels"),
                                       ("bert-masked", "vocab"), ("bert-encoder", "labels")])
def test_transfer_loss_zero_for_same_model_and_prompt(arch, mode):
    clf = _clf(arch)
    enc = clf.encode(TEXTS, 32)
    p = SoftPrompt.init_from_vocab(clf.backbone, 4, seed=3).weight.detach()
    fixed = fixed_outputs(clf, p, clf, enc, enc, mode)
    with torch.no_grad():
        z_t = vocab_logits(clf, enc, p) if mode == "vocab" else clf(enc, p)
    out = transfer_loss(fixed.source_prompted, fixed.source_plain, z_t, fixed.target_plain, alpha=0.5)
    assert float(out.kl_prompted) <= 1e-6 and float(out.kl_delta) <= 1e-6 and float(out.loss) <= 1e-6
    other = p + torch.randn(p.shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        z_o = vocab_logits(clf, enc, other) if mode == "vocab" else clf(enc, other)
    diff = transfer_loss(fixed.source_prompted, fixed.source_plain, z_o, fixed.target_plain, alpha=0.5)
    assert float(diff.kl_prompted) > 1e-6 and float(diff.kl_delta) > 1e-6
    cfg = TransferConfig(steps=1, alpha=0.5, logits=mode, max_length=32, batch_size=4)
    assert transfer_objective(clf, p, clf, TEXTS, p, cfg) <= 1e-6
    assert transfer_objective(clf, p, clf, TEXTS, other, cfg) > 1e-6
    # one PublicObjective scores many prompts on the same texts, with or without cached outputs
    uncached = PublicObjective(clf, p, clf, TEXTS, dataclasses.replace(cfg, cache_fixed=False))
    cached = PublicObjective(clf, p, clf, TEXTS, cfg)
    assert cached.fixed is not None and uncached.fixed is None
    for prompt in (p, other):
        assert cached(prompt) == pytest.approx(uncached(prompt), rel=1e-5, abs=1e-7)
        assert cached(prompt) == pytest.approx(transfer_objective(clf, p, clf, TEXTS, prompt, cfg), rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("arch", ["gpt2", "bert-masked"])
def test_vocab_logits_agree_with_classifier(arch):
    clf = _clf(arch)
    enc = clf.encode(TEXTS, 32)
    p = torch.randn(3, 32)
    with torch.no_grad():
        full = vocab_logits(clf, enc, p)
        assert full.shape == (len(TEXTS), len(clf.backbone.tokenizer))
        assert torch.allclose(F.log_softmax(full, -1)[:, clf.label_token_ids], clf(enc, p), atol=1e-5)


@pytest.mark.parametrize("arch,mode", [("gpt2", "labels"), ("gpt2", "vocab"), ("bert-masked", "labels"),
                                       ("bert-encoder", "labels")])
def test_transfer_reduces_loss(arch, mode, public_texts):
    """Student (2 of 4 layers) -> its teacher, as in POST."""
    teacher = make_teacher(arch)
    source = build_classifier(freeze(build_student(teacher, 2)), LABELS)
    target = build_classifier(teacher, LABELS)
    p_s = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    texts = public_texts[:32]
    cfg = TransferConfig(steps=20, batch_size=8, lr=3e-2, alpha=0.5, max_length=32, logits=mode, log_every=10)
    start = init_target_prompt(target, p_s, cfg).weight.detach()
    before = transfer_objective(source, p_s, target, texts, start, cfg)
    calls = []
    result = transfer_prompt(source, p_s, target, texts, cfg, progress=lambda s, t, l: calls.append(s))
    after = transfer_objective(source, p_s, target, texts, result.prompt, cfg)
    assert after < 0.9 * before, (before, after)
    assert result.steps == 20 and len(result.history) == 20 and calls == [10, 20]
    assert result.prompt.shape == (4, 32) and torch.equal(result.prompt, result.final_prompt)
    assert not torch.equal(result.prompt, start)


def test_fixed_outputs_and_source_prompt_get_no_gradients():
    teacher = make_teacher("gpt2")
    student = build_student(teacher, 2)  # deliberately NOT frozen: autograd would track it if enabled
    source = build_classifier(student, LABELS)
    target = build_classifier(teacher, LABELS)
    p_s = torch.randn(4, 32, requires_grad=True)
    enc = source.encode(TEXTS, 32)
    fixed = fixed_outputs(source, p_s, target, enc, enc)
    assert not any(x.requires_grad for x in fixed)
    assert all(x.grad_fn is None for x in fixed)

    grad_modes = {"source": [], "target_plain": [], "target_prompted": []}
    src_forward, tgt_forward = source.forward, target.forward

    def spy_source(batch, prompt=None):
        grad_modes["source"].append(torch.is_grad_enabled())
        return src_forward(batch, prompt)

    def spy_target(batch, prompt=None):
        grad_modes["target_plain" if prompt is None else "target_prompted"].append(torch.is_grad_enabled())
        return tgt_forward(batch, prompt)

    source.forward, target.forward = spy_source, spy_target
    for cache in (True, False):
        for k in grad_modes:
            grad_modes[k].clear()
        cfg = TransferConfig(steps=3, batch_size=4, alpha=0.5, max_length=32, cache_fixed=cache)
        result = transfer_prompt(source, p_s, target, TEXTS, cfg)
        assert grad_modes["source"] and not any(grad_modes["source"])
        assert grad_modes["target_plain"] and not any(grad_modes["target_plain"])
        assert grad_modes["target_prompted"] == [True] * 3
        n_src_calls = 2 * 2 if cache else 2 * 3  # (prompted + plain) x (2 cached batches | 3 steps)
        assert len(grad_modes["source"]) == n_src_calls
        assert torch.isfinite(result.prompt).all()
    assert p_s.grad is None
    assert all(p.grad is None for p in student.model.parameters())
    assert all(p.grad is None for p in teacher.model.parameters())


def test_transfer_init_and_checks():
    source, target = _clf("gpt2", seed=0), _clf("gpt2", seed=1)
    p_s = torch.randn(5, 32)
    copied = init_target_prompt(target, p_s, TransferConfig(init="source"))
    assert torch.equal(copied.weight.detach(), p_s)
    by_words = init_target_prompt(target, p_s, TransferConfig(init_words="great movie", init_seed=7))
    ref = SoftPrompt.init_from_vocab(target.backbone, "great movie", n_tokens=5, seed=7)
    assert torch.equal(by_words.weight, ref.weight)
    rand = init_target_prompt(target, p_s, TransferConfig(init_seed=7))
    assert torch.equal(rand.weight, SoftPrompt.init_from_vocab(target.backbone, 5, n_tokens=5, seed=7).weight)
    # explicit init_prompt wins; steps with lr 0 keep it
    start = torch.randn(5, 32)
    res = transfer_prompt(source, p_s, target, TEXTS, TransferConfig(steps=2, lr=0.0, batch_size=4), init_prompt=start)
    assert torch.equal(res.prompt, start)
    with pytest.raises(ValueError):  # different label sets
        transfer_prompt(source, p_s, build_classifier(target.backbone, ["a", "b", "c"]), TEXTS, TransferConfig(steps=1))
    with pytest.raises(ValueError):  # full-vocabulary logits need verbalizers
        enc_clf = _clf("bert-encoder")
        transfer_prompt(enc_clf, p_s, enc_clf, TEXTS, TransferConfig(steps=1, logits="vocab"))
    with pytest.raises(ValueError):
        TransferConfig(alpha=1.5)


def test_select_fn_keeps_best_public_score():
    source, target = _clf("gpt2", seed=0), _clf("gpt2", seed=1)
    p_s = torch.randn(4, 32)
    scores = iter([0.1, 0.5, 0.9, 0.3, 0.2])  # steps 0, 2, 4, 6, 7 (final)
    seen = []

    def select_fn(prompt):
        seen.append(prompt.clone())
        return next(scores)

    cfg = TransferConfig(steps=7, batch_size=4, lr=1e-2, alpha=0.5, max_length=32, select_every=2)
    res = transfer_prompt(source, p_s, target, TEXTS, cfg, select_fn=select_fn)
    assert [s["step"] for s in res.selection] == [0, 2, 4, 6, 7]
    assert res.best_step == 4 and torch.equal(res.prompt, seen[2])
    assert torch.equal(res.final_prompt, seen[-1]) and not torch.equal(res.prompt, res.final_prompt)


# ---------------------------------------------------------------------------- save / load


@pytest.mark.parametrize("arch", ["gpt2", "bert-masked", "bert-encoder", "llama"])
def test_save_load_student_round_trip(arch, tmp_path):
    teacher = make_teacher(arch)
    student = build_student(teacher, 2)
    distill(teacher, student, TEXTS, DistillConfig(steps=2, batch_size=3, lr=1e-3, max_length=24))
    freeze(student)
    path = save_student(student, tmp_path / "student")
    loaded = load_student(path, device=DEV)
    assert loaded.kind == student.kind and loaded.name == student.name
    assert loaded.teacher_name == teacher.name and loaded.copied_layers == (0, 3)
    assert num_layers(loaded) == 2 and loaded.embed_dim == 32
    assert not any(p.requires_grad for p in loaded.model.parameters()) and not loaded.model.training
    enc = _encode(student)
    assert torch.allclose(_outputs(student, enc), _outputs(loaded, enc), atol=1e-6, rtol=0)
    a, b = build_classifier(student, LABELS), build_classifier(loaded, LABELS)
    batch = a.encode(TEXTS, 24)
    assert torch.equal(batch["input_ids"], b.encode(TEXTS, 24)["input_ids"])
    p = torch.randn(3, 32)
    with torch.no_grad():
        assert torch.allclose(a(batch, p), b(select_rows(batch, slice(None)), p), atol=1e-6, rtol=0)
    trainable = load_student(path, device=DEV, trainable=True)
    assert all(p.requires_grad for p in trainable.model.parameters())
    with pytest.raises(FileNotFoundError):
        load_student(tmp_path / "nothing-here")
