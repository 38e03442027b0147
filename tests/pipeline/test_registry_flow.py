"""After a small dp run: its output is a registered model version with the privacy tags and a PEFT
adapter in the run's artifacts; ``privprompt predict`` on test rows gives the labels the run's own
evaluation gives; the non-private baseline is never registered; ``mlflow models serve`` answers
with the same labels (slow)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from tests.pipeline.test_flow import _config, _mlflow, _toy_dataset

REPO = Path(__file__).resolve().parents[2]
MODEL = "privprompt.toy-sst2.prompt_dpsgd"


@pytest.fixture(scope="module")
def dp_run(prefect_harness, sst2_dir, tmp_path_factory):
    from flows.method_flow import method_flow

    root = tmp_path_factory.mktemp("registry")
    data = _toy_dataset(root / "data", sst2_dir)
    state = root / "state"
    cfg = _config(data, state, **{"methods.zero_shot.enabled": False, "mia.enabled": False})
    summary = method_flow(cfg)
    rows = [json.loads(line) for line in (data / "test.jsonl").read_text().splitlines()]
    return {"summary": summary, "state": state, "data": data, "root": root, "config": cfg, "test_rows": rows}


def _own_labels(dp_run, texts: list[str]) -> list[str]:
    """The run's own evaluation code path (tasks.stages.evaluate_stage) on ``texts``."""
    from models.scoring import predict_logits
    from tasks.config import parse_config
    from tasks.prompts import load_prompt_file
    from tasks.methodkit.classifiers import input_length, prompted

    cfg = parse_config(dp_run["config"])
    prompt = load_prompt_file(dp_run["summary"]["published"]["prompt_path"])
    clf, forward_prompt = prompted(cfg, cfg.models.target_name, prompt)
    enc = clf.encode(texts, max_length=input_length(cfg, cfg.models.target_name, clf))
    logits = predict_logits(clf, enc, forward_prompt, batch_size=cfg.models.eval_batch_size)
    return [cfg.data.labels[i] for i in logits.argmax(1).tolist()]


@pytest.mark.slow  # suite time: runs with -m slow
def test_the_dp_output_is_a_registered_version_with_its_guarantee(dp_run):
    client = _mlflow(dp_run["state"])
    parent = client.get_run(dp_run["summary"]["mlflow_run_id"])
    versions = client.search_model_versions(f"name='{MODEL}'")
    assert len(versions) == 1
    version = versions[0]
    assert version.run_id == parent.info.run_id
    metrics = parent.data.metrics
    assert float(version.tags["privacy.epsilon"]) == pytest.approx(metrics["privacy.epsilon"])
    assert float(version.tags["privacy.delta"]) == pytest.approx(metrics["privacy.delta"])
    assert version.tags["privacy.guarantee"] == "dp" and version.tags["privacy.unit"] == "record"
    assert version.tags["privacy.accountant"] == "min(pld, rdp) + basic composition (0.1 δ)"  # the sizes release apart
    assert version.tags["dataset.fingerprint"] == parent.data.tags["dataset.fingerprint"]
    # the non-private baseline (prompt_sgd, guarantee none) is never registered, and no version's
    # source lies under private/
    assert {m.name for m in client.search_registered_models()} == {MODEL}
    assert "private" not in version.source
    spec = json.loads(Path(client.download_artifacts(parent.info.run_id, "registered_model/artifacts/spec.json"))
                      .read_text())
    assert set(spec) == {"method", "backbone", "model", "labels", "label_descriptions", "template", "max_length", "seed"}
    assert spec["backbone"]["name"] == "tiny-bert" and spec["labels"] == ["negative", "positive"]


@pytest.mark.slow  # suite time: runs with -m slow
def test_the_training_run_carries_a_peft_adapter_that_scores_like_the_run(dp_run):
    client = _mlflow(dp_run["state"])
    parent = dp_run["summary"]["mlflow_run_id"]
    child = [r for r in client.search_runs([client.get_run(parent).info.experiment_id],
                                           f"tags.mlflow.parentRunId = '{parent}' and tags.stage = 'train'")
             if r.data.tags["method"] == "prompt_dpsgd"][0]
    assert child.data.tags["peft.adapter"] == "peft/ (prompt tuning)"
    assert child.data.tags["registry.model"] == f"models:/{MODEL}/1"
    folder = Path(client.download_artifacts(child.info.run_id, "peft"))
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    # tiny-bert is a masked LM: PEFT's forward, read at the mask, gives the run's label scores
    assert_peft_scores_like_ours("tiny-bert", dp_run, folder, prompt_positions=True)


@pytest.mark.slow  # suite time: runs with -m slow
def test_predict_gives_the_runs_own_labels(dp_run, tmp_path, capsys):
    from privprompt_cli import main

    rows = dp_run["test_rows"][:20]
    src, dst = tmp_path / "rows.jsonl", tmp_path / "pred.csv"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    rc = main(["--state-dir", str(dp_run["state"]), "predict", f"models:/{MODEL}/latest", "--input", str(src),
               "--output", str(dst), "--batch-size", "8"])
    assert rc == 0
    out = pd.read_csv(dst)
    own = _own_labels(dp_run, [r["text"] for r in rows])
    assert out["prediction"].tolist() == own
    acc = sum(o == r["label"] for o, r in zip(own, rows)) / len(rows)
    assert f"accuracy on the 20 rows' label column: {acc:.4f}" in capsys.readouterr().err


@pytest.mark.slow  # suite time: runs with -m slow
def test_predict_on_the_whole_test_split_matches_the_runs_test_accuracy(dp_run, tmp_path, capsys):
    from privprompt_cli import main

    client = _mlflow(dp_run["state"])
    metrics = client.get_run(dp_run["summary"]["mlflow_run_id"]).data.metrics
    rows = dp_run["test_rows"]
    if metrics.get("data.n_test", len(rows)) != len(rows):
        pytest.skip("the test split is not the whole test file")
    src = tmp_path / "test.parquet"
    pd.DataFrame(rows).to_parquet(src, index=False)
    capsys.readouterr()
    assert main(["--state-dir", str(dp_run["state"]), "predict", f"models:/{MODEL}/1", "--input", str(src),
                 "--output", str(tmp_path / "out.jsonl")]) == 0
    out = pd.read_json(tmp_path / "out.jsonl", lines=True)
    acc = float((out["prediction"] == out["label"]).mean())
    assert acc == pytest.approx(metrics["test.accuracy"], abs=1e-6)  # the metric is a float32 mean


@pytest.fixture(scope="module")
def prefix_run(prefect_harness, sst2_dir, tmp_path_factory):
    from flows.method_flow import method_flow

    root = tmp_path_factory.mktemp("registry-prefix")
    data = _toy_dataset(root / "data", sst2_dir, n_train=160, n_test=40)
    state = root / "state"
    cfg = _config(data, state, method="prefix_dpsgd", **{
        "models.local": "tiny-gpt2", "methods.zero_shot.enabled": False, "methods.prompt_sgd.enabled": False,
        "mia.enabled": False,
        "methods.prefix_dpsgd": {"n_tokens": 3, "epochs": 1, "batch_size": 32, "flatness_examples": 0}})
    summary = method_flow(cfg)
    rows = [json.loads(line) for line in (data / "test.jsonl").read_text().splitlines()]
    return {"summary": summary, "state": state, "config": cfg, "test_rows": rows}


@pytest.mark.slow  # suite time: runs with -m slow
def test_a_dp_prefix_is_a_peft_prefix_adapter_and_predicts_the_runs_labels(prefix_run, tmp_path, capsys):
    from privprompt_cli import main

    client = _mlflow(prefix_run["state"])
    parent = client.get_run(prefix_run["summary"]["mlflow_run_id"])
    (child,) = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}' "
                                  "and tags.stage = 'train' and tags.method = 'prefix_dpsgd'")
    assert child.data.tags["peft.adapter"] == "peft/ (prefix tuning)"
    (version,) = client.search_model_versions("name='privprompt.toy-sst2.prefix_dpsgd'")
    assert version.run_id == parent.info.run_id and version.tags["privacy.guarantee"] == "dp"
    assert float(version.tags["privacy.epsilon"]) == pytest.approx(parent.data.metrics["privacy.epsilon"])
    folder = Path(client.download_artifacts(child.info.run_id, "peft"))
    assert json.loads((folder / "adapter_config.json").read_text())["peft_type"] == "PREFIX_TUNING"
    # PEFT's forward on the adapter gives the run's scores
    assert_peft_scores_like_ours("tiny-gpt2", prefix_run, folder, prompt_positions=False)
    # and predict gives the run's own labels on 20 test rows
    rows = prefix_run["test_rows"][:20]
    src, dst = tmp_path / "rows.csv", tmp_path / "out.jsonl"
    pd.DataFrame(rows).to_csv(src, index=False)
    assert main(["--state-dir", str(prefix_run["state"]), "predict", "models:/privprompt.toy-sst2.prefix_dpsgd/latest",
                 "--input", str(src), "--output", str(dst)]) == 0
    out = pd.read_json(dst, lines=True)
    assert out["prediction"].tolist() == _own_labels(prefix_run, [r["text"] for r in rows])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served_answer(mlflow_db: Path, model_uri: str, body: dict, log_path: Path, wait_s: float = 240) -> dict | None:
    """``mlflow models serve -m MODEL_URI`` from this environment (its Python, its uvicorn) on a free
    localhost port, asked ``body`` at /invocations until it answers; the answer (None: it never did)."""
    import urllib.request

    port = _free_port()
    uri = f"sqlite:///{mlflow_db}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "MLFLOW_REGISTRY_URI": uri,
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           # as in an activated virtualenv: the server runs the environment's own uvicorn
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    data = json.dumps(body).encode()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", model_uri,
                                 "--env-manager", "local", "--host", "127.0.0.1", "--port", str(port)],
                                env=env, cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.time() + wait_s
            while time.time() < deadline and proc.poll() is None:
                try:
                    req = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data,
                                                 {"Content-Type": "application/json"})
                    with urllib.request.urlopen(req, timeout=60) as resp:
                        return json.loads(resp.read())
                except OSError:
                    time.sleep(2)
            return None
        finally:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=60)


@pytest.mark.slow
def test_mlflow_models_serve_answers_with_the_same_labels(dp_run, tmp_path):
    rows = dp_run["test_rows"][:20]
    answer = served_answer(dp_run["state"] / "mlflow.db", f"models:/{MODEL}/1",
                           {"dataframe_split": {"columns": ["text"], "data": [[r["text"]] for r in rows]}},
                           tmp_path / "serve.log")
    assert answer is not None, (tmp_path / "serve.log").read_text()[-2000:]
    served = [p["label"] for p in answer["predictions"]]
    assert served == _own_labels(dp_run, [r["text"] for r in rows])


def assert_peft_scores_like_ours(backbone_name: str, run: dict, folder: Path, prompt_positions: bool) -> None:
    """PEFT's forward on the exported adapter gives the run's label scores on 8 test rows.
    ``prompt_positions``: prompt tuning puts its virtual tokens in front of PEFT's outputs (the
    label position moves by their number); a prefix adds none."""
    import copy

    import torch.nn.functional as F
    from peft import PeftModel

    from models import build_classifier, load_backbone
    from models.prompts import load_prompt_artifact

    backbone = load_backbone(backbone_name, seed=0)
    clf = build_classifier(backbone, ["negative", "positive"])
    prompt, _ = load_prompt_artifact(run["summary"]["published"]["prompt_path"])
    texts = [r["text"] for r in run["test_rows"][:8]]
    enc = clf.encode(texts, max_length=32)
    T = int(enc["attention_mask"].sum(1).max())
    peft_model = PeftModel.from_pretrained(copy.deepcopy(backbone.model), str(folder)).eval()
    with torch.no_grad():
        ours = clf(enc, prompt).cpu()
        out = peft_model(input_ids=enc["input_ids"][:, :T].to(backbone.device),
                         attention_mask=enc["attention_mask"][:, :T].to(backbone.device)).logits
    position = enc["label_pos"] + (prompt.shape[0] if prompt_positions else 0)
    theirs = F.log_softmax(out[torch.arange(len(texts)), position].float(), -1)[:, clf.label_token_ids]
    torch.testing.assert_close(theirs.cpu(), ours, atol=2e-5, rtol=1e-4)
