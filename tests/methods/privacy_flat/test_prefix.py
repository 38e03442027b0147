"""Prefix prompts: semantics against the library's own key/value cache, per-sample gradients
against a per-example loop for every trainable tensor, save/load, DP training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import (CosineEncoderClassifier, DPConfig, PromptTrainingConfig, VerbalizerCausalLM,
                    VerbalizerMaskedLM, load_backbone, per_example_loss, per_sample_prompt_gradients,
                    select_rows, train_prompt)
from models.dp_prompt_training import seeded_dp_generators
from models.prompts import load_prompt_artifact, prompt_kind, save_prompt_artifact
from models.prompts.prefix import is_prefix, kv_sites, prefix_shape
from models.soft_prompt import PrefixPrompt

torch.set_num_threads(2)
LABELS = ["negative", "positive"]
TEXTS = ["a great movie", "terrible , boring and far too long , i walked out", "ok",
         "the acting was wonderful and the story moving", "bad"]
Y = torch.tensor([1, 0, 1, 1, 0])
KINDS = [("tiny-gpt2", VerbalizerCausalLM), ("tiny-llama", VerbalizerCausalLM),
         ("tiny-bert", VerbalizerMaskedLM), ("tiny-bert", CosineEncoderClassifier)]
IDS = ["gpt2-causal", "llama-causal", "bert-masked", "bert-cosine"]


@pytest.fixture(scope="module", params=KINDS, ids=IDS)
def clf(request):
    name, cls = request.param
    return cls(load_backbone(name, "cpu"), LABELS)


def _prefix(clf, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*prefix_shape(clf.backbone.model, n), generator=g)


def test_prefix_shape_finds_every_attention_layer(clf):
    model = clf.backbone.model
    L = model.config.num_hidden_layers
    shape = prefix_shape(model, 3)
    assert shape[:3] == (L, 2, 3) and len(kv_sites(model)) == L
    assert is_prefix(torch.zeros(shape)) and not is_prefix(torch.zeros(3, clf.embed_dim))


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_causal_prefix_equals_library_kv_cache(name):
    """Independent reference: the same keys/values handed to the model as a pre-filled
    DynamicCache (prefix at positions 0..2, text at 3..T+2, attention over prefix + text; a rotary
    model's cached keys rotated to their positions by the library's own rotary code) give the same
    hidden states at every text position."""
    from transformers import DynamicCache

    clf = VerbalizerCausalLM(load_backbone(name, "cpu"), LABELS)
    model, cfg = clf.backbone.model, clf.backbone.model.config
    prefix = _prefix(clf, n=3)
    enc = clf.encode(TEXTS)
    T = int(enc["attention_mask"].sum(1).max())
    ids, attn = enc["input_ids"][:, :T], enc["attention_mask"][:, :T]
    B = ids.shape[0]
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = prefix.shape[-1] // heads
    cache = DynamicCache()
    for layer in range(prefix.shape[0]):
        k, v = (prefix[layer, j].view(3, heads, head_dim).transpose(0, 1).unsqueeze(0).expand(B, -1, -1, -1)
                for j in (0, 1))
        if name == "tiny-llama":  # keys are cached after the rotation at their positions 0..2
            from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

            cos, sin = model.base_model.rotary_emb(k, torch.arange(3).expand(B, 3))
            k, _ = apply_rotary_pos_emb(k, k, cos, sin)
        cache.update(k.contiguous(), v.contiguous(), layer)
    with torch.no_grad():
        ref = model.base_model(input_ids=ids, attention_mask=torch.cat([torch.ones(B, 3, dtype=attn.dtype), attn], 1),
                               position_ids=3 + torch.arange(T).expand(B, T), past_key_values=cache,
                               use_cache=True).last_hidden_state
        embeds, mask, _ = clf._embed_inputs(enc, prefix)
        with clf.prompting(prefix, B):
            ours = clf._base(inputs_embeds=embeds, attention_mask=mask,
                             position_ids=clf.position_ids(B, embeds.shape[1], embeds.device)).last_hidden_state
    real = attn.bool()
    torch.testing.assert_close(ours[:, 3:][real], ref[real], atol=1e-5, rtol=1e-4)
    # and the hooks are gone afterwards: no prefix, no change
    with torch.no_grad():
        plain = model.base_model(input_ids=ids, attention_mask=attn).last_hidden_state
    assert not torch.allclose(plain[real], ref[real], atol=1e-3)
    torch.testing.assert_close(clf(enc), VerbalizerCausalLM(clf.backbone, LABELS)(enc))


def test_prefix_changes_outputs_and_padding_is_invariant(clf):
    prefix = _prefix(clf)
    enc = clf.encode(TEXTS)
    with torch.no_grad():
        with_prefix, without = clf(enc, prefix), clf(enc)
        one_by_one = torch.cat([clf(select_rows(enc, [i]), prefix) for i in range(len(TEXTS))])
    assert not torch.allclose(with_prefix, without, atol=1e-4)
    torch.testing.assert_close(with_prefix, one_by_one, atol=1e-5, rtol=1e-4)


def test_prefix_per_sample_gradients_match_per_example_loop(clf):
    enc = clf.encode(TEXTS)
    prefix = _prefix(clf)
    grads = per_sample_prompt_gradients(clf, enc, Y, prefix)
    assert grads.shape == (len(TEXTS), *prefix.shape)
    loop = []
    for i in range(len(TEXTS)):
        p = prefix.clone().requires_grad_()
        (g,) = torch.autograd.grad(F.cross_entropy(clf(select_rows(enc, [i]), p), Y[i:i + 1]), p)
        loop.append(g)
    torch.testing.assert_close(grads, torch.stack(loop), atol=1e-5, rtol=1e-4)
    # every trainable tensor gets a gradient: the keys and the values of every layer
    per_tensor = grads.abs().sum(dim=(0, 3, 4))  # (L, 2)
    assert (per_tensor > 0).all(), per_tensor
    assert not torch.allclose(grads[0], grads[1], atol=1e-7)


def test_prefix_save_load_and_scoring(clf, tmp_path):
    prefix = _prefix(clf)
    path = save_prompt_artifact(tmp_path / "prefix.safetensors", prefix, {"method": "x"})
    loaded, meta = load_prompt_artifact(path)
    assert meta["kind"] == "prefix" and prompt_kind(loaded) == "prefix"
    torch.testing.assert_close(loaded, prefix)
    enc = clf.encode(TEXTS)
    losses = per_example_loss(clf, enc, Y, loaded, batch_size=2)
    with torch.no_grad():
        direct = F.cross_entropy(clf(enc, prefix), Y, reduction="none")
    torch.testing.assert_close(losses, direct, atol=1e-5, rtol=1e-4)


def test_prefix_initialised_from_real_word_activations():
    backbone = load_backbone("tiny-bert", "cpu")
    p = PrefixPrompt.init_from_vocab(backbone, "great movie", n_tokens=4)
    assert tuple(p.weight.shape) == prefix_shape(backbone.model, 4)
    assert torch.isfinite(p.weight).all() and p.weight.abs().sum() > 0


def _toy(clf, n=16):
    pos, neg = ["good", "great", "wonderful", "excellent"], ["bad", "awful", "terrible", "boring"]
    texts = [f"{(pos if i % 2 else neg)[(i // 2) % 4]} movie" for i in range(n)]
    return clf.encode(texts, max_length=16), torch.tensor([i % 2 for i in range(n)])


@pytest.mark.slow  # suite time: runs with -m slow
@pytest.mark.parametrize("private", [False, True], ids=["nonprivate", "dp"])
def test_prefix_training_learns_on_minilm(private):
    """Tiny random models cannot separate a balanced task with one shared prompt; MiniLM can."""
    from models import accuracy, build_classifier

    clf = build_classifier(load_backbone("minilm", "cpu"), LABELS)
    enc, y = _toy(clf)
    tc = PromptTrainingConfig(n_tokens=4, lr=0.05, steps=40, batch_size=8, kind="prefix", init_words="it was a movie")
    init = PrefixPrompt.init_from_vocab(clf.backbone, "it was a movie", n_tokens=4).weight.detach()
    before = per_example_loss(clf, enc, y, init).mean()
    dp = DPConfig(noise_multiplier=0.3, max_grad_norm=1.0, sample_rate=0.5) if private else None
    streams = dict(zip(("sample_generator", "noise_generator"), seeded_dp_generators(0))) if private else {}
    res = train_prompt(clf, enc, y, tc, dp=dp, seed=0, **streams)
    assert res.private == private and res.steps == 40
    assert tuple(res.prompt.shape) == prefix_shape(clf.backbone.model, 4)
    after = per_example_loss(clf, enc, y, res.prompt).mean()
    assert after < 0.6 * before, (float(before), float(after))
    assert accuracy(clf, enc, y, res.prompt) == 1.0
    if private:  # same seeded streams, same prefix
        again = train_prompt(clf, enc, y, tc, dp=dp, seed=0,
                             **dict(zip(("sample_generator", "noise_generator"), seeded_dp_generators(0))))
        torch.testing.assert_close(res.prompt, again.prompt)


def test_prefix_hooks_are_per_thread():
    """The backbone is shared: a thread's prefix never reaches another thread's forward."""
    import threading

    clf = VerbalizerCausalLM(load_backbone("tiny-gpt2", "cpu"), LABELS)
    enc = clf.encode(TEXTS)
    prefixes = [_prefix(clf, seed=s) for s in range(3)]
    with torch.no_grad():
        expected = [clf(enc, p) for p in prefixes] + [clf(enc)]
    results, errors = {}, []

    def work(i):
        try:
            with torch.no_grad():
                for _ in range(5):
                    out = clf(enc, prefixes[i]) if i < 3 else clf(enc)
                    torch.testing.assert_close(out, expected[i])
            results[i] = True
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 4


def test_models_sharing_attention_across_layers_are_refused():
    from transformers import AlbertConfig, AlbertModel

    model = AlbertModel(AlbertConfig(vocab_size=50, embedding_size=8, hidden_size=16, num_hidden_layers=3,
                                     num_attention_heads=2, intermediate_size=16))
    with pytest.raises(ValueError, match="shares its attention modules"):
        prefix_shape(model, 2)


def test_roberta_positions_keep_their_padding_offset():
    from transformers import RobertaConfig, RobertaModel

    from models.prompts.prefix import prefix_position_ids

    model = RobertaModel(RobertaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=16, pad_token_id=1))
    ids = prefix_position_ids(model, 1, 5, 2, "cpu")
    assert ids.tolist() == [[2, 3, 4, 5, 6]]  # RoBERTa's positions start at pad_token_id + 1, prefix first


def test_nonfinite_per_example_gradient_contributes_nothing(monkeypatch):
    import models.dp_prompt_training as dpt

    clf = VerbalizerCausalLM(load_backbone("tiny-gpt2", "cpu"), LABELS)
    enc = clf.encode(TEXTS)
    original = dpt.per_sample_prompt_gradients

    def overflowing(*a, **k):
        grads, losses = original(*a, **k)
        grads[0] = float("inf")
        return grads, losses

    monkeypatch.setattr(dpt, "per_sample_prompt_gradients", overflowing)
    sample, noise = seeded_dp_generators(0)
    res = train_prompt(clf, enc, Y, PromptTrainingConfig(n_tokens=2, steps=3, batch_size=5, kind="prefix"),
                       dp=DPConfig(noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=1.0), seed=0,
                       sample_generator=sample, noise_generator=noise)
    assert torch.isfinite(res.prompt).all()
    assert [h["nonfinite_examples"] for h in res.history] == [1, 1, 1]
