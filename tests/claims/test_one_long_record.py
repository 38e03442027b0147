"""Review 8, H4: nothing compared ``models.max_length`` plus a soft prompt's or prefix's positions
with the model's, so with max_length at the model's limit one long private record (cut to
max_length) crashed the DP step that sampled it — a crash decided by one record — and a long text
prompt (dp_fewshot's demonstrations) made one long holdout row overflow the comparison's scoring.
Now such settings are refused before any budget, and a text prompt cuts every text to the room it
leaves."""

import pytest

from tasks.methods import get_method, registered_methods
from tests.methods.test_method_contract import parsed_config


@pytest.mark.parametrize("name", [m for m in registered_methods() if get_method(m).prompt_kind in ("soft", "prefix")])
def test_max_length_and_prompt_positions_beyond_the_model_are_refused_in_preflight(name, tmp_path_factory):
    from models.backbones import load_backbone
    from tasks.errors import ConfigError

    method = get_method(name)
    settings = method.traits.test_settings
    limit = load_backbone("tiny-gpt2", "cpu").max_positions
    cfg, _ = parsed_config(tmp_path_factory, name, settings, f"long-{name}")
    if not method.traits.reads_private or name == "post":  # POST checks its own (distilled) models below
        pytest.skip(f"{name}: no private row trains on models.local here")
    over = cfg.model_copy(update={"models": cfg.models.model_copy(update={"max_length": limit})})
    with pytest.raises(ConfigError, match=rf"models.max_length={limit} \+ \d+ prompt positions exceed the {limit} "
                                          r"positions of models.local='tiny-gpt2': lower models.max_length"):
        method.mechanism.preflight(over, None)
    method.mechanism.preflight(cfg, None)  # the contract's max_length fits


def test_a_long_text_prompt_cuts_texts_to_the_models_positions(tmp_path_factory):
    """The holdout scoring's input length under a long text prompt stays within the model's
    positions, so a long row is cut instead of crashing (it crashed at 276 of 256 positions)."""
    from models.prompts import TextPrompt
    from tasks.methodkit.classifiers import classifier_for, input_length, prompted

    cfg, _ = parsed_config(tmp_path_factory, "dp_fewshot", get_method("dp_fewshot").traits.test_settings,
                           "long-text")
    cfg = cfg.model_copy(update={"models": cfg.models.model_copy(update={"max_length": 96})})
    demos = "".join(f"Input: {'a fine film ' * 8}\nOutput: positive\n\n" for _ in range(6))
    clf, prompt = prompted(cfg, "tiny-gpt2", TextPrompt(demos))
    limit = clf.backbone.max_positions
    uncapped = 96 + clf.template_tokens - classifier_for(cfg, "tiny-gpt2").template_tokens
    assert uncapped > limit >= input_length(cfg, "tiny-gpt2", clf)
    batch = clf.encode(["word " * 2000], max_length=input_length(cfg, "tiny-gpt2", clf))
    assert batch["input_ids"].shape[1] <= limit
    assert clf(batch, prompt).shape[0] == 1  # scored, not "prompt + text is N positions"


def test_a_roberta_style_models_limit_leaves_out_the_positions_it_skips():
    """Review 8b, R2: RoBERTa numbers positions from pad_token_id + 1, so 66 position embeddings hold
    64 inputs; ``max_positions`` (the preflight's and the forward's limit) said 66, and a long record
    of 65 positions crashed in the embeddings."""
    from types import SimpleNamespace

    import torch
    from transformers import RobertaConfig, RobertaForMaskedLM

    from models.backbones import Backbone

    torch.manual_seed(0)
    model = RobertaForMaskedLM(RobertaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=37, max_position_embeddings=66, pad_token_id=1,
                                             type_vocab_size=1)).eval()
    limit = Backbone.max_positions.fget(SimpleNamespace(model=model))
    assert limit == 64
    with torch.no_grad():
        model(inputs_embeds=torch.randn(1, limit, 32), attention_mask=torch.ones(1, limit, dtype=torch.long))
        with pytest.raises((IndexError, RuntimeError)):
            model(inputs_embeds=torch.randn(1, limit + 1, 32), attention_mask=torch.ones(1, limit + 1, dtype=torch.long))


def test_a_selection_candidate_beyond_the_models_positions_is_refused_in_preflight(tmp_path):
    """Review 8b, R1: only the base settings were preflighted; a selection candidate with more
    prompt positions (n_tokens 80 with max_length 200 on 256 positions) trained, and one long
    training record failed its trial — a published failed-candidate count decided by one record."""
    from tasks.config import parse_config
    from tasks.errors import ConfigError
    from tasks.preflight import preflight
    from tests.methods.test_method_contract import SHARED

    if not (SHARED / "sst2").is_dir():
        pytest.skip("../shared/data is not available")
    cfg = {"method": "prompt_dpsgd", "experiment": "x", "seed": 0, "state_dir": str(tmp_path),
           "data": {"name": "sst2", "path": str(SHARED / "sst2"), "labels": ["negative", "positive"],
                    "train_fraction": 0.000594, "holdout_fraction": 0.0001485, "test_fraction": 0.011},
           "models": {"local": "tiny-gpt2", "max_length": 200}, "methods": {"prompt_dpsgd": {"n_tokens": 10}},
           "selection": {"enabled": True, "candidates": [{"n_tokens": 10}, {"n_tokens": 80}]},
           "mia": {"enabled": False}}
    with pytest.raises(ConfigError, match=r"selection candidate '.*80.*': models.max_length=200 \+ 80 prompt positions"):
        preflight(parse_config(cfg), None)
    cfg["selection"]["candidates"] = [{"n_tokens": 10}, {"n_tokens": 40}]
    preflight(parse_config(cfg), None)


def test_a_backbone_with_int8_outlier_columns_is_refused_in_preflight(tmp_path_factory, monkeypatch):
    """Review 9c: a checkpoint saved in 8-bit keeps LLM.int8's outlier threshold whatever placement
    asks; its outlier columns are chosen over a whole batch, so in a DP-SGD batch one record would
    move the other records' gradients (far above float rounding). Such a backbone is refused before
    any budget, in one line; 4-bit or unquantised weights run."""
    import models.row_own
    from tasks.errors import ConfigError

    method = get_method("prompt_dpsgd")
    cfg, _ = parsed_config(tmp_path_factory, "prompt_dpsgd", method.traits.test_settings, "int8")
    method.mechanism.preflight(cfg, None)
    monkeypatch.setattr(models.row_own, "int8_outliers", lambda model: True)
    with pytest.raises(ConfigError, match=r"models.local='tiny-gpt2' runs 8-bit weights with LLM.int8's outlier "
                                          r"columns .* models.placement.quantization: 4bit"):
        method.mechanism.preflight(cfg, None)


def test_nested_expert_counts_are_found():
    """Review 9c, F2: DBRX keeps its expert count in ``ffn_config``: found, so it never batches rows."""
    from transformers import DbrxConfig, LlamaConfig

    from models.row_own import expert_count

    assert expert_count(DbrxConfig()) == 4 and expert_count(LlamaConfig()) is None
