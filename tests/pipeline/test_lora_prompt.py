"""LoRA prompts: per-sample gradients against a per-example loop and against Opacus on PEFT's LoRA,
every adapter tensor trained, the published adapter equal to PEFT's forward, the shared backbone
untouched, save/load, and a LoRA on another backbone refused."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F

from models import (CosineEncoderClassifier, DPConfig, PromptTrainingConfig, VerbalizerCausalLM, VerbalizerMaskedLM,
                    load_backbone, per_sample_prompt_gradients, select_rows, train_prompt)
from models.dp_prompt_training import seeded_dp_generators
from models.prompts import load_prompt_artifact, prompt_kind, save_prompt_artifact
from models.prompts.lora import LoraPrompt, check_fits, init_lora, lora_layout
from models.prompts.peft_export import save_peft_adapter

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


def _lora(clf, r=4, seed=1, scale=0.2):
    """A LoRA with B ≠ 0 (at PEFT's init B = 0 and A gets no gradient yet)."""
    layout = lora_layout(clf.backbone.model, r, 2 * r)
    g = torch.Generator().manual_seed(seed)
    return LoraPrompt(layout, torch.randn(layout.size, generator=g) * scale)


def _per_tensor(lora: LoraPrompt, grads: torch.Tensor) -> torch.Tensor:
    """(2 · modules,) summed |gradient| of each A and each B over the batch."""
    out = []
    for a, b, e in lora.layout.spans():
        out += [grads[:, a:b].abs().sum(), grads[:, b:e].abs().sum()]
    return torch.stack(out)


def test_targets_are_peft_defaults_per_architecture(clf):
    layout = lora_layout(clf.backbone.model, 4, 8)
    expected = {"gpt2": ("c_attn",), "llama": ("q_proj", "v_proj"), "bert": ("query", "value")}
    assert layout.targets == expected[clf.backbone.model.config.model_type]
    layers = clf.backbone.model.config.num_hidden_layers
    assert len(layout.modules) == layers * len(layout.targets)
    assert layout.size == sum(4 * (i + o) for i, o in layout.shapes)


def test_lora_per_sample_gradients_match_per_example_loop(clf):
    enc, lora = clf.encode(TEXTS), _lora(clf)
    grads = per_sample_prompt_gradients(clf, enc, Y, lora)
    assert grads.shape == (len(TEXTS), lora.layout.size)
    loop = []
    for i in range(len(TEXTS)):
        p = lora.weight.clone().requires_grad_()
        (g,) = torch.autograd.grad(F.cross_entropy(clf(select_rows(enc, [i]), LoraPrompt(lora.layout, p)),
                                                   Y[i:i + 1]), p)
        loop.append(g)
    torch.testing.assert_close(grads, torch.stack(loop), atol=1e-5, rtol=1e-4)
    assert (_per_tensor(lora, grads) > 0).all()  # every A and every B of every layer gets a gradient
    assert not torch.allclose(grads[0], grads[1], atol=1e-7)


@pytest.mark.parametrize("per_example", [False, True], ids=["shared", "per-example"])
def test_one_context_sees_an_in_place_update_and_accumulates_two_backwards(clf, per_example):
    """The (A, B) split is made once per block: an in-place change of θ inside the block is used by
    the next forward, and two forward/backward passes in one block give the gradient of two blocks."""
    from models.prompts.lora import lora_hooks

    enc, lora, model = clf.encode(TEXTS), _lora(clf), clf.backbone.model
    if per_example:  # (B, P): one copy of θ per row
        lora = LoraPrompt(lora.layout, lora.weight.expand(len(TEXTS), -1).clone())
    inputs = {k: enc[k] for k in ("input_ids", "attention_mask")}

    def out(weight, times=1):
        with lora_hooks(model, LoraPrompt(lora.layout, weight), len(TEXTS)):
            return [model(**inputs)[0] for _ in range(times)]

    with torch.no_grad():
        w = lora.weight.clone()
        with lora_hooks(model, LoraPrompt(lora.layout, w), len(TEXTS)):
            first = model(**inputs)[0]
            w.mul_(2.0)
            second = model(**inputs)[0]
        torch.testing.assert_close(first, out(lora.weight)[0])
        torch.testing.assert_close(second, out(lora.weight * 2.0)[0])
        assert not torch.allclose(first, second)
    p = lora.weight.clone().requires_grad_()
    with lora_hooks(model, LoraPrompt(lora.layout, p), len(TEXTS)):
        for _ in range(2):
            model(**inputs)[0].square().mean().backward()
    q = lora.weight.clone().requires_grad_()
    (g,) = torch.autograd.grad(out(q)[0].square().mean(), q)
    torch.testing.assert_close(p.grad, 2 * g)


def test_opacus_per_sample_gradients_of_peft_lora_equal_privprompts():
    """An independent reference: Opacus' GradSampleModule on PEFT's own LoRA layers (a copy of the
    backbone, PEFT-injected) gives, module for module, the per-sample gradients of the DP step."""
    GradSampleModule = pytest.importorskip("opacus").GradSampleModule
    from peft import LoraConfig, get_peft_model

    clf = VerbalizerCausalLM(load_backbone("tiny-llama", "cpu"), LABELS)
    lora = _lora(clf)
    enc = clf.encode(TEXTS)
    ours = per_sample_prompt_gradients(clf, enc, Y, lora)
    layout = lora.layout
    peft_model = get_peft_model(copy.deepcopy(clf.backbone.model),
                                LoraConfig(r=layout.r, lora_alpha=layout.alpha, target_modules=list(layout.targets),
                                           lora_dropout=0.0))
    named = dict(peft_model.named_modules())
    with torch.no_grad():
        for name, (A, B) in zip(layout.modules, lora.adapters()):
            named[f"base_model.model.{name}"].lora_A["default"].weight.copy_(A)
            named[f"base_model.model.{name}"].lora_B["default"].weight.copy_(B)
    gsm = GradSampleModule(peft_model, batch_first=True, loss_reduction="sum")
    T = int(enc["attention_mask"].sum(1).max())
    logits = gsm(input_ids=enc["input_ids"][:, :T], attention_mask=enc["attention_mask"][:, :T]).logits
    scores = F.log_softmax(logits[torch.arange(len(TEXTS)), enc["label_pos"]].float(), -1)[:, clf.label_token_ids]
    F.cross_entropy(scores, Y, reduction="sum").backward()
    for k, ((a, b, e), name) in enumerate(zip(layout.spans(), layout.modules)):
        module = named[f"base_model.model.{name}"]
        theirs_a = module.lora_A["default"].weight.grad_sample
        theirs_b = module.lora_B["default"].weight.grad_sample
        assert theirs_a.shape[0] == len(TEXTS) == theirs_b.shape[0]
        torch.testing.assert_close(theirs_a.flatten(1), ours[:, a:b], atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(theirs_b.flatten(1), ours[:, b:e], atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("name,cls", KINDS[:3], ids=IDS[:3])
def test_published_adapter_gives_pefts_outputs(tmp_path, name, cls):
    """The exported folder loads with ``PeftModel.from_pretrained`` and its forward equals the
    classifier's with the LoRA in place."""
    from peft import PeftModel

    backbone = load_backbone(name, "cpu")
    clf = cls(backbone, LABELS)
    lora = _lora(clf)
    folder = save_peft_adapter(tmp_path / "peft", lora, backbone.model, backbone.kind, name)
    config = __import__("json").loads((folder / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_dropout"] == 0.0
    peft_model = PeftModel.from_pretrained(copy.deepcopy(backbone.model), str(folder))
    enc = clf.encode(TEXTS)
    T = int(enc["attention_mask"].sum(1).max())
    with torch.no_grad():
        theirs = peft_model(input_ids=enc["input_ids"][:, :T], attention_mask=enc["attention_mask"][:, :T]).logits
        rows = torch.arange(len(TEXTS))
        theirs = F.log_softmax(theirs[rows, enc["label_pos"]].float(), -1)[:, clf.label_token_ids]
        ours = clf(enc, lora)
        plain = clf(enc, None)
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-4)
    assert (ours - plain).abs().max() > 1e-3  # the adapter changes the outputs


def test_the_shared_backbone_is_untouched_and_other_threads_see_no_lora(clf):
    enc, lora = clf.encode(TEXTS), _lora(clf)
    before = clf(enc, None)
    state = {k: v.clone() for k, v in clf.backbone.model.state_dict().items()}
    seen = {}

    def other():
        seen["plain"] = clf(enc, None)

    with clf.prompting(lora, len(TEXTS)):
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert (clf(enc, lora) - before).abs().max() > 1e-4
    torch.testing.assert_close(seen["plain"], before)
    torch.testing.assert_close(clf(enc, None), before)
    assert all(torch.equal(v, state[k]) for k, v in clf.backbone.model.state_dict().items())


def test_dp_training_moves_every_adapter_tensor_and_spends_its_steps(clf):
    enc = clf.encode(TEXTS * 4)
    y = Y.repeat(4)
    config = PromptTrainingConfig(kind="lora", lora_r=2, lora_alpha=4, lr=0.01, steps=4, batch_size=8,
                                  max_length=32, physical_batch_size=8)
    sample, noise = seeded_dp_generators(0)
    result = train_prompt(clf, enc, y, config, DPConfig(noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=0.4),
                          sample_generator=sample, noise_generator=noise)
    assert result.steps == 4 and prompt_kind(result.prompt) == "lora"
    start = init_lora(result.prompt.layout, config.seed)
    moved = _per_tensor(result.prompt, (result.prompt.weight - start).unsqueeze(0))
    assert (moved > 0).all()  # every A and every B changed (opacus#820's LoRA twin: weights that never update)


def test_nonprivate_training_lowers_the_loss_from_the_frozen_model(clf):
    enc = clf.encode(TEXTS * 4)
    y = Y.repeat(4)
    config = PromptTrainingConfig(kind="lora", lora_r=4, lora_alpha=8, lr=0.02, steps=30, batch_size=20,
                                  max_length=32, physical_batch_size=20)
    result = train_prompt(clf, enc, y, config)
    with torch.no_grad():
        plain = F.cross_entropy(clf(enc, None), y)
        tuned = F.cross_entropy(clf(enc, result.prompt), y)
    assert tuned < plain - 0.05, (float(plain), float(tuned))


def test_lora_save_load_round_trip_and_another_backbone_refused(clf, tmp_path):
    lora = _lora(clf)
    path = save_prompt_artifact(tmp_path / "lora.safetensors", lora, {"method": "x"})
    loaded, meta = load_prompt_artifact(path)
    assert meta["kind"] == "lora" and prompt_kind(loaded) == "lora" and loaded.layout == lora.layout
    torch.testing.assert_close(loaded.weight, lora.weight)
    other = "tiny-llama" if clf.backbone.model.config.model_type != "llama" else "tiny-gpt2"
    with pytest.raises(ValueError, match="does not fit"):
        check_fits(load_backbone(other, "cpu").model, loaded)


class _Probe:
    """A stand-in classifier around one linear layer called batch-first, sequence-first, on pooled
    2-D inputs, or not at all; ``encode`` gives the probe's 2 rows of its positions."""

    def __init__(self, how: str, width: int = 16):
        from types import SimpleNamespace

        self.how = how
        self.model = torch.nn.Module()
        self.model.layer = torch.nn.Linear(width, width)
        self.model.unused = torch.nn.Linear(width, width)
        self.model.config = SimpleNamespace(model_type="probe")
        self.backbone = SimpleNamespace(model=self.model)
        self.width = width

    def encode(self, texts):
        T = len(texts[0].split())
        return {"attention_mask": torch.ones(len(texts), T, dtype=torch.long)}

    def __call__(self, enc, prompt):
        from models.prompts.lora import lora_hooks

        B, T = enc["attention_mask"].shape
        x = torch.randn(B, T, self.width)
        with lora_hooks(self.model, prompt, B):
            if self.how == "batch_first":
                return self.model.layer(x)
            if self.how == "sequence_first":
                return self.model.layer(x.transpose(0, 1))
            return self.model.layer(x.mean(1))


@pytest.mark.parametrize("how, error", [("batch_first", None), ("sequence_first", r"not \(rows, positions"),
                                        ("pooled", r"not \(rows, positions"), ("unused", "not called")])
def test_per_example_adapters_need_batch_first_layers_checked_on_a_public_probe(how, error):
    """A sequence-first layer whose positions equal the batch would give example t's adapter to position
    t of every example and mix their gradients: refused on a public probe (more positions than rows),
    as are a layer on 2-D inputs and a target the forward never calls."""
    from models.prompts.lora import check_batch_first

    clf = _Probe(how)
    layout = lora_layout(clf.model, 2, 4, ["unused"] if how == "unused" else ["layer"])
    if error is None:
        check_batch_first(clf, layout)
        return
    with pytest.raises(ValueError, match=error):
        check_batch_first(clf, layout)
    if how == "sequence_first":  # what the probe prevents: with positions = rows, gradients cross examples
        B = T = 3
        x = torch.randn(B, T, clf.width)
        p = init_lora(layout, 0).expand(B, -1).clone() + 0.1
        p.requires_grad_()
        from models.prompts.lora import lora_hooks

        with lora_hooks(clf.model, LoraPrompt(layout, p), B):
            out = clf.model.layer(x.transpose(0, 1)).transpose(0, 1)
        out[0].sum().backward()  # example 0's output alone
        assert (p.grad[1:].norm(dim=1) > 0).all()


def test_the_default_targets_pass_the_probe_and_a_head_layer_is_refused(clf):
    from models.prompts.lora import check_batch_first

    check_batch_first(clf, lora_layout(clf.backbone.model, 2, 4))
    if isinstance(clf, VerbalizerMaskedLM):  # the MLM head's transform sees the mask position alone (2-D)
        with pytest.raises(ValueError, match="dense"):
            check_batch_first(clf, lora_layout(clf.backbone.model, 2, 4, ["dense"]))
