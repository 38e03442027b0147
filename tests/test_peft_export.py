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
