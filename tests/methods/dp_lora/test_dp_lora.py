"""dp_lora through the flow on a tiny model: the PEFT LoRA adapter it publishes loads with PEFT and
gives the run's outputs, the registered model predicts with it and carries its ε, unit and δ, and
``retarget`` refuses it in one line. (The LoRA kind itself: tests/pipeline/test_lora_prompt.py.)"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from tests.pipeline.test_flow import _config, _mlflow, _toy_dataset

LABELS = ["negative", "positive"]
TEXTS = ["a great movie", "terrible and boring", "the story was moving"]


@pytest.fixture(scope="module")
def lora_run(prefect_harness, sst2_dir, tmp_path_factory):
    from flows.method_flow import method_flow

    root = tmp_path_factory.mktemp("dp_lora")
    data = _toy_dataset(root / "data", sst2_dir)
    state = root / "state"
    cfg = _config(data, state, method="dp_lora")
    cfg["methods"] = {"zero_shot": {"enabled": True}, "lora_sgd": {"enabled": True, "r": 2, "epochs": 1},
                      "dp_lora": {"r": 2, "alpha": 4, "lr": 0.01, "epochs": 1, "batch_size": 32}}
    summary = method_flow(cfg)
    return {"summary": summary, "state": state}


def test_the_published_adapter_is_a_peft_lora_that_gives_the_runs_outputs(lora_run, capsys):
    from peft import PeftModel

    from models import build_classifier, load_backbone
    from models.prompts import load_prompt_artifact
    from privprompt_commands.run import _print_prompt

    state = lora_run["state"]
    (folder,) = list((state / "outputs").rglob("dp_lora_peft"))
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 2 and sorted(config["target_modules"]) == ["query", "value"]
    assert (folder / "adapter_model.safetensors").is_file()
    (prompt_path,) = list((state / "outputs").rglob("dp_lora.safetensors"))
    lora, meta = load_prompt_artifact(prompt_path)
    assert meta["kind"] == "lora"
    _print_prompt({"prompt_path": str(prompt_path), "prompt_published": True})  # the run summary's line
    assert capsys.readouterr().out.startswith(f"{'published adapter (LoRA):':<28}{prompt_path}")
    backbone = load_backbone("tiny-bert", "cpu")
    clf = build_classifier(backbone, LABELS)
    peft_model = PeftModel.from_pretrained(copy.deepcopy(backbone.model), str(folder))
    enc = clf.encode(TEXTS, max_length=32)
    T = int(enc["attention_mask"].sum(1).max())
    with torch.no_grad():
        logits = peft_model(input_ids=enc["input_ids"][:, :T], attention_mask=enc["attention_mask"][:, :T]).logits
        theirs = torch.log_softmax(logits[torch.arange(len(TEXTS)), enc["label_pos"]].float(), -1)[:, clf.label_token_ids]
        torch.testing.assert_close(theirs, clf(enc, lora), atol=1e-5, rtol=1e-4)
    # the non-private ceiling stays private: no adapter of it leaves private/
    assert not [p for p in (state / "outputs").rglob("lora_sgd*") if p.suffix != ".png"]  # its MIA figure only


def test_the_registered_model_predicts_with_the_adapter_and_states_its_guarantee(lora_run):
    import mlflow.pyfunc
    import pandas as pd

    from tasks.registry_model import download_model

    client = _mlflow(lora_run["state"])
    (version,) = client.search_model_versions("name='privprompt.toy-sst2.dp_lora'")
    assert version.tags["privacy.guarantee"] == "dp" and version.tags["privacy.unit"] == "record"
    assert float(version.tags["privacy.epsilon"]) <= 4.0 and float(version.tags["privacy.delta"]) > 0
    run = client.get_run(version.run_id)
    assert any(a.path == "peft" for a in client.list_artifacts(
        [c for c in client.search_runs([run.info.experiment_id]) if c.data.tags.get("peft.adapter")][0].info.run_id))
    local = download_model(client, "models:/privprompt.toy-sst2.dp_lora/1", lora_run["state"] / "dl")
    out = mlflow.pyfunc.load_model(str(local)).predict(pd.DataFrame({"text": TEXTS}))
    assert list(out.columns) == ["label", "score.negative", "score.positive"] and len(out) == len(TEXTS)
    trained = [c for c in client.search_runs([run.info.experiment_id]) if c.data.tags.get("peft.adapter")]
    assert trained[0].data.tags["peft.adapter"] == "peft/ (LoRA)"
    assert trained[0].data.metrics["train.trainable_parameters"] > 0


def test_retarget_refuses_a_lora_in_one_line(lora_run, capsys):
    from privprompt_cli import main

    capsys.readouterr()
    rc = main(["--state-dir", str(lora_run["state"]), "retarget", "models:/privprompt.toy-sst2.dp_lora/1",
               "--target", "tiny-gpt2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "LoRA adapter is not retargeted" in err[0]


@pytest.mark.parametrize("change, error", [
    ({"models": {"target": "tiny-gpt2"}}, "models.target"),
    ({"models": {"evaluate_on": ["tiny-gpt2"]}}, "models.evaluate_on"),
    ({"methods": {"dp_lora": {"target_modules": ["dense"]}}}, "not \\(rows, positions"),
])
def test_a_lora_that_cannot_be_trained_per_example_or_used_is_refused_at_preflight(sst2_dir, tmp_path, change, error):
    """Before any private row: a LoRA used on another model than the one it is trained on, or on a
    layer the masked LM calls with 2-D inputs (the head's transform), is one ConfigError line."""
    from tasks.config import parse_config
    from tasks.errors import ConfigError
    from tasks.methods import get_method

    cfg = _config(_toy_dataset(tmp_path / "data", sst2_dir), tmp_path / "state", method="dp_lora")
    for key, value in change.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    parsed = parse_config(cfg)
    with pytest.raises(ConfigError, match=error) as exc:
        get_method("dp_lora").mechanism.preflight(parsed, None)
    assert "\n" not in str(exc.value)
