"""DP-OPT through the method flow on a tiny causal LM: the run record (a text prompt, ε from the
accountant, the query count and ⊥ rate, the leakage report as labelled audit statistics), the
ledger's commit ≤ reservation, cross-model evaluation on a local OpenAI-compatible endpoint that
receives only the (shareable) test split, and no private training text anywhere published."""

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from tests.conftest import key_with_records_in_training

from tests.pipeline.test_flow import _mlflow, _toy_dataset, assert_baselines_labelled

CANARY = "zqxv canary heliotrope quokka 2209"


class _Endpoint(BaseHTTPRequestHandler):
    received: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Endpoint.received.append(body)
        choices = [{"index": i, "text": " positive", "logprobs": {"top_logprobs": [{" positive": -0.1, " negative": -2.3}]}}
                   for i, _ in enumerate(body["prompt"])]
        data = json.dumps({"choices": choices}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def endpoint():
    server = HTTPServer(("127.0.0.1", 0), _Endpoint)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/v1"
    server.shutdown()


def _config(data, state, endpoint_url, **extra):
    cfg = {
        "method": "dp_opt", "experiment": "dpopt-tests", "seed": 0, "state_dir": str(state),
        "allow_nonprivate_baselines": True,
        # size_noise_sigma: the released sizes' default σ (50 records) would let a 96-row split's ñ fall to the 8
        # rows meta_prompts × demos need in ~4% of draws (q = 1: no query fits; the test was flaky)
        "data": {"name": "sst2", "path": str(data), "labels": ["negative", "positive"], "holdout_fraction": 0.2,
                 "test_shareable": True, "size_noise_sigma": 5.0},
        "models": {"local": "tiny-llama", "max_length": 48, "evaluate_on": ["tiny-gpt2"],
                   "endpoints": [{"alias": "remote", "base_url": endpoint_url, "model": "any"}]},
        "privacy": {"target_epsilon": 8.0, "dataset_epsilon_cap": 100.0},
        "methods": {"dp_opt": {"meta_prompts": 4, "demos": 2, "max_new_tokens": 4, "candidates": 2,
                               "epsilon0": 8.0, "delta0": 1e-9},
                    "opt": {"enabled": True, "meta_prompts": 3, "demos": 2, "max_new_tokens": 4, "candidates": 2}},
        "mia": {"max_examples": 24},
    }
    cfg.update(extra)
    return cfg


@pytest.fixture(scope="module")
def dpopt_run(prefect_harness, sst2_dir, tmp_path_factory, endpoint):
    from flows.method_flow import method_flow

    root = tmp_path_factory.mktemp("dpopt")
    data = _toy_dataset(root / "data", sst2_dir, n_train=120, n_test=30, canaries=[CANARY])
    state = root / "state"
    cfg = _config(data, state, endpoint)
    key_with_records_in_training(state, cfg["data"], [f"{CANARY} , a film"], ["positive"])
    _Endpoint.received.clear()
    summary = method_flow(cfg)
    return {"summary": summary, "state": state, "received": list(_Endpoint.received)}


def test_dpopt_run_record(dpopt_run):
    client = _mlflow(dpopt_run["state"])
    run = client.get_run(dpopt_run["summary"]["mlflow_run_id"])
    m, params, tags = run.data.metrics, run.data.params, run.data.tags
    assert tags["method"] == "dp_opt" and tags["privacy.guarantee"] == "dp"
    for p in ("dpopt.eps0", "dpopt.delta0", "dpopt.sample_rate", "dpopt.max_queries"):
        assert p in params, p
    for k in ("privacy.epsilon", "privacy.epsilon_rdp", "test.accuracy", "test.accuracy.tiny-gpt2",
              "test.accuracy.remote", "audit.baseline.opt.test.accuracy", "audit.baseline.opt.mia.loss.auc",
              "dpopt.queries", "dpopt.bottom_rate", "audit.leakage.exact_copies", "audit.leakage.prompts"):
        assert k in m, k
    # the leakage report and the non-private OPT baseline are labelled audit statistics, never bare
    assert_baselines_labelled(m, {"opt": True})
    assert 0 < m["privacy.epsilon"] <= 8.0 + 1e-6
    # the fake endpoint always answers " positive": its accuracy is the share of positive test rows
    assert 0 < m["test.accuracy.remote"] < 1
    assert 1 <= m["dpopt.queries"] <= float(params["dpopt.max_queries"])
    # how many distinct rows the meta-prompts drew is nearly the exact n_train: never published
    assert "dpopt.forward_rows" not in m
    arts = {a.path for a in client.list_artifacts(run.info.run_id, "prompt")}
    assert arts == {"prompt/dp_opt.json"}
    prompt = json.loads(Path(client.download_artifacts(run.info.run_id, "prompt/dp_opt.json")).read_text())
    assert prompt["kind"] == "text" and isinstance(prompt["instruction"], str)
    # the record says whether the published prompt is generated or the (always competing) initial one
    from tasks.methods.dp_opt.templates import initial_instruction

    initial = prompt["instruction"] == initial_instruction("sst2")
    # the initial instruction and no instruction (zero-shot's prompt) always compete
    assert params["prompt.source"] == ("initial" if initial else "none" if not prompt["instruction"] else "generated")
    assert params["audit.baseline.opt.prompt.source"] in ("generated", "initial", "none")
    assert "tables/cross_model.md" in {a.path for a in client.list_artifacts(run.info.run_id, "tables")}


def test_ledger_commit_within_reservation_and_leakage_is_a_nonprivate_use(dpopt_run):
    from privacy.ledger import Ledger

    ledger = Ledger(dpopt_run["state"] / "ledger.sqlite")
    (dp,) = [e for e in ledger.entries() if e["kind"] == "dp"]
    assert dp["status"] == "committed" and dp["epsilon_committed"] <= dp["epsilon_reserved"] + 1e-9
    uses = [e["description"] for e in ledger.entries() if e["kind"] == "nonprivate"]
    assert any("audit statistics" in u and "leakage" in u for u in uses)
    # the OPT baseline's training and its loss attack, whose numbers the parent shows as audit.baseline.opt.*
    assert any(u.startswith("opt:") for u in uses) and any("membership inference on opt" in u for u in uses)


def test_train_runs_label_leakage_as_audit_statistics(dpopt_run):
    client = _mlflow(dpopt_run["state"])
    parent = client.get_run(dpopt_run["summary"]["mlflow_run_id"])
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    train = {c.data.tags["mlflow.runName"]: c.data.metrics for c in children if c.data.tags.get("stage") == "train"}
    assert {"dp_opt", "opt"} <= set(train)
    for name, metrics in train.items():
        assert not [k for k in metrics if k.startswith("leakage.")], name
    assert "audit.leakage.exact_copies" in train["dp_opt"] and "audit.leakage.exact_copies" in train["opt"]


def test_endpoint_received_only_the_test_split(dpopt_run, sst2_dir):
    received = [p for body in dpopt_run["received"] for p in body["prompt"]]
    assert received and len(received) == 30
    train = [json.loads(l)["text"] for l in (sst2_dir / "train.jsonl").open().readlines()[:120]]
    assert not any(t in p for p in received for t in train)
    assert not any(CANARY in p for p in received)


def test_no_private_training_text_is_published(dpopt_run):
    state = dpopt_run["state"]
    for path in state.rglob("*"):
        if path.is_file() and (state / "private") not in path.parents:
            assert CANARY.encode() not in path.read_bytes(), path


def test_remote_endpoint_refused_unless_the_test_split_is_shareable(tmp_path, endpoint):
    from tasks.config import parse_config
    from tasks.errors import ConfigError

    cfg = _config(tmp_path, tmp_path / "s", endpoint)
    cfg["data"]["test_shareable"] = False
    with pytest.raises(ConfigError, match="data.test_shareable"):
        parse_config(cfg)
    cfg = _config(tmp_path, tmp_path / "s", endpoint, method="prompt_dpsgd")
    with pytest.raises(ConfigError, match="only text prompts go to an endpoint"):
        parse_config(cfg)


@pytest.mark.parametrize("method", ["icl", "opt", "dln1"])
def test_a_prompt_without_a_guarantee_built_from_private_rows_never_goes_to_an_endpoint(tmp_path, endpoint, method):
    """Review 6, F3: ICL's prompt holds private training rows verbatim; published with
    allow_nonprivate_baselines it stays on the private side — refused at config time, and the stage
    that sends refuses a prompt under private/ (defence in depth)."""
    from types import SimpleNamespace

    from tasks.config import parse_config
    from tasks.errors import ConfigError
    from tasks.stages import endpoint_evaluate_stage
    from tasks.state import state_paths

    with pytest.raises(ConfigError, match="never leaves this machine"):
        parse_config(_config(tmp_path, tmp_path / "s", endpoint, method=method))
    cfg = parse_config(_config(tmp_path, tmp_path / "s", endpoint))  # dp_opt: accepted
    paths = state_paths(str(tmp_path / "s")).create()
    kept = paths.private / "runs" / "x" / "icl.json"
    kept.parent.mkdir(parents=True)
    kept.write_text(json.dumps({"kind": "text", "instruction": "Input: " + CANARY}))
    _Endpoint.received.clear()
    with pytest.raises(ConfigError, match="kept on the private side"):
        endpoint_evaluate_stage(SimpleNamespace(cfg=cfg, paths=paths), str(kept), method,
                                {"alias": "remote", "base_url": endpoint, "model": "any"})
    assert not _Endpoint.received


def test_text_prompt_is_a_template_and_a_registered_version(dpopt_run):
    """A text prompt is no PEFT adapter: the run record says so and carries the template; the
    registry holds it as a predictor whose template holds the instruction (issue 27)."""
    client = _mlflow(dpopt_run["state"])
    parent = client.get_run(dpopt_run["summary"]["mlflow_run_id"])
    (child,) = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}' "
                                  "and tags.stage = 'train' and tags.method = 'dp_opt'")
    assert child.data.tags["peft.adapter"].startswith("none: a text prompt is a template")
    template = json.loads(Path(client.download_artifacts(child.info.run_id, "peft/template.json")).read_text())
    prompt = json.loads(Path(client.download_artifacts(parent.info.run_id, "prompt/dp_opt.json")).read_text())
    safe = prompt["instruction"].replace("{", "(").replace("}", ")")
    # no instruction (a possible winner: zero-shot's prompt) is the template alone
    head = f"Instruction: {safe}" if safe else "{text}"
    assert template["template"].startswith(head) and "{text}" in template["template"]
    (version,) = client.search_model_versions("name='privprompt.sst2.dp_opt'")
    assert version.run_id == parent.info.run_id and version.tags["privacy.guarantee"] == "dp"
    assert float(version.tags["privacy.epsilon"]) == pytest.approx(parent.data.metrics["privacy.epsilon"])
    # the non-private OPT baseline is not registered
    assert [m.name for m in client.search_registered_models()] == ["privprompt.sst2.dp_opt"]
    # the instruction is in MLflow's Prompt Registry too, with ε, δ and unit, loadable by alias
    uri = version.tags["prompt.registry"]
    assert uri == "prompts:/privprompt.sst2.dp_opt.prompt/1" and child.data.tags["registry.prompt"] == uri
    stored = client.load_prompt("prompts:/privprompt.sst2.dp_opt.prompt@candidate")
    assert stored.template == template["template"].replace("{text}", "{{text}}")
    assert stored.format(text="a great film") == template["template"].replace("{text}", "a great film")
    assert stored.tags["privacy.epsilon"] == version.tags["privacy.epsilon"]
    assert (stored.tags["privacy.delta"], stored.tags["privacy.unit"]) == (version.tags["privacy.delta"], "record")
    assert stored.tags["model.target"] and json.loads(stored.tags["labels"]) == template["labels"]
    from tasks.promotion import promote

    promote(client, "models:/privprompt.sst2.dp_opt/1", force=True)  # gated like the model; its alias follows
    assert client.load_prompt("prompts:/privprompt.sst2.dp_opt.prompt@production").version == 1
