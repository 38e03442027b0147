"""Model placement (issue 39): dtype, device_map and 8-/4-bit backbones through Transformers,
parsed from the config, refused in one line where they cannot apply (this CPU machine), and the
prompt's per-sample gradients float32 whatever the backbone's dtype."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest
import torch

from models import device as device_mod
from models.backbones import ModelLoadError, load_backbone
from models.classifiers import build_classifier
from models.dp_prompt_training import per_sample_prompt_gradients
from models.placement import Placement, PlacementError, check_placement, from_pretrained_kwargs
from tasks.config import load_config
from tasks.preflight import check_placements

REPO = Path(__file__).resolve().parents[2]


def test_placement_values_and_aliases():
    assert Placement(dtype="bf16").dtype == "bfloat16" and Placement(dtype="fp16").torch_dtype() is torch.float16
    assert Placement().is_default and not Placement().spread and Placement(quantization="4bit").spread
    for bad in ({"dtype": "fp8"}, {"device_map": "everywhere"}, {"quantization": "2bit"}):
        with pytest.raises(PlacementError, match="is none of"):
            Placement(**bad)


def test_from_pretrained_kwargs_go_through_transformers():
    cuda0 = torch.device("cuda", 0)
    assert from_pretrained_kwargs(Placement(), cuda0) == {}  # Transformers' default, unchanged
    assert from_pretrained_kwargs(Placement(dtype="bf16"), cuda0) == {"dtype": torch.bfloat16}
    assert from_pretrained_kwargs(Placement(device_map="auto"), cuda0) == {"device_map": "auto"}
    kw = from_pretrained_kwargs(Placement(quantization="4bit"), cuda0)
    q = kw["quantization_config"]
    assert q.load_in_4bit and q.bnb_4bit_quant_type == "nf4" and q.bnb_4bit_use_double_quant
    assert q.bnb_4bit_compute_dtype == torch.bfloat16 and kw["dtype"] == torch.bfloat16
    assert kw["device_map"] == {"": 0}  # quantised weights load onto the device, never moved after
    kw = from_pretrained_kwargs(Placement(quantization="8bit", device_map="balanced"), cuda0)
    assert kw["quantization_config"].load_in_8bit and kw["device_map"] == "balanced"
    # no outlier columns: they are chosen over the whole batch, coupling a DP batch's rows (review 9b, G2)
    assert kw["quantization_config"].llm_int8_threshold == 0.0


@pytest.mark.parametrize("placement, says", [
    (Placement(quantization="4bit"), "4bit weights (bitsandbytes) need a CUDA GPU"),
    (Placement(quantization="8bit"), "8bit weights (bitsandbytes) need a CUDA GPU"),
    (Placement(device_map="auto"), "device_map 'auto' spreads a model over GPUs"),
])
def test_cuda_only_placements_are_refused_in_one_line_on_cpu(placement, says):
    with pytest.raises(PlacementError, match=re.escape(says)):
        check_placement(placement, "cpu")
    with pytest.raises(ModelLoadError) as e:
        load_backbone("some-org/some-model", device="cpu", placement=placement)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_without_bitsandbytes_4bit_is_refused_on_cuda_too(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "bitsandbytes" else real(n, *a))
    with pytest.raises(PlacementError, match="need the bitsandbytes package"):
        check_placement(Placement(quantization="4bit"), "cuda:0")


def test_builtin_models_take_a_dtype_only(monkeypatch):
    bb = load_backbone("tiny-llama", device="cpu", placement=Placement(dtype="bfloat16"))
    assert bb.model.dtype == torch.bfloat16
    assert load_backbone("tiny-llama", device="cpu").model.dtype == torch.float32  # its own cache entry
    import models.backbones as mb

    monkeypatch.setattr(mb, "check_placement", lambda *a: None)  # as on a GPU machine
    with pytest.raises(ModelLoadError, match="not to PrivPrompt's built-in ones; give it a dtype only"):
        load_backbone("tiny-bert", device="cpu", placement=Placement(device_map="auto"))


def test_a_local_folder_loads_in_bf16_and_the_prompt_gradients_stay_float32(tmp_path):
    tiny = load_backbone("tiny-llama", device="cpu")
    folder = tmp_path / "tiny-llama"
    tiny.model.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    bb = load_backbone(str(folder), device="cpu", placement=Placement(dtype="bf16"))
    assert bb.model.dtype == torch.bfloat16 and bb.device == torch.device("cpu")
    clf = build_classifier(bb, ["negative", "positive"])
    enc = clf.encode(["a fine film", "a dull one", "not bad"], max_length=16)
    prompt = torch.randn(3, bb.embed_dim) * 0.01
    grads = per_sample_prompt_gradients(clf, enc, torch.tensor([1, 0, 1]), prompt)
    assert grads.dtype == torch.float32 and grads.shape == (3, 3, bb.embed_dim)
    assert torch.isfinite(grads).all() and grads.flatten(1).norm(dim=1).min() > 0


def test_config_parses_placements_and_a_cuda_only_one_is_refused_before_any_model(monkeypatch):
    cfg = load_config(REPO / "configs" / "smoke.yaml", [
        "models.placement.dtype=bf16", "models.placement_for={big/model: {device_map: auto, quantization: 4bit}}"])
    assert cfg.models.placement_of(cfg.models.local) == Placement(dtype="bfloat16")
    assert cfg.models.placement_of("big/model") == Placement(device_map="auto", quantization="4bit")
    monkeypatch.setattr(device_mod, "default_device", lambda: torch.device("cpu"))
    with pytest.raises(ModelLoadError, match=r"models.placement_for\['big/model'\]: 4bit weights"):
        check_placements(cfg)


def test_prompt_classifier_forwards_leave_out_cudnn_attention(monkeypatch):
    import models.classifiers as mc

    seen = []
    monkeypatch.setattr(mc, "attention_backends", lambda dev: seen.append(torch.device(dev)) or contextlib.nullcontext())
    clf = build_classifier(load_backbone("tiny-bert", device="cpu"), ["negative", "positive"])
    clf(clf.encode(["good", "bad"], max_length=16))
    assert seen == [torch.device("cpu")]
    monkeypatch.setenv("PRIVPROMPT_CUDNN_ATTENTION", "1")  # the benchmarks' switch: torch's own choice
    assert isinstance(device_mod.attention_backends("cuda"), contextlib.nullcontext)
