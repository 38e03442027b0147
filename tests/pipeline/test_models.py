"""Tests for the models/ package (tiny random models + the bundled MiniLM; CPU, no network)."""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.nn.functional as F

import models.dp_prompt_training as dpt
from models.dp_prompt_training import seeded_dp_generators
from models import (
    CosineEncoderClassifier,
    DPConfig,
    ModelLoadError,
    PromptTrainingConfig,
    SoftPrompt,
    VerbalizerCausalLM,
    VerbalizerMaskedLM,
    accuracy,
    build_classifier,
    default_device,
    load_backbone,
    load_prompt,
    per_example_loss,
    per_sample_prompt_gradients,
    predict_logits,
    save_prompt,
    seed_everything,
    select_rows,
    train_prompt,
)

torch.set_num_threads(2)
DEV = "cpu"
LABELS = ["negative", "positive"]
TEXTS = [
    "a great movie",
    "terrible , boring and far too long , i walked out before the end",
    "ok",
    "the acting was wonderful and the story moving",
    "bad",
]
Y = torch.tensor([1, 0, 1, 1, 0])

# (backbone name, classifier class): every classifier kind, on tiny random models.
KINDS = [
    ("tiny-gpt2", VerbalizerCausalLM),
    ("tiny-llama", VerbalizerCausalLM),
    ("tiny-bert", VerbalizerMaskedLM),
    ("tiny-bert", CosineEncoderClassifier),
]
KIND_IDS = ["gpt2-causal", "llama-causal", "bert-masked", "bert-cosine"]


@pytest.fixture(scope="module", params=KINDS, ids=KIND_IDS)
def clf(request):
    name, cls = request.param
    return cls(load_backbone(name, DEV), LABELS)


def _prompt(clf, n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    # scale like real token embeddings so the prompt matters
    return torch.randn(n, clf.embed_dim, generator=g) * 0.5


# ---------------------------------------------------------------- registry / device


def test_default_device_and_seed():
    dev = default_device()
    assert dev.type == ("cuda" if torch.cuda.is_available() else "cpu")
    seed_everything(3)
    a = torch.rand(3)
    seed_everything(3)
    assert torch.equal(a, torch.rand(3))


@pytest.mark.parametrize("name,kind", [("tiny-gpt2", "causal"), ("tiny-bert", "masked"), ("tiny-llama", "causal")])
def test_tiny_backbones_frozen_cached_seeded(name, kind):
    bb = load_backbone(name, DEV)
    assert bb.kind == kind and bb.name == name
    assert not bb.model.training
    assert all(not p.requires_grad for p in bb.model.parameters())
    assert bb.embed_dim == bb.model.get_input_embeddings().weight.shape[1]
    assert bb.tokenizer.vocab_size == 30522
    assert load_backbone(name, DEV) is bb  # cached
    other = load_backbone(name, DEV, seed=1)
    assert other is not bb
    w0, w1 = bb.model.get_input_embeddings().weight, other.model.get_input_embeddings().weight
    assert not torch.equal(w0, w1)


def test_unknown_model_raises_model_load_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as ei:
        load_backbone("no-such-org/no-such-model-xyz", DEV)
    msg = str(ei.value)
    assert "no-such-org/no-such-model-xyz" in msg and "\n" not in msg
    assert isinstance(ei.value, ValueError)
    with pytest.raises(ModelLoadError, match="does/not/exist"):
        load_backbone("./does/not/exist", DEV)


def test_without_the_hub_a_load_fails_in_seconds_and_says_which(monkeypatch):
    """Issue 41: no 23 s of the hub client's retries on a machine without network; one line saying
    whether the model is missing locally with the hub unreachable, or missing from the local cache
    under HF_HUB_OFFLINE."""
    import time

    from models import backbones

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    backbones._hub_reachable.cache_clear()
    started = time.perf_counter()
    assert backbones._hub_reachable("http://127.0.0.1:9") is False  # a closed port: refused at once
    with monkeypatch.context() as proxied:  # behind a proxy, the proxy decides: no direct probe
        proxied.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
        assert backbones._hub_reachable("http://127.0.0.1:9/") is True
    backbones._hub_reachable.cache_clear()
    monkeypatch.setattr(backbones, "_hub_reachable", lambda *a, **k: False)
    with pytest.raises(ModelLoadError) as ei:
        load_backbone("no-such-org/no-such-model-xyz", DEV)
    assert time.perf_counter() - started < 10
    msg = str(ei.value)
    assert "\n" not in msg and "the hub is unreachable (no network" in msg and "not in the local hub cache" in msg
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match=r"not in the local hub cache \(HF_HUB_OFFLINE=1\)$"):
        load_backbone("no-such-org/no-such-model-xyz", DEV)


def test_minilm_loads_from_pypi_package_and_ranks_sentiment():
    bb = load_backbone("minilm", DEV)
    assert bb.kind == "encoder" and bb.embed_dim == 384
    assert all(not p.requires_grad for p in bb.model.parameters())
    c = build_classifier(bb, LABELS)
    assert isinstance(c, CosineEncoderClassifier)
    logits = c(c.encode(["great movie"]))
    assert logits[0, 1] > logits[0, 0] + 1.0  # "great movie" closer to "positive" than to "negative"
    assert logits.abs().max() <= 20.0 + 1e-4  # scale * cosine
    desc = {
        "negative": "a negative review: the movie was bad",
        "positive": "a positive review: the movie was good",
    }
    c = build_classifier(bb, LABELS, label_descriptions=desc)
    texts = ["great movie", "an awful, terrible film", "a boring waste of time", "i loved it"]
    assert c(c.encode(texts)).argmax(1).tolist() == [1, 0, 0, 1]
    # with a real pretrained encoder, a near-duplicate sentence is much closer than an unrelated one
    e = F.normalize(c.sentence_embeddings(c.encode(["a great movie", "a great film", "the stock market fell"])), dim=-1)
    assert e[0] @ e[1] > e[0] @ e[2] + 0.3


def test_minilm_unprompted_embeddings_match_sentence_transformers():
    st = pytest.importorskip("sentence_transformers")
    from models.backbones import minilm_path

    ref_model = st.SentenceTransformer(str(minilm_path()), device="cpu")
    c = build_classifier(load_backbone("minilm", DEV), LABELS)
    texts = ["a great movie", "terrible , boring and far too long", "ok"]
    ours = F.normalize(c.sentence_embeddings(c.encode(texts, max_length=128)), dim=-1)
    ref = torch.as_tensor(ref_model.encode(texts, normalize_embeddings=True))
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


# ---------------------------------------------------------------- classifiers


def test_build_classifier_by_kind():
    assert isinstance(build_classifier(load_backbone("tiny-gpt2", DEV), LABELS), VerbalizerCausalLM)
    assert isinstance(build_classifier(load_backbone("tiny-llama", DEV), LABELS), VerbalizerCausalLM)
    assert isinstance(build_classifier(load_backbone("tiny-bert", DEV), LABELS), VerbalizerMaskedLM)


def test_encode_layout():
    bb = load_backbone("tiny-bert", DEV)
    masked = VerbalizerMaskedLM(bb, LABELS)
    enc = masked.encode(TEXTS, max_length=12)
    assert enc["input_ids"].shape == enc["attention_mask"].shape and enc["input_ids"].shape[1] <= 12
    rows = torch.arange(len(TEXTS))
    assert (enc["input_ids"][rows, enc["label_pos"]] == bb.tokenizer.mask_token_id).all()  # mask kept on truncation
    causal = VerbalizerCausalLM(load_backbone("tiny-gpt2", DEV), LABELS)
    enc = causal.encode(TEXTS, max_length=12)
    lengths = enc["attention_mask"].sum(1)
    assert torch.equal(enc["label_pos"], lengths - 1)  # last real position
    last = bb.tokenizer.convert_ids_to_tokens(enc["input_ids"][rows, enc["label_pos"]].tolist())
    assert set(last) == {"was"}  # "{text} It was": no trailing [SEP] for causal LMs
    assert (enc["attention_mask"][:, 0] == 1).all() and (enc["attention_mask"].diff(dim=1) <= 0).all()  # right pad
    with pytest.raises(ValueError):
        VerbalizerCausalLM(bb, LABELS, label_words={"negative": " good", "positive": " good"})


def test_logits_shape_prompt_none_and_broadcast(clf):
    enc = clf.encode(TEXTS)
    assert clf(enc).shape == (len(TEXTS), 2)
    p = _prompt(clf)
    a = clf(enc, p)
    b = clf(enc, p.unsqueeze(0).expand(len(TEXTS), -1, -1).clone())
    assert a.shape == (len(TEXTS), 2) and torch.isfinite(a).all()
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert not torch.allclose(a, clf(enc), atol=1e-5)  # the prompt changes the logits
    with pytest.raises(ValueError):
        clf(enc, torch.zeros(4, clf.embed_dim + 1))
    with pytest.raises(ValueError):
        clf(enc, torch.zeros(len(TEXTS) + 1, 4, clf.embed_dim))


def test_padding_invariance(clf):
    enc = clf.encode(TEXTS)
    assert (enc["attention_mask"] == 0).any()
    for prompt in (None, _prompt(clf)):
        batch = clf(enc, prompt)
        for i, t in enumerate(TEXTS):
            alone = clf(clf.encode([t]), prompt)  # no padding at all
            torch.testing.assert_close(batch[i : i + 1], alone, atol=1e-5, rtol=0)


def test_input_longer_than_positions_rejected():
    c = VerbalizerCausalLM(load_backbone("tiny-gpt2", DEV), LABELS)
    enc = c.encode(["word " * 300], max_length=250)
    with pytest.raises(ValueError, match="positions"):
        c(enc, torch.zeros(20, c.embed_dim))


# ---------------------------------------------------------------- per-sample gradients


def _loop_gradients(clf, enc, labels, prompt):
    out = []
    for i in range(labels.shape[0]):
        p = prompt.clone().requires_grad_()
        loss = F.cross_entropy(clf(select_rows(enc, [i]), p), labels[i : i + 1])
        (g,) = torch.autograd.grad(loss, p)
        out.append(g)
    return torch.stack(out)


def test_per_sample_gradients_match_per_example_loop(clf):
    enc = clf.encode(TEXTS)  # padded batch of varying lengths
    assert len(set(enc["attention_mask"].sum(1).tolist())) > 2
    prompt = _prompt(clf)
    grads = per_sample_prompt_gradients(clf, enc, Y, prompt)
    ref = _loop_gradients(clf, enc, Y, prompt)
    assert grads.shape == (len(TEXTS), *prompt.shape)
    torch.testing.assert_close(grads, ref, atol=1e-5, rtol=1e-5)
    norms = grads.flatten(1).norm(dim=1)
    assert (norms > 1e-4).all()  # non-trivial gradients ...
    assert not torch.allclose(grads[0], grads[1], atol=1e-6)  # ... that differ per example
    # the summed per-sample gradients are the gradient of the summed loss w.r.t. the shared prompt
    p = prompt.clone().requires_grad_()
    F.cross_entropy(clf(enc, p), Y, reduction="sum").backward()
    torch.testing.assert_close(grads.sum(0), p.grad, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- training


def _toy(clf, n=16):
    pos = ["good", "great", "wonderful", "excellent"]
    neg = ["bad", "awful", "terrible", "boring"]
    texts, ys = [], []
    for i in range(n):
        w = (pos if i % 2 else neg)[(i // 2) % 4]
        texts.append(f"{w} movie")
        ys.append(i % 2)
    return clf.encode(texts, max_length=16), torch.tensor(ys)


def test_dp_step_rejects_per_sample_gradient_with_wrong_batch_dim(monkeypatch):
    clf = VerbalizerCausalLM(load_backbone("tiny-gpt2", DEV), LABELS)
    enc, y = _toy(clf, 8)
    real = dpt.per_sample_prompt_gradients

    def peft_like(*args, **kwargs):  # what PEFT prompt tuning under Opacus yields: batch dim 1
        g, losses = real(*args, **kwargs)
        return g.sum(0, keepdim=True), losses

    monkeypatch.setattr(dpt, "per_sample_prompt_gradients", peft_like)
    cfg = PromptTrainingConfig(n_tokens=3, steps=2, lr=0.1)
    with pytest.raises(RuntimeError, match="batch dimension"):
        train_prompt(clf, enc, y, cfg, DPConfig(noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=1.0))


def test_dp_without_noise_or_clipping_equals_full_batch_sgd():
    clf = VerbalizerMaskedLM(load_backbone("tiny-bert", DEV), LABELS)
    enc, y = _toy(clf, 8)
    init = _prompt(clf, n=3)
    cfg = PromptTrainingConfig(n_tokens=3, steps=1, lr=0.5, optimizer="sgd", batch_size=8)
    dp = train_prompt(clf, enc, y, cfg, DPConfig(0.0, 1e6, 1.0), init_prompt=init)
    plain = train_prompt(clf, enc, y, cfg, None, init_prompt=init)
    assert dp.private and not plain.private
    assert dp.history[0]["batch_size"] == 8 and dp.history[0]["clipped_frac"] == 0
    assert not torch.allclose(dp.prompt, init)
    torch.testing.assert_close(dp.prompt, plain.prompt, atol=1e-6, rtol=1e-5)


def test_dp_clips_each_example_and_divides_by_expected_batch():
    clf = VerbalizerCausalLM(load_backbone("tiny-llama", DEV), LABELS)
    enc, y = _toy(clf, 8)
    init = _prompt(clf, n=3)
    g = per_sample_prompt_gradients(clf, enc, y, init)
    C = float(g.flatten(1).norm(dim=1).median())  # about half the examples get clipped
    factor = (C / (g.flatten(1).norm(dim=1) + 1e-6)).clamp(max=1.0)
    expected = init - 0.5 * (g * factor[:, None, None]).sum(0) / 8
    cfg = PromptTrainingConfig(n_tokens=3, steps=1, lr=0.5, optimizer="sgd")
    res = train_prompt(clf, enc, y, cfg, DPConfig(0.0, C, 1.0), init_prompt=init)
    torch.testing.assert_close(res.prompt, expected, atol=1e-6, rtol=1e-5)
    assert 0 < res.history[0]["clipped_frac"] < 1


def test_dp_poisson_empty_batches_counted_and_still_step():
    clf = VerbalizerCausalLM(load_backbone("tiny-gpt2", DEV), LABELS)
    enc, y = _toy(clf, 8)
    init = _prompt(clf, n=3)
    cfg = PromptTrainingConfig(n_tokens=3, steps=30, lr=0.01, optimizer="sgd")
    seen = []
    sample, noise = seeded_dp_generators(0)
    res = train_prompt(
        clf, enc, y, cfg, DPConfig(1.0, 1.0, 0.05), init_prompt=init, progress=lambda *a: seen.append(a),
        sample_generator=sample, noise_generator=noise,
    )
    sizes = [h["batch_size"] for h in res.history]
    assert res.steps == 30 and len(res.history) == 30
    assert res.empty_batches == sizes.count(0) and 10 < res.empty_batches < 30
    assert any(s > 0 for s in sizes)
    assert all(h["loss"] is None for h in res.history if h["batch_size"] == 0)
    assert not torch.allclose(res.prompt, init)
    # progress every log_every=10 steps with (step, total, mean loss)
    assert [s[0] for s in seen] == [10, 20, 30] and all(s[1] == 30 for s in seen)
    # steps from epochs: round(epochs / q)
    cfg2 = PromptTrainingConfig(n_tokens=3, epochs=0.5, lr=0.01)
    assert train_prompt(clf, enc, y, cfg2, DPConfig(1.0, 1.0, 0.25), init_prompt=init).steps == 2
    # reproducible only with injected (seeded) DP generators; by default the DP streams are secret
    sample, noise = seeded_dp_generators(0)
    again = train_prompt(clf, enc, y, cfg, DPConfig(1.0, 1.0, 0.05), init_prompt=init,
                         sample_generator=sample, noise_generator=noise)
    assert torch.equal(again.prompt, res.prompt)
    secret_a = train_prompt(clf, enc, y, cfg, DPConfig(1.0, 1.0, 0.05), init_prompt=init)
    secret_b = train_prompt(clf, enc, y, cfg, DPConfig(1.0, 1.0, 0.05), init_prompt=init)
    assert not torch.equal(secret_a.prompt, secret_b.prompt) and not torch.equal(secret_a.prompt, res.prompt)


def test_noise_only_step_changes_prompt():
    clf = VerbalizerCausalLM(load_backbone("tiny-gpt2", DEV), LABELS)
    enc, y = _toy(clf, 4)
    init = _prompt(clf, n=3)
    cfg = PromptTrainingConfig(n_tokens=3, steps=1, lr=0.1, optimizer="sgd")
    res = train_prompt(clf, enc, y, cfg, DPConfig(1.0, 1.0, 1e-9), init_prompt=init)
    assert res.empty_batches == 1 and res.history[0]["batch_size"] == 0
    assert not torch.allclose(res.prompt, init)


def test_dp_first_step_must_change_prompt():
    clf = VerbalizerCausalLM(load_backbone("tiny-gpt2", DEV), LABELS)
    enc, y = _toy(clf, 4)
    cfg = PromptTrainingConfig(n_tokens=3, steps=2, lr=0.0, optimizer="sgd")  # an optimizer that never moves
    with pytest.raises(RuntimeError, match="did not change"):
        train_prompt(clf, enc, y, cfg, DPConfig(1.0, 1.0, 1.0))


@pytest.mark.slow  # suite time: runs with -m slow
@pytest.mark.parametrize("private", [False, True], ids=["nonprivate", "dp"])
def test_training_reduces_loss_on_toy_task(private):
    # Tiny random models cannot separate a balanced task with one shared prompt; the real
    # (pretrained) MiniLM can, and is fast on 16 short texts.
    clf = build_classifier(load_backbone("minilm", DEV), LABELS)
    enc, y = _toy(clf, 16)
    cfg = PromptTrainingConfig(n_tokens=4, steps=40, lr=0.1, batch_size=8, init_words="it was a movie")
    dp = DPConfig(noise_multiplier=0.3, max_grad_norm=1.0, sample_rate=0.5) if private else None
    init = SoftPrompt.init_from_vocab(clf.backbone, cfg.init_words, n_tokens=4).weight.detach()
    before = per_example_loss(clf, enc, y, init).mean()
    # fixed DP streams: with secret ones the loss ratio varied 0.30-0.69 over 12 draws (1 above 0.6),
    # so the utility check failed now and then (the secret streams are tested elsewhere)
    gs, gn = seeded_dp_generators(0) if private else (None, None)
    res = train_prompt(clf, enc, y, cfg, dp, sample_generator=gs, noise_generator=gn)
    after = per_example_loss(clf, enc, y, res.prompt).mean()
    assert res.prompt.shape == (4, clf.embed_dim) and res.steps == 40 and res.private == private
    assert after < 0.6 * before, (float(before), float(after))
    assert accuracy(clf, enc, y, res.prompt) == 1.0


# ---------------------------------------------------------------- scoring, soft prompts


def test_scoring_batched_matches_forward(clf):
    enc = clf.encode(TEXTS)
    p = _prompt(clf)
    full = clf(enc, p).detach()
    logits = predict_logits(clf, enc, p, batch_size=2)
    torch.testing.assert_close(logits, full, atol=1e-5, rtol=0)
    loss = per_example_loss(clf, enc, Y, p, batch_size=3)
    torch.testing.assert_close(loss, F.cross_entropy(full, Y, reduction="none"), atol=1e-5, rtol=0)
    acc = accuracy(clf, enc, Y, p, batch_size=2)
    assert acc == float((full.argmax(1) == Y).float().mean())


def test_row_wise_logits_of_a_row_do_not_depend_on_the_other_rows(clf):
    """A private selection's holdout counts move by one per record only if a row's prediction
    depends on that row alone: adding a long text changes no other row's logits, bit for bit
    (batched, they move by float rounding), and they match the batched ones up to rounding. The CPU's
    default: an encoder's rows in row-own batches (faster), a causal model's one per pass (no gain)."""
    from models.scoring import row_wise_logits

    p = _prompt(clf)
    clf.row_checks.clear()
    rows = row_wise_logits(clf, TEXTS, 64, p)
    assert bool(clf.row_checks) == (clf.backbone.kind != "causal")
    longer = row_wise_logits(clf, ["an added record, much longer than the others, " * 6] + TEXTS, 64, p)
    assert torch.equal(longer[1:], rows)
    torch.testing.assert_close(rows, predict_logits(clf, clf.encode(TEXTS), p), atol=1e-5, rtol=0)


@pytest.mark.parametrize("prompt_kind", ["none", "soft", "prefix"])
def test_row_wise_logits_batched_in_row_own_shapes(clf, prompt_kind):
    """The accelerator's path, forced on the CPU: rows in batches of public shapes (their own
    length rounded up to 16, a batch size of that length, fill rows), each shape checked. A row's
    logits are the same bits whoever its companions (an added long record, other rows, the order),
    and match the rows run alone up to rounding (the padded length is the row's own)."""
    from models.prompts.prefix import prefix_shape
    from models.scoring import row_wise_logits

    clf.row_checks.clear()
    p = {"none": None, "soft": _prompt(clf), "prefix": None}[prompt_kind]
    if prompt_kind == "prefix":
        p = torch.randn(*prefix_shape(clf.backbone.model, 3), generator=torch.Generator().manual_seed(0)) * 0.5
    texts = TEXTS + ["one more short text", "and " * 20 + "a long one"]
    got = row_wise_logits(clf, texts, 64, p, batch_rows=True)
    with_added = row_wise_logits(clf, ["an added record, much longer than the others, " * 6] + texts, 64, p,
                                 batch_rows=True)
    reordered = row_wise_logits(clf, texts[::-1], 64, p, batch_rows=True)
    assert torch.equal(with_added[1:], got) and torch.equal(reordered.flip(0), got)
    alone = row_wise_logits(clf, texts, 64, p, batch_rows=False)
    torch.testing.assert_close(got, alone, atol=1e-5, rtol=0)
    from models.row_own import row_batch

    assert clf.row_checks and all(k[0] == row_batch(k[1]) for k in clf.row_checks)  # a batch size per length


def test_every_row_own_pass_holds_padding_even_when_every_row_fills_its_length(monkeypatch):
    """Review 9, F1: Transformers drops the attention mask of a batch with no padding, and on CUDA a
    half-precision model then runs another attention kernel (flash) — so rows cut to max_length
    would compute other bits beside each other than beside one shorter record. Every multi-row pass
    therefore holds a one-token fill row: its mask always has padding, whatever the rows."""
    from models.row_own import run_row_own
    from models.scoring import row_wise_logits

    seen = []

    def forward(batch, length):
        seen.append(list(batch))
        return torch.tensor([[float(len(r))] for r in batch])

    rows = [[1] * 16 for _ in range(40)]  # every row exactly its padded length
    out = run_row_own(rows, [16] * 40, forward, [0], lambda size, L: [[5] * (L - k) for k in range(size)], {},
                      max_batch=8)
    assert [float(o) for o in out] == [16.0] * 40
    passes = [b for b in seen if len(b) > 1 and [1] * 16 in b]  # the data's passes (the others: the check's probes)
    assert len(passes) == 6 and all(len(b) == 8 and [0] in b for b in passes)  # 7 rows + a fill row each

    clf = VerbalizerCausalLM(load_backbone("tiny-gpt2", DEV), LABELS)
    masks = []
    real = clf.forward_shaped
    monkeypatch.setattr(clf, "forward_shaped", lambda batch, prompt=None: masks.append(batch["attention_mask"])
                        or real(batch, prompt))
    long_texts = ["word " * 80 + str(i) for i in range(40)]  # every one cut to max_length = 32
    row_wise_logits(clf, long_texts, 32, batch_rows=True)
    assert masks and all(bool((m == 0).any()) for m in masks if m.shape[0] > 1)


def test_row_wise_logits_a_shape_failing_its_check_runs_its_rows_alone(monkeypatch):
    """If the device made a row depend on its companions for some shape, the check (on public
    probe rows) catches it and that shape's rows run one by one at the same padded length."""
    from models.scoring import row_wise_logits

    clf = VerbalizerCausalLM(load_backbone("tiny-gpt2", DEV), LABELS)
    real = clf.forward_shaped

    def coupled(batch, prompt=None):  # a row's logits move with the first row's first token
        out = real(batch, prompt)
        return out + 1e-3 * float(batch["input_ids"][0, 0]) if out.shape[0] > 1 else out

    monkeypatch.setattr(clf, "forward_shaped", coupled)
    got = row_wise_logits(clf, TEXTS, 64, batch_rows=True)
    assert clf.row_checks and not any(clf.row_checks.values())
    torch.testing.assert_close(got, row_wise_logits(clf, TEXTS, 64, batch_rows=False), atol=1e-5, rtol=0)
    assert torch.equal(row_wise_logits(clf, TEXTS[:2], 64, batch_rows=True), got[:2])


def test_soft_prompt_init_expand_and_safetensors_roundtrip(tmp_path):
    bb = load_backbone("tiny-gpt2", DEV)
    sp = SoftPrompt.init_from_vocab(bb, "positive negative", n_tokens=5)
    ids = bb.tokenizer("positive negative", add_special_tokens=False)["input_ids"]
    emb = bb.model.get_input_embeddings().weight
    assert sp.weight.shape == (5, bb.embed_dim) and sp.weight.requires_grad
    torch.testing.assert_close(sp.weight[0], emb[ids[0]])
    torch.testing.assert_close(sp.weight[2], emb[ids[0]])  # cycled
    r1 = SoftPrompt.init_from_vocab(bb, 6, seed=1).weight
    assert r1.shape == (6, bb.embed_dim) and torch.equal(r1, SoftPrompt.init_from_vocab(bb, 6, seed=1).weight)
    assert not torch.equal(r1, SoftPrompt.init_from_vocab(bb, 6, seed=2).weight)
    assert sp.expand(3).shape == (3, 5, bb.embed_dim)
    meta = {"model": "tiny-gpt2", "epsilon": "3.0"}
    path = save_prompt(tmp_path / "p.safetensors", sp.weight, meta)
    t, m = load_prompt(path)
    assert torch.equal(t, sp.weight.detach())
    assert m["model"] == "tiny-gpt2" and m["epsilon"] == "3.0" and m["n_tokens"] == "5"
    sp2, m2 = SoftPrompt.load(sp.save(tmp_path / "q.safetensors", {"k": "v"}))
    assert torch.equal(sp2.weight, sp.weight) and m2["k"] == "v"


# ---------------------------------------------------------------- benchmark (run with -m bench)


@pytest.mark.bench
def test_bench_minilm_nonprivate_vs_dp_step():
    bb = load_backbone("minilm", DEV)
    clf = build_classifier(bb, LABELS)
    words = "the movie was surprisingly good and the actors did a fine job with a thin script".split()
    texts = [" ".join((words * 4)[i : i + 44]) for i in range(32)]
    enc = clf.encode(texts, max_length=48)
    y = torch.randint(0, 2, (32,))
    sp = SoftPrompt.init_from_vocab(bb, 10).to(clf.device)
    opt = torch.optim.Adam([sp.weight], lr=1e-3)

    def nonprivate():
        opt.zero_grad()
        F.cross_entropy(clf(enc, sp.weight), y).backward()
        opt.step()

    def private():
        g = per_sample_prompt_gradients(clf, enc, y, sp.weight)
        assert g.shape[0] == 32
        f = (1.0 / (g.flatten(1).norm(dim=1) + 1e-6)).clamp(max=1.0)
        sp.weight.grad = ((g * f[:, None, None]).sum(0) + torch.randn_like(sp.weight)) / 32
        opt.step()

    for _ in range(3):  # warm-up
        nonprivate()
        private()
    t_np, t_dp = [], []
    for _ in range(10):  # interleaved, so load from other workers hits both alike
        for fn, ts in ((nonprivate, t_np), (private, t_dp)):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    t_np, t_dp = statistics.median(t_np), statistics.median(t_dp)
    print(f"\nMiniLM B=32 L={enc['input_ids'].shape[1]} n=10: non-private {t_np*1e3:.1f} ms, DP {t_dp*1e3:.1f} ms, "
          f"ratio {t_dp/t_np:.2f}")


def test_true_label_logit_scores_match_softmax():
    from models.scoring import predict_logits, true_label_logit_scores

    clf = build_classifier(load_backbone("tiny-bert", seed=0), ["negative", "positive", "neutral"])
    enc = clf.encode(["a fine film", "dull and long", "it is a movie"], max_length=16)
    y = torch.tensor([1, 0, 2])
    p = torch.softmax(predict_logits(clf, enc).double(), dim=1)[torch.arange(3), y]
    expected = torch.log(p) - torch.log1p(-p)
    assert torch.allclose(true_label_logit_scores(clf, enc, y), expected.float(), atol=1e-5)


def test_min_k_percent_scores_follow_token_log_probs():
    from models.scoring import min_k_percent_scores

    backbone = load_backbone("tiny-gpt2", seed=0)
    clf = build_classifier(backbone, ["negative", "positive"])
    texts = ["a fine film", "dull and long and slow"]
    enc = clf.encode(texts, max_length=16)
    got = min_k_percent_scores(clf, enc, k=1.0)  # k = 1: the mean token log-prob
    for i in range(2):
        ids = enc["input_ids"][i][enc["attention_mask"][i].bool()][None]
        with torch.no_grad():
            logits = backbone.model(input_ids=ids.to(backbone.device)).logits.float()
        logp = torch.log_softmax(logits[0, :-1], -1).gather(1, ids[0, 1:, None].to(logits.device)).squeeze(1)
        assert abs(float(logp.mean()) - float(got[i])) < 1e-4
    lowest = min_k_percent_scores(clf, enc, k=0.01)
    assert torch.all(lowest <= got + 1e-6)
    with pytest.raises(ValueError, match="causal"):
        min_k_percent_scores(build_classifier(load_backbone("tiny-bert"), ["a", "b"]), enc)


def test_micro_batches_give_the_same_dp_step():
    """``physical_batch_size`` is memory only (Opacus's BatchMemoryManager semantics): one logical
    DP step — the same Poisson sample, one clipped gradient per example, one sum, ONE noise draw —
    whatever the micro-batch size. Equal up to the float order of the sum (the prompt is fp32):
    a noise draw per micro-batch, or a step per micro-batch, would move it by far more."""
    clf = VerbalizerCausalLM(load_backbone("tiny-gpt2", DEV), LABELS)
    enc, y = _toy(clf, 24)
    init = _prompt(clf, n=3)
    outs = {}
    for physical in (64, 5):
        sample, noise = seeded_dp_generators(0)
        cfg = PromptTrainingConfig(n_tokens=3, steps=3, lr=2.0, optimizer="sgd", physical_batch_size=physical)
        res = train_prompt(clf, enc, y, cfg, DPConfig(1.0, 0.5, 0.5), init_prompt=init,
                           sample_generator=sample, noise_generator=noise)
        outs[physical] = res
    sizes = {k: [h["batch_size"] for h in r.history] for k, r in outs.items()}
    assert sizes[64] == sizes[5] and all(s > 5 for s in sizes[64])  # several micro-batches a step
    for physical in (5,):
        assert torch.allclose(outs[physical].prompt, outs[64].prompt, atol=1e-6, rtol=0)
    assert float((outs[64].prompt - init.float()).abs().max()) > 1e-3  # the steps moved it


def test_physical_batch_size_is_chosen_from_memory_when_not_set():
    """``models.physical_batch_size: null``: 64 on CPU; on CUDA the largest size whose measured
    per-example peak fits 80% of the free memory (the probe is one pass of the training's own kind)."""
    from models.memory import CPU_DEFAULT, LARGEST, choose

    assert choose(None, torch.device("cpu"), probe=lambda n: None) == CPU_DEFAULT
    assert choose(16, torch.device("cpu")) == 16
    cuda = torch.device("cuda")
    probed = []
    got = choose(None, cuda, probe=probed.append, free_bytes=lambda: 10_000_000,
                 peak_bytes=lambda run: (run(), 2 * 50_000)[1])
    assert probed == [2] and got == int(0.8 * 10_000_000 // 50_000)  # 160 examples of 50 kB in 8 MB
    assert choose(None, cuda, probe=lambda n: None, free_bytes=lambda: 10**15, peak_bytes=lambda run: 2) == LARGEST
    assert choose(None, cuda, probe=lambda n: None, free_bytes=lambda: 10, peak_bytes=lambda run: 10**9) == 1
    with pytest.raises(ValueError, match="physical_batch_size"):
        choose(0, cuda)
    # unset, the trainer asks for a size (with its probe) and uses it for every micro-batch
    clf = VerbalizerCausalLM(load_backbone("tiny-gpt2", DEV), LABELS)
    enc, y = _toy(clf, 16)
    asked, seen = [], []
    real = dpt.per_sample_prompt_gradients
    monkey = pytest.MonkeyPatch()
    monkey.setattr(dpt, "choose_physical_batch", lambda requested, device, probe: (asked.append(requested), 3)[1])
    monkey.setattr(dpt, "per_sample_prompt_gradients",
                   lambda c, e, l, *a, **k: (seen.append(len(l)), real(c, e, l, *a, **k))[1])
    try:
        cfg = PromptTrainingConfig(n_tokens=2, steps=2, lr=0.01, physical_batch_size=None)
        train_prompt(clf, enc, y, cfg, DPConfig(1.0, 1.0, 0.9), init_prompt=_prompt(clf, n=2))
    finally:
        monkey.undo()
    assert asked == [None] and seen and max(seen) == 3
    # the probe runs on PUBLIC rows of max_length tokens, never on private ones (review 8, N5)
    probed_rows = []
    monkey.setattr(dpt, "choose_physical_batch", lambda requested, device, probe: (probe(2), 3)[1])
    monkey.setattr(dpt, "per_sample_prompt_gradients",
                   lambda c, e, l, *a, **k: (probed_rows.append(e["input_ids"]), real(c, e, l, *a, **k))[1])
    try:
        dpt._physical_batch(clf, 20, torch.nn.Embedding.from_pretrained(_prompt(clf, n=2), freeze=False))
    finally:
        monkey.undo()
    (probe_ids,) = probed_rows
    assert probe_ids.shape == (2, 20) and not any(torch.equal(probe_ids[0, :len(r)], r) for r in enc["input_ids"])
