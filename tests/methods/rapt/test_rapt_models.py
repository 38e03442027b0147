"""RAPT's model side: fast exact token privatisation, the reconstruction head, the model, attacks."""

from pathlib import Path

import numpy as np
import pytest
import torch

import tasks.methods.rapt.attacks as attacks_module
from tasks.methods.base import run_label
from tasks.methods.rapt.attacks import (
    HiddenStateInverter,
    attribute_inference,
    embedding_inversion_success,
    hidden_inversion_attack,
    pooled_text_states,
    text_states,
    hidden_inversion_nn_success,
)
from tasks.methods.rapt.encoding import (
    PrivatizedEncoding,
    default_plain_ids,
    encode_rapt,
    privatize_encoding,
    replaced_share,
)
from tasks.methods.rapt.head import ReconstructionHead, reconstruction_vocab
from tasks.methods.rapt.model import RaptModel, build_task_head, train_rapt
from tasks.methods.rapt.privatize import (
    BackbonePrivatizer,
    VocabularyIndex,
    privatize_ids,
    replace_probability,
)
from models.backbones import load_backbone
from models.soft_prompt import SoftPrompt
from privacy.mechanisms import dx_privatize_embeddings, nearest_neighbor_tokens

TEXTS = ["a great movie with a moving story", "terrible acting and a bad plot", "i loved every minute of it",
         "boring , slow and far too long", "the best film of the year", "a waste of time and money",
         "wonderful performances all round", "dull characters and a silly ending"]
LABELS = [1, 0, 1, 0, 1, 0, 1, 0]


@pytest.fixture(scope="module")
def tiny():
    return load_backbone("tiny-bert", device="cpu")


@pytest.fixture(scope="module")
def tiny_privatizer(tiny):
    return BackbonePrivatizer(tiny)


# ---- privatisation ---------------------------------------------------------------------------

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("screen_dtype,device", [(torch.float32, "cpu"), (torch.bfloat16, "cpu"),
                                                 pytest.param(torch.float32, "cuda", marks=CUDA),
                                                 pytest.param(torch.bfloat16, "cuda", marks=CUDA)])
def test_nearest_equals_brute_force_numpy(screen_dtype, device):
    rng = np.random.default_rng(0)
    vocab = rng.standard_normal((3000, 48))
    vocab[7] = vocab[8]  # an exact tie: both numpy and the index must pick the lower id
    exclude = [0, 1, 2, 100]
    index = VocabularyIndex(torch.from_numpy(vocab).float(), exclude, screen_dtype=screen_dtype, device=device)
    assert index.screen_vocab.device.type == device
    vocab32 = index.vocab64.numpy()  # what the index searches (the float32 embeddings, widened)
    for eta in (2.0, 10.0, 50.0, 1e4):
        ids = rng.integers(0, 3000, size=400)
        ids[:3] = 8
        noisy = dx_privatize_embeddings(vocab32[ids], eta, rng)
        expected = nearest_neighbor_tokens(noisy, vocab32, exclude)
        got = index.nearest(noisy)
        assert np.array_equal(got, expected), f"eta={eta}: {np.mean(got != expected)} differ"
        assert not np.isin(got, exclude).any()
    assert 8 not in index.nearest(vocab32[[8, 8]])  # tie resolved to 7, like numpy's argmin


@pytest.mark.parametrize("screen_dtype", [torch.float32, torch.bfloat16])
def test_nearest_over_several_chunks_and_a_partial_one(monkeypatch, screen_dtype):
    """The search reuses one (V, chunk) score buffer and mask across chunks: a last, shorter chunk
    writes into views of them; every chunk must still equal brute force."""
    from tasks.methods.rapt import privatize

    monkeypatch.setattr(privatize, "CHUNK_ROWS", 128)
    rng = np.random.default_rng(3)
    vocab = rng.standard_normal((1500, 24))
    index = VocabularyIndex(torch.from_numpy(vocab).float(), [0, 5], screen_dtype=screen_dtype, device="cpu")
    vocab32 = index.vocab64.numpy()
    noisy = dx_privatize_embeddings(vocab32[rng.integers(0, 1500, size=300)], 8.0, rng)  # 128 + 128 + 44
    expected = nearest_neighbor_tokens(noisy, vocab32, [0, 5])
    assert np.array_equal(index.nearest(noisy), expected)
    assert np.array_equal(index.nearest(noisy[:7]), expected[:7])  # fewer rows than a chunk


@pytest.mark.parametrize("screen_dtype", [torch.float32, torch.bfloat16])
def test_excluded_ids_never_win_however_far_the_query(screen_dtype):
    """Excluded ids screen as −inf, not a finite penalty: with queries of norm 1e6–1e8 (η ≈ 1e-6)
    a penalty of 1e6 let an excluded id set the row's best score and come out."""
    index = VocabularyIndex(np.array([[1500.0, 0.0], [1500.0, 0.0], [0.0, 1.0]]), [0], screen_dtype=screen_dtype)
    assert index.nearest(np.array([[1500.0, 0.0]])).tolist() == [1]
    rng = np.random.default_rng(4)
    vocab = rng.standard_normal((200, 16))
    index = VocabularyIndex(torch.from_numpy(vocab), [0, 1, 2], screen_dtype=screen_dtype)
    for eta in (1e-6, 1e-7):
        noisy = dx_privatize_embeddings(vocab[rng.integers(3, 200, size=2000)], eta, rng)
        got = index.nearest(noisy)
        assert not np.isin(got, [0, 1, 2]).any(), eta
        assert np.array_equal(got, nearest_neighbor_tokens(noisy, vocab, [0, 1, 2])), eta


def test_nearest_refuses_queries_it_cannot_screen_exactly():
    index = VocabularyIndex(np.eye(4), [3], screen_dtype=torch.float32)
    with pytest.raises(ValueError, match="finite"):
        index.nearest(np.array([[np.nan, 0, 0, 0], [1.0, 0, 0, 0]]))
    with pytest.raises(ValueError, match="η is far too small"):
        index.nearest(np.array([[1e39, 0, 0, 0], [1.0, 0, 0, 0]]))
    with pytest.raises(ValueError, match="η is far too small"):  # through the ids entry point
        privatize_ids(torch.tensor([[0, 1, 2]]), None, None, 1e-40, np.random.default_rng(0), index=index)
    assert index.nearest(np.array([[1e30, 0, 0, 0]])).tolist() == [0]  # far, but within range
    with pytest.raises(ValueError, match="η is far too small"):  # the limit itself is refused
        index.nearest(np.array([[index.max_query_norm, 0, 0, 0]]))
    with pytest.raises(ValueError, match="embeddings too large"):  # ½‖v‖² beyond float32
        VocabularyIndex(np.array([[1e20, 0.0], [0.0, 1.0]]), screen_dtype=torch.float32)


@pytest.mark.parametrize("size", [31, 32, 33, 97])
@pytest.mark.parametrize("screen_dtype", [torch.float32, torch.bfloat16])
def test_block_maxima_find_every_candidate(size, screen_dtype):
    """Candidates come from the blocks of BLOCK_ROWS ids whose maximum passes the floor, the
    vocabulary padded to whole blocks with −inf rows: ties within a block and across a block
    boundary, and vocabularies shorter than, equal to and past a block, equal brute force."""
    from tasks.methods.rapt.privatize import BLOCK_ROWS

    assert BLOCK_ROWS == 32
    rng = np.random.default_rng(size)
    vocab = rng.standard_normal((size, 6))
    vocab[size - 1] = vocab[size // 2]  # a tie the lowest id must win, across blocks when size > 32
    vocab[1] = vocab[2]  # and one within the first block
    index = VocabularyIndex(torch.from_numpy(vocab), [0], screen_dtype=screen_dtype)
    assert index.screen_vocab.shape[0] % BLOCK_ROWS == 0
    queries = np.concatenate([vocab[[size - 1, size // 2, 2, 1]],
                              dx_privatize_embeddings(vocab[rng.integers(1, size, size=400)], 4.0, rng)])
    expected = nearest_neighbor_tokens(queries, vocab, [0])
    assert expected[0] == expected[1] == size // 2 and expected[2] == expected[3] == 1
    assert np.array_equal(index.nearest(queries), expected)


@pytest.mark.slow  # suite time: runs with -m slow
def test_minilm_search_equals_brute_force_over_the_eta_grid():
    """The real vocabulary (MiniLM's 30,522 × 384 input embeddings, specials excluded), the
    default screening dtype of this machine, 1,200 noisy tokens (more than two chunks) per η of
    the RAPT grid and beyond: equal to the float64 numpy search."""
    priv = BackbonePrivatizer(load_backbone("minilm", device="cpu"))
    vocab = priv.index.vocab64.numpy()
    rng = np.random.default_rng(11)
    for eta in (50.0, 100.0, 150.0, 1000.0):
        ids = rng.integers(1000, priv.index.size, size=1200)
        noisy = dx_privatize_embeddings(vocab[ids], eta, rng)
        expected = nearest_neighbor_tokens(noisy, vocab, priv.exclude_ids)
        assert np.array_equal(priv.index.nearest(noisy), expected), eta


def test_screen_dtype_follows_native_bf16_support(monkeypatch):
    from tasks.methods.rapt import privatize

    assert privatize.cpu_has_native_bf16("flags : fpu sse2 avx2 avx512f avx512_bf16 amx_tile")
    assert privatize.cpu_has_native_bf16("flags : fpu avx2 amx_bf16")
    assert not privatize.cpu_has_native_bf16("flags : fpu sse2 avx avx2 f16c fma")
    assert not privatize.cpu_has_native_bf16("flags : avx512f avx512_bf16x")  # whole flags only
    monkeypatch.setattr(privatize, "cpu_has_native_bf16", lambda cpuinfo=None: False)
    assert VocabularyIndex(torch.randn(50, 8), device="cpu").screen_dtype == torch.float32
    monkeypatch.setattr(privatize, "cpu_has_native_bf16", lambda cpuinfo=None: True)
    assert VocabularyIndex(torch.randn(50, 8), device="cpu").screen_dtype == torch.bfloat16
    assert VocabularyIndex(torch.randn(50, 8), screen_dtype=torch.float32, device="cpu").screen_dtype == torch.float32
    assert privatize.default_screen_dtype("cuda") == torch.float32  # TF32 off, fast enough on a GPU


def test_screening_ignores_a_reduced_float32_matmul_precision():
    """A caller's torch.set_float32_matmul_precision("medium") may let the backend multiply
    float32 in bfloat16 passes (TF32 on CUDA): the screening product runs at "highest" anyway,
    stays equal to brute force, and the caller's setting is restored."""
    rng = np.random.default_rng(1)
    vocab = rng.standard_normal((2000, 32))
    index = VocabularyIndex(torch.from_numpy(vocab).float(), [0], screen_dtype=torch.float32)
    noisy = dx_privatize_embeddings(index.vocab64.numpy()[rng.integers(1, 2000, size=300)], 20.0, rng)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        got = index.nearest(noisy)
        assert torch.get_float32_matmul_precision() == "medium"
        assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction  # torch's default, restored
    finally:
        torch.set_float32_matmul_precision(before)
    assert np.array_equal(got, nearest_neighbor_tokens(noisy, index.vocab64.numpy(), [0]))


def test_privatize_ids_specials_padding_and_eta(tiny, tiny_privatizer):
    tok = tiny.tokenizer
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    ids, attn = enc["input_ids"], enc["attention_mask"]
    special = torch.isin(ids, torch.tensor(tiny_privatizer.exclude_ids)) | (attn == 0)
    rates = []
    for eta in (100.0, 250.0, 600.0):
        out = tiny_privatizer(ids, attn, eta, np.random.default_rng(1))
        assert out.shape == ids.shape and out.dtype == torch.long
        assert torch.equal(out[special], ids[special])  # [CLS], [SEP], padding pass through
        assert not torch.isin(out[~special], torch.tensor(tiny_privatizer.exclude_ids)).any()
        rates.append(tiny_privatizer.replace_probability(ids, out, attn))
    assert rates[0] > rates[1] > rates[2] and rates[0] > 0.5, rates
    huge = tiny_privatizer(ids, attn, 1e9, np.random.default_rng(2))
    assert torch.equal(huge, ids)


def test_privatize_ids_noise_comes_from_the_given_generator(tiny, tiny_privatizer):
    enc = tiny.tokenizer(TEXTS, padding=True, return_tensors="pt")
    a = tiny_privatizer(enc["input_ids"], enc["attention_mask"], 5.0, np.random.default_rng(3))
    b = tiny_privatizer(enc["input_ids"], enc["attention_mask"], 5.0, np.random.default_rng(3))
    c = tiny_privatizer(enc["input_ids"], enc["attention_mask"], 5.0, np.random.default_rng(4))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_privatize_ids_rejects_bad_input(tiny):
    emb = tiny.input_embeddings().weight.detach()
    with pytest.raises(ValueError, match="integer"):
        privatize_ids(torch.zeros((1, 3)), None, emb, 5.0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="vocabulary size"):
        privatize_ids(torch.tensor([[10 ** 6]]), None, emb, 5.0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="attention_mask"):
        privatize_ids(torch.tensor([[5, 6]]), torch.ones((1, 3)), emb, 5.0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="eta"):
        privatize_ids(torch.tensor([[5, 6]]), None, emb, -1.0, np.random.default_rng(0))


def test_minilm_ids_entry_point():
    priv = BackbonePrivatizer()  # MiniLM's input embeddings, its special ids excluded
    assert priv.index.size == 30522 and priv.index.dim == 384
    enc = priv.backbone.tokenizer(TEXTS[:2], padding=True, return_tensors="pt")
    out = priv(enc["input_ids"], enc["attention_mask"], 1e9, np.random.default_rng(0))
    assert torch.equal(out, enc["input_ids"])
    noisy = priv(enc["input_ids"], enc["attention_mask"], 50.0, np.random.default_rng(0))
    assert priv.replace_probability(enc["input_ids"], noisy, enc["attention_mask"]) > 0.5
    # equal to the brute force on MiniLM's own vocabulary at the η the configs use
    vocab = priv.index.vocab64.numpy()
    rng = np.random.default_rng(5)
    for eta in (50.0, 100.0, 150.0):
        noisy_vectors = dx_privatize_embeddings(vocab[rng.integers(1000, 30000, size=64)], eta, rng)
        assert np.array_equal(priv.index.nearest(noisy_vectors),
                              nearest_neighbor_tokens(noisy_vectors, vocab, priv.exclude_ids))


# ---- encoding, head, model ---------------------------------------------------------------------

def _privatized(tiny, privatizer, eta=8.0, m=40, texts=TEXTS, seed=0):
    plain = default_plain_ids(tiny.tokenizer, m)
    enc = encode_rapt(tiny.tokenizer, texts, plain, max_length=64)
    return plain, enc, privatize_encoding(enc, plain, privatizer, eta, np.random.default_rng(seed))


def test_encoding_layout_and_privatized_masks(tiny, tiny_privatizer):
    plain, enc, data = _privatized(tiny, tiny_privatizer)
    assert len(plain) == 40 and len(set(plain)) == 40
    assert torch.equal(enc["input_ids"][:, 1:41], torch.tensor(plain).expand(len(TEXTS), 40))
    assert not enc["text_mask"][:, :41].any() and enc["text_mask"].any(1).all()
    assert torch.equal(data.attention_mask, enc["attention_mask"]) and torch.equal(data.text_mask, enc["text_mask"])
    assert 0.0 < replaced_share(enc, data) <= 1.0
    assert not hasattr(data, "replace_prob")  # no statistic of the private text rides along to the model side
    assert not torch.equal(data.input_ids[:, 1:41], enc["input_ids"][:, 1:41])  # plain tokens privatised too
    with pytest.raises(ValueError, match="max_length"):
        encode_rapt(tiny.tokenizer, TEXTS, plain, max_length=42)



def test_special_ids_inside_the_text_are_privatized(tiny, tiny_privatizer):
    """[UNK] (or a literal [MASK]) inside a private text is no longer released as it was: every
    text position is privatised, only the framing [CLS] / [SEP] / padding passes through."""
    plain, enc, _ = _privatized(tiny, tiny_privatizer, m=4)
    tok = tiny.tokenizer
    ids, text = enc["input_ids"].clone(), enc["text_mask"]
    first_text = text.float().argmax(1)
    rows = torch.arange(ids.shape[0])
    ids[rows, first_text] = tok.unk_token_id
    ids[rows, first_text + 1] = tok.mask_token_id
    enc = {**enc, "input_ids": ids}
    data = privatize_encoding(enc, plain, tiny_privatizer, 1e9, np.random.default_rng(0))  # η huge: no noise
    special = set(tok.all_special_ids)
    out = data.input_ids
    assert not any(int(i) in special for i in out[text])  # never released as a special id
    assert replaced_share(enc, data) == pytest.approx(2 * len(rows) / int(text.sum()))  # only those changed
    frame = enc["attention_mask"].bool() & ~text
    frame[:, 1:5] = False  # plain tokens: privatised (unchanged at this η)
    assert torch.equal(out[frame], ids[frame])  # [CLS] / [SEP] as they were
    assert torch.equal(out[~enc["attention_mask"].bool()], ids[~enc["attention_mask"].bool()])  # padding


def test_reconstruction_vocab_from_public_ids():
    public = [[5, 5, 5, 9, 9, 3], torch.tensor([9, 4, 0])]
    vocab = reconstruction_vocab(public, plain_ids=[100, 101], size=2, exclude_ids=[0])
    assert vocab.tolist() == [5, 9, 100, 101]  # the 2 most frequent public ids + the plain tokens
    head = ReconstructionHead(vocab, hidden_size=8, head_hidden=3)
    assert head.w2.weight.shape == (3, 8) and head.w1.weight.shape == (4, 3)
    assert head.target_index(torch.tensor([9, 101])).tolist() == [1, 3]
    with pytest.raises(ValueError, match="reconstruction vocabulary"):
        head.target_index(torch.tensor([7]))


def _model(tiny, plain, enc, with_head=True, prompt_tokens=4):
    head = None
    if with_head:
        vocab = reconstruction_vocab([enc["input_ids"].reshape(-1)], plain, exclude_ids=tiny.tokenizer.all_special_ids)
        head = ReconstructionHead(vocab, tiny.embed_dim)
    torch.manual_seed(0)
    return RaptModel(tiny, SoftPrompt.init_from_vocab(tiny, prompt_tokens), build_task_head(tiny, ["bad", "good"]),
                     len(plain), head)


def test_reconstruction_loss_falls_and_head_is_absent_at_inference(tiny, tiny_privatizer):
    plain, enc, data = _privatized(tiny, tiny_privatizer)
    model = _model(tiny, plain, enc)
    seen = []
    train_rapt(model, data, torch.tensor(LABELS), steps=25, batch_size=8, lr=1e-2,
               generator=torch.Generator().manual_seed(0), on_step=lambda s, l: seen.append(l))
    first, last = seen[0], seen[-1]
    assert set(first) == {"task", "reconstruction", "total"}
    assert last["reconstruction"] < 0.5 * first["reconstruction"], (first, last)
    inference = model.inference()
    assert not hasattr(inference, "reconstruction_head")
    names = [n for n, _ in inference.named_parameters()] + list(inference.state_dict())
    assert not any(n.startswith("reconstruction_head") for n in names)
    assert torch.equal(inference.prompt.weight, model.prompt.weight)
    assert inference.predict(data).shape == (len(TEXTS),)
    assert model.inference()(data).shape == (len(TEXTS), 2)


def test_task_loss_pools_text_positions_only(tiny, tiny_privatizer):
    plain, enc, data = _privatized(tiny, tiny_privatizer)
    model = _model(tiny, plain, enc, with_head=False)
    with torch.no_grad():
        hidden = model.hidden_states(data)
        base = model.task_logits_from_hidden(hidden, data.text_mask)
        moved = hidden.clone()
        moved[:, 1:41] += 10.0  # plain-token positions
        moved[:, 0] -= 10.0  # [CLS]
        assert torch.allclose(model.task_logits_from_hidden(moved, data.text_mask), base)
        text = hidden.clone()
        text[data.text_mask[:, :hidden.shape[1]]] += 1.0
        assert not torch.allclose(model.task_logits_from_hidden(text, data.text_mask), base)


def test_model_side_takes_only_privatized_inputs(tiny, tiny_privatizer):
    plain, enc, data = _privatized(tiny, tiny_privatizer)
    model = _model(tiny, plain, enc)
    with pytest.raises(TypeError, match="privatised"):
        model(enc)
    with pytest.raises(TypeError, match="privatised"):
        train_rapt(model, enc, torch.tensor(LABELS), steps=1)
    other = PrivatizedEncoding(data.input_ids, data.attention_mask, data.text_mask, tuple(plain[:3]), 8.0)
    with pytest.raises(ValueError, match="plain tokens"):
        model(other)


def test_model_without_plain_tokens_and_without_head(tiny, tiny_privatizer):
    plain, enc, data = _privatized(tiny, tiny_privatizer, m=0)
    model = _model(tiny, plain, enc, with_head=False)
    seen = []
    train_rapt(model, data, torch.tensor(LABELS), steps=2, batch_size=4, on_step=lambda s, l: seen.append(l))
    assert set(seen[0]) == {"task", "total"}
    with pytest.raises(ValueError, match="plain tokens"):
        RaptModel(tiny, SoftPrompt(2, tiny.embed_dim), build_task_head(tiny, ["bad", "good"]), 0,
                  ReconstructionHead(torch.tensor([1, 2]), tiny.embed_dim))



def test_reconstruction_weight_scales_the_reconstruction_term(tiny, tiny_privatizer):
    plain, enc, data = _privatized(tiny, tiny_privatizer)
    model = _model(tiny, plain, enc)
    labels = torch.tensor(LABELS)
    with torch.no_grad():
        base = model.losses(data, labels)
        assert torch.allclose(base["total"], base["task"] + base["reconstruction"])
        for weight in (0.0, 0.1, 2.5):
            model.reconstruction_weight = weight
            out = model.losses(data, labels)
            assert torch.allclose(out["task"], base["task"]) and torch.allclose(out["reconstruction"],
                                                                                base["reconstruction"])
            assert torch.allclose(out["total"], base["task"] + weight * base["reconstruction"])
    with pytest.raises(ValueError, match="reconstruction_weight"):
        RaptModel(tiny, SoftPrompt(2, tiny.embed_dim), build_task_head(tiny, ["bad", "good"]), len(plain),
                  model.reconstruction_head, reconstruction_weight=-1.0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_reconstruction_head_follows_the_backbone_device(device, tiny_privatizer):
    """The method builds the head on the CPU; with a CUDA backbone the head's product with the hidden
    states failed ("mat2 is on cpu") until RaptModel put the head on the backbone's device."""
    bb = load_backbone("tiny-bert", device=device)
    plain, enc, data = _privatized(bb, tiny_privatizer)
    model = _model(bb, plain, enc)
    assert {p.device for p in model.reconstruction_head.parameters()} == {bb.device}
    seen = []
    train_rapt(model, data, torch.tensor(LABELS), steps=2, batch_size=4, on_step=lambda s, l: seen.append(l))
    assert set(seen[0]) == {"task", "reconstruction", "total"}
    assert all(np.isfinite(v) for losses in seen for v in losses.values())


def test_run_label_names_a_reconstruction_weight_other_than_the_papers():
    from tasks.config import load_config
    from tasks.methods import get_method

    path = Path(__file__).resolve().parents[3] / "configs" / "rapt.yaml"
    method = get_method("rapt")
    assert run_label(method, load_config(path)) == "rapt[prompt+reconstruction]"
    cfg = load_config(path, ["methods.rapt.reconstruction_weight=0.1", "methods.rapt.tuning=prefix"])
    assert run_label(method, cfg) == "rapt[prefix+reconstruction λ=0.1]"
    assert method.mechanism.plan(cfg, 100, 1e-5).params["rapt.reconstruction_weight"] == 0.1
    cfg = load_config(path, ["methods.rapt.reconstruction=false"])
    assert run_label(method, cfg) == "rapt[prompt]" and method.mechanism.plan(cfg, 100, 1e-5).params[
        "rapt.reconstruction_weight"] == 0.0


# ---- attacks ----------------------------------------------------------------------------------

def test_changed_share_counts_the_given_positions_and_refuses_none():
    from tasks.methods.rapt.privatize import changed_share

    orig = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 0]])
    priv = torch.tensor([[5, 4, 7, 3], [1, 10, 11, 0]])
    pos = torch.tensor([[False, True, True, True], [True, True, True, False]])
    assert changed_share(orig, priv, pos) == pytest.approx(3 / 6)  # position (0, 0) changed nothing, not counted
    with pytest.raises(ValueError, match="no text tokens"):
        changed_share(orig, priv, torch.zeros_like(pos))
    with pytest.raises(ValueError, match="one shape"):
        changed_share(orig, priv[:, :3], pos)


def test_embedding_inversion_is_one_minus_replacement(tiny, tiny_privatizer):
    _plain, enc, data = _privatized(tiny, tiny_privatizer, eta=250.0)
    mask = data.text_mask
    success = embedding_inversion_success(data.input_ids, enc["input_ids"], mask, tiny_privatizer.index)
    assert success == pytest.approx(1.0 - replaced_share(enc, data))
    rp = replace_probability(enc["input_ids"], data.input_ids, mask, tiny_privatizer.exclude_ids)
    assert rp == pytest.approx(replaced_share(enc, data))


@pytest.mark.slow  # suite time: runs with -m slow
def test_hidden_state_inversion_attacks(tiny, tiny_privatizer):
    plain, enc, data = _privatized(tiny, tiny_privatizer, eta=1e9, m=0)  # nothing replaced
    model = _model(tiny, plain, enc, with_head=False, prompt_tokens=1)
    with torch.no_grad():
        hidden = model.hidden_states(data)
    mask = data.text_mask[:, :hidden.shape[1]]
    nn_success = hidden_inversion_nn_success(hidden, enc["input_ids"], mask, tiny_privatizer.index)
    assert 0.0 <= nn_success <= 1.0
    # a learned inverter on the same (public here) states recovers the tokens it was trained on
    ids = enc["input_ids"][:, :hidden.shape[1]][mask]
    inv = HiddenStateInverter(tiny.embed_dim, ids.unique(), width=64)
    inv.fit(hidden[mask], ids, epochs=60, generator=torch.Generator().manual_seed(0))
    assert inv.success(hidden[mask], ids) > 0.9
    assert inv.success(hidden[mask], torch.full_like(ids, 10 ** 6 - 1)) == 0.0  # outside its vocabulary


def test_hidden_inversion_attack_end_to_end(tiny, tiny_privatizer, monkeypatch):
    plain, enc, private = _privatized(tiny, tiny_privatizer, eta=250.0, m=0, texts=TEXTS[:4])
    _, pub_enc, public = _privatized(tiny, tiny_privatizer, eta=250.0, m=0, texts=TEXTS[4:] * 4, seed=1)
    model = _model(tiny, plain, enc, with_head=False, prompt_tokens=2).inference()
    vocab = reconstruction_vocab([pub_enc["input_ids"].reshape(-1)], [999], exclude_ids=tiny_privatizer.exclude_ids)
    torch.manual_seed(0)  # the inverter's initialisation
    out = hidden_inversion_attack(model, private, enc["input_ids"], public, pub_enc["input_ids"],
                                  tiny_privatizer.index, vocab, epochs=5, generator=torch.Generator().manual_seed(0))
    assert set(out) == {"nn_success", "learned_success"}
    assert all(0.0 <= v <= 1.0 for v in out.values())
    # states computed once by the caller give the same attack, and their pooled text states are
    # the model's own pooled_text (the attribute attack's features)
    states = text_states(model, private), text_states(model, public)
    torch.manual_seed(0)
    again = hidden_inversion_attack(model, private, enc["input_ids"], public, pub_enc["input_ids"],
                                    tiny_privatizer.index, vocab, epochs=5, generator=torch.Generator().manual_seed(0),
                                    states=states)
    assert again == out
    with torch.no_grad():
        torch.testing.assert_close(pooled_text_states(states[0], private.text_mask), model.pooled_text(private).float())
    # the inverter's classes are the vocabulary ids seen among the public training tokens: ids no
    # public token has change nothing; a vocabulary without any public token is an error
    unseen = torch.arange(10 ** 5, 10 ** 5 + 500)
    classes = []
    original_fit = attacks_module.HiddenStateInverter.fit
    monkeypatch.setattr(attacks_module.HiddenStateInverter, "fit",
                        lambda self, *a, **k: classes.append(self.vocab_ids.clone()) or original_fit(self, *a, **k))
    torch.manual_seed(0)
    padded = hidden_inversion_attack(model, private, enc["input_ids"], public, pub_enc["input_ids"],
                                     tiny_privatizer.index, torch.cat([vocab, unseen]), epochs=5,
                                     generator=torch.Generator().manual_seed(0), states=states)
    public_tokens = pub_enc["input_ids"][public.text_mask].unique()
    assert classes[0].tolist() == sorted(set(vocab.tolist()) & set(public_tokens.tolist()))
    assert padded == out
    with pytest.raises(ValueError, match="no public training token"):
        hidden_inversion_attack(model, private, enc["input_ids"], public, pub_enc["input_ids"],
                                tiny_privatizer.index, unseen, epochs=5, states=states)


@pytest.mark.slow  # suite time: runs with -m slow
def test_attribute_inference_success_beside_majority_rate():
    g = torch.Generator().manual_seed(0)
    attr = torch.randint(0, 2, (300,), generator=g)
    informative = torch.randn(300, 16, generator=g) + 3.0 * attr.unsqueeze(1).float()
    out = attribute_inference(informative, attr.numpy(), epochs=20, width=32, generator=g)
    assert set(out) == {"success", "majority_rate", "n_test"} and out["n_test"] == 90
    assert out["success"] > 0.95 and 0.3 < out["majority_rate"] < 0.7
    noise = attribute_inference(torch.randn(300, 16, generator=g), attr.numpy(), epochs=20, width=32, generator=g)
    assert noise["success"] < 0.7
    with pytest.raises(ValueError, match="two values"):
        attribute_inference(informative, np.zeros(300))


@pytest.mark.slow  # suite time: runs with -m slow
def test_prefix_tuning_trains_the_prefix_and_keeps_text_positions(tiny, tiny_privatizer):
    """RAPT with prefix tuning: the prefix's keys/values reach every layer (the text states change,
    the placeholders are dropped from G), the reconstruction loss falls, and the prefix trains."""
    from models.prompts.prefix import prefix_shape
    from models.soft_prompt import PrefixPrompt

    plain, enc, data = _privatized(tiny, tiny_privatizer)
    vocab = reconstruction_vocab([enc["input_ids"].reshape(-1)], plain, exclude_ids=tiny.tokenizer.all_special_ids)
    torch.manual_seed(0)
    prefix = PrefixPrompt.init_from_vocab(tiny, 3)
    model = RaptModel(tiny, prefix, build_task_head(tiny, ["bad", "good"]), len(plain),
                      ReconstructionHead(vocab, tiny.embed_dim))
    h = model.hidden_states(data)
    assert h.shape[1] == int(data.attention_mask.sum(1).max())  # G holds the input positions only
    with torch.no_grad():
        other = RaptModel(tiny, PrefixPrompt(prefix.weight * 3), build_task_head(tiny, ["bad", "good"]), len(plain))
        assert not torch.allclose(other.hidden_states(data), h, atol=1e-4)
    before = prefix.weight.detach().clone()
    seen = []
    train_rapt(model, data, torch.tensor(LABELS), steps=25, batch_size=8, lr=1e-2,
               generator=torch.Generator().manual_seed(0), on_step=lambda s, l: seen.append(l))
    assert tuple(model.prompt.weight.shape) == prefix_shape(tiny.model, 3)
    assert not torch.equal(before, model.prompt.weight)
    assert seen[-1]["reconstruction"] < 0.5 * seen[0]["reconstruction"]
    assert model.inference().predict(data).shape == (len(TEXTS),)
