"""Registered models: the pyfunc predicts what PrivPrompt's own forward predicts, versions carry
the privacy tags and point at their run, nothing without a guarantee and nothing under private/
is ever registered, and ``privprompt predict`` names a backbone it cannot find in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

LABELS = ["negative", "positive"]
TEXTS = ["a great movie", "terrible , boring and far too long , i walked out", "ok",
         "the acting was wonderful and the story moving", "bad"]
SPEND = {"epsilon": 3.5, "delta": 1e-5, "accountant": "min(pld, rdp)"}


@pytest.fixture()
def state(tmp_path, monkeypatch):
    from tasks.record import client, ensure_experiment
    from tasks.state import state_paths

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    paths = state_paths(tmp_path / "state")
    paths.create()
    mlflow = client(paths)
    exp = ensure_experiment(mlflow, "tests", paths)
    run = mlflow.create_run(exp, run_name="parent")
    outputs = paths.root / "outputs" / "flow"
    outputs.mkdir(parents=True)
    return {"paths": paths, "client": mlflow, "run_id": run.info.run_id, "outputs": outputs}


def _spec(backbone: dict, template=None) -> dict:
    return {"method": "prompt_dpsgd", "backbone": backbone, "model": backbone["name"], "labels": LABELS,
            "label_descriptions": {}, "template": template, "max_length": 32, "seed": 0}


def _soft_prompt(path: Path, width: int) -> Path:
    from models.prompts import save_prompt_artifact

    g = torch.Generator().manual_seed(1)
    return save_prompt_artifact(path, torch.randn(3, width, generator=g), {"privacy.guarantee": "dp"})


def test_pyfunc_version_predicts_privprompts_labels_and_carries_the_tags(state):
    import mlflow.pyfunc

    from models import build_classifier, load_backbone
    from models.backbone_ref import backbone_reference
    from models.prompts import load_prompt_artifact
    from tasks.registry_model import download_model, register_output

    backbone = load_backbone("tiny-gpt2", "cpu")
    prompt_path = _soft_prompt(state["outputs"] / "prompt_dpsgd.safetensors", backbone.embed_dim)
    version = register_output(state["client"], state["run_id"], "privprompt.toy.prompt_dpsgd",
                              _spec(backbone_reference("tiny-gpt2", 0)), prompt_path, "dp", SPEND, "fp123",
                              state["paths"].private)
    assert str(version.version) == "1" and version.run_id == state["run_id"]
    # a retry republishing the same run's output gets the same version, not a second one
    again = register_output(state["client"], state["run_id"], "privprompt.toy.prompt_dpsgd",
                            _spec(backbone_reference("tiny-gpt2", 0)), prompt_path, "dp", SPEND, "fp123",
                            state["paths"].private)
    assert str(again.version) == "1"
    assert len(state["client"].search_model_versions("name='privprompt.toy.prompt_dpsgd'")) == 1
    got = state["client"].get_model_version("privprompt.toy.prompt_dpsgd", "1")
    assert got.tags == {"privacy.epsilon": "3.5", "privacy.delta": "1e-05", "privacy.guarantee": "dp",
                        "privacy.accountant": "min(pld, rdp)", "privacy.unit": "record", "dataset.fingerprint": "fp123"}
    # the model's artifacts: the pyfunc, the spec and the prompt, nothing else
    names = {a.path for a in state["client"].list_artifacts(state["run_id"], "registered_model/artifacts")}
    assert names == {"registered_model/artifacts/spec.json", "registered_model/artifacts/prompt_dpsgd.safetensors"}

    # fetched with the state's own client (no process-wide MLflow URI is set: later tests keep theirs)
    local = download_model(state["client"], "models:/privprompt.toy.prompt_dpsgd/latest", state["paths"].root / "dl")
    assert (local / "MLmodel").is_file()
    model = mlflow.pyfunc.load_model(str(local))
    out = model.predict(pd.DataFrame({"text": TEXTS}))
    clf = build_classifier(backbone, LABELS)
    prompt, _ = load_prompt_artifact(prompt_path)
    with torch.no_grad():
        ours = clf(clf.encode(TEXTS, max_length=32), prompt)
    assert out["label"].tolist() == [LABELS[i] for i in ours.argmax(1).tolist()]
    torch.testing.assert_close(torch.tensor(out[[f"score.{l}" for l in LABELS]].to_numpy()),
                               ours.double().softmax(1), atol=1e-5, rtol=1e-4)


def test_text_prompt_predicts_with_the_instruction_in_the_template(state):
    import mlflow.pyfunc

    from models import build_classifier, load_backbone
    from models.backbone_ref import backbone_reference
    from models.prompts import save_prompt_artifact
    from models.prompts.text import TextPrompt
    from tasks.registry_model import Predictor

    backbone = load_backbone("tiny-gpt2", "cpu")
    prompt = TextPrompt("Classify the sentiment of the review.")
    path = save_prompt_artifact(state["outputs"] / "dp_opt.json", prompt)
    predictor = Predictor.build(_spec(backbone_reference("tiny-gpt2", 0)), path, "cpu")
    assert predictor.prompt is None and predictor.classifier.template.startswith("Instruction: Classify")
    base = build_classifier(backbone, LABELS)
    clf = build_classifier(backbone, LABELS, None, prompt.template(base.template))
    max_length = 32 + clf.template_tokens - base.template_tokens
    with torch.no_grad():
        expected = clf(clf.encode(TEXTS, max_length=max_length)).argmax(1).tolist()
    assert predictor.predict(TEXTS)["label"].tolist() == [LABELS[i] for i in expected]


def test_nothing_without_a_guarantee_and_nothing_private_is_registered(state):
    from models.backbone_ref import backbone_reference
    from tasks.registry_model import RegistrationRefused, register_output

    private = state["paths"].private / "runs" / "flow"
    private.mkdir(parents=True)
    inside = _soft_prompt(private / "prompt_sgd.safetensors", 32)
    outside = _soft_prompt(state["outputs"] / "prompt_sgd.safetensors", 32)
    spec = _spec(backbone_reference("tiny-gpt2", 0))
    for guarantee, path in (("none", outside), ("dp", inside), ("ldp", inside), ("none", inside)):
        with pytest.raises(RegistrationRefused):
            register_output(state["client"], state["run_id"], "privprompt.toy.x", spec, path, guarantee, SPEND,
                            "fp", state["paths"].private)
    # a backbone kept under private/ (a model trained on private data) is never named by the registry
    model_dir = state["paths"].private / "models" / "fine-tuned"
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text("{}")
    private_backbone = {**spec, "backbone": {"name": str(model_dir), "path": str(model_dir), "sha256": "0" * 64}}
    with pytest.raises(RegistrationRefused, match="the backbone .* is under the state folder's private/"):
        register_output(state["client"], state["run_id"], "privprompt.toy.x", private_backbone, outside, "dp", SPEND,
                        "fp", state["paths"].private)
    assert state["client"].search_registered_models() == []
    assert state["client"].list_artifacts(state["run_id"]) == []


def test_predict_names_a_backbone_it_cannot_find_in_one_line(state, tmp_path, capsys):
    from privprompt_cli import main
    from tasks.registry_model import register_output

    prompt_path = _soft_prompt(state["outputs"] / "p.safetensors", 32)
    gone = str(tmp_path / "models" / "my-private-llm")
    register_output(state["client"], state["run_id"], "privprompt.toy.gone",
                    _spec({"name": gone, "path": gone, "sha256": "0" * 64}), prompt_path, "dp", SPEND, "fp",
                    state["paths"].private)
    data = tmp_path / "in.csv"
    pd.DataFrame({"text": TEXTS}).to_csv(data, index=False)
    capsys.readouterr()
    rc = main(["--state-dir", str(state["paths"].root), "predict", "models:/privprompt.toy.gone/1", "--input", str(data)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0] == f"privprompt: error: cannot load backbone {gone!r}: its folder {gone} is not on this machine"
    # a model the registry does not hold: one line naming it
    rc = main(["--state-dir", str(state["paths"].root), "predict", "models:/privprompt.toy.none/latest",
               "--input", str(data)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "privprompt.toy.none" in err[0] and err[0].startswith("privprompt: error: ")


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_predict_reads_and_writes_every_format(state, tmp_path, capsys, suffix):
    from models.backbone_ref import backbone_reference
    from privprompt_cli import main
    from tasks.registry_model import register_output

    prompt_path = _soft_prompt(state["outputs"] / "p.safetensors", 32)
    register_output(state["client"], state["run_id"], "privprompt.toy.fmt", _spec(backbone_reference("tiny-gpt2", 0)),
                    prompt_path, "dp", SPEND, "fp", state["paths"].private)
    frame = pd.DataFrame({"text": TEXTS, "label": ["positive", "negative", "positive", "positive", "negative"]})
    src, dst = tmp_path / f"in{suffix}", tmp_path / f"out{suffix}"
    {".jsonl": lambda: frame.to_json(src, orient="records", lines=True), ".csv": lambda: frame.to_csv(src, index=False),
     ".parquet": lambda: frame.to_parquet(src, index=False)}[suffix]()
    rc = main(["--state-dir", str(state["paths"].root), "predict", "models:/privprompt.toy.fmt/latest",
               "--input", str(src), "--output", str(dst), "--batch-size", "2", "--device", "cpu"])
    assert rc == 0
    out = {".jsonl": lambda: pd.read_json(dst, lines=True), ".csv": lambda: pd.read_csv(dst),
           ".parquet": lambda: pd.read_parquet(dst)}[suffix]()
    assert out["text"].tolist() == TEXTS and set(out["prediction"]) <= set(LABELS)
    assert ((out["score.negative"] + out["score.positive"]) - 1).abs().max() < 1e-6
    err = capsys.readouterr().err
    assert "predict: 5/5 texts" in err
    acc = float((out["prediction"] == frame["label"]).mean())
    assert f"accuracy on the 5 rows' label column: {acc:.4f}" in err


def test_input_texts_reads_the_field_it_is_told():
    from privprompt_cli import build_parser
    from tasks.registry_model import input_texts

    frame = pd.DataFrame({"review": TEXTS, "customer_id": list("abcde")})
    assert input_texts(frame, "review") == TEXTS
    with pytest.raises(ValueError, match=r"needs a 'text' column \(--text-field NAME names another\)"):
        input_texts(frame)
    args = build_parser().parse_args(["predict", "models:/m/1", "--input", "x.csv", "--text-field", "review",
                                      "--label-field", "sentiment"])
    assert (args.text_field, args.label_field) == ("review", "sentiment")
    assert build_parser().parse_args(["predict", "models:/m/1", "--input", "x.csv"]).text_field == "text"


@pytest.mark.slow  # a registered model and a prediction (≈ 25 s); the option's parsing and reading: above
def test_predict_reads_the_text_field_it_is_told(state, tmp_path, capsys):
    """Issue 41: a user's file names its columns as their config does (``review``, ``sentiment``)."""
    from models.backbone_ref import backbone_reference
    from privprompt_cli import main
    from tasks.registry_model import register_output

    prompt_path = _soft_prompt(state["outputs"] / "p.safetensors", 32)
    register_output(state["client"], state["run_id"], "privprompt.toy.rev", _spec(backbone_reference("tiny-gpt2", 0)),
                    prompt_path, "dp", SPEND, "fp", state["paths"].private)
    src, dst = tmp_path / "reviews.csv", tmp_path / "out.csv"
    pd.DataFrame({"review": TEXTS, "sentiment": ["positive"] * 5, "customer_id": list("abcde")}).to_csv(src, index=False)
    base = ["--state-dir", str(state["paths"].root), "predict", "models:/privprompt.toy.rev/latest", "--input", str(src)]
    assert main(base) == 2
    assert "needs a 'text' column (--text-field NAME names another)" in capsys.readouterr().err
    assert main(base + ["--text-field", "review", "--label-field", "sentiment", "--output", str(dst)]) == 0
    out = pd.read_csv(dst)
    assert out["review"].tolist() == TEXTS and set(out["prediction"]) <= set(LABELS)
    assert "accuracy on the 5 rows' sentiment column:" in capsys.readouterr().err


def test_serve_runs_mlflow_from_this_environment_with_uvicorn_on_path(monkeypatch):
    """`mlflow models serve` execs `uvicorn` by name: without the venv activated it was not found."""
    import os
    import shutil
    import sys

    from privprompt_commands.tools import serve_command

    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    command, env = serve_command("/tmp/model", "127.0.0.1", 5123)
    assert command[:3] == [sys.executable, "-m", "mlflow"] and command[3:5] == ["models", "serve"]
    assert command[command.index("--env-manager") + 1] == "local" and command[-2:] == ["--port", "5123"]
    assert shutil.which("uvicorn", path=env["PATH"]) is not None
    # the model's code imports `models` and `tasks` from the checkout: its root first on the path, never a
    # package folder (privprompt_commands/models.py would shadow the `models` package)
    from pathlib import Path

    first = Path(env["PYTHONPATH"].split(os.pathsep)[0])
    assert first == Path(__file__).resolve().parents[2] and (first / "models" / "__init__.py").is_file()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow  # a model server's start-up (≈ 20-60 s on two shared cores)
def test_privprompt_serve_answers_on_localhost(state, tmp_path):
    import os
    import subprocess
    import sys
    import time
    import urllib.request

    from models.backbone_ref import backbone_reference
    from tasks.registry_model import register_output

    prompt_path = _soft_prompt(state["outputs"] / "p.safetensors", 32)
    register_output(state["client"], state["run_id"], "privprompt.toy.srv", _spec(backbone_reference("tiny-gpt2", 0)),
                    prompt_path, "dp", SPEND, "fp", state["paths"].private)
    port = _free_port()
    env = {**os.environ, "PATH": "/usr/bin:/bin"}  # the venv NOT activated: serve finds uvicorn itself
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-m", "privprompt_cli", "--state-dir", str(state["paths"].root), "serve",
                             "models:/privprompt.toy.srv/latest", "--port", str(port)], cwd=repo, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline, answer = time.time() + 240, None
        while time.time() < deadline and proc.poll() is None:
            try:
                request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", method="POST",
                                                 data=json.dumps({"dataframe_records": [{"text": t} for t in TEXTS]})
                                                 .encode(), headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=30) as response:
                    answer = json.loads(response.read())
                break
            except OSError:
                time.sleep(2)
        assert answer is not None, proc.stdout.read() if proc.poll() is not None else "no answer"
        predictions = answer["predictions"]
        assert len(predictions) == len(TEXTS) and {p["label"] for p in predictions} <= set(LABELS)
    finally:
        import signal

        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
