"""Attacks on what a DP run publishes beside its ε (issue 14): the DP randomness is secret (same
seed, different prompts; the logged config does not replay the prompt), and no published
number, artifact or Prefect log line is an exact statistic of the private training data, other
than the DP output and the labelled audit statistics."""

import json
import re
from pathlib import Path

import pytest

from tests.pipeline.test_flow import _config, _mlflow, _toy_dataset

# metric names a DP run may publish: accountant output, counts fixed by the plan or by the secret
# sampling, accuracy on the test split (the run record), and labelled audit statistics (mia.*)
# train.trainable_parameters: the size of the trained prompt or adapter, fixed by the config
# no_prompt.*: the comparison with no prompt's released (noisy) difference, its σ and its post-processing
ALLOWED = re.compile(r"^(privacy\.(epsilon|delta|epsilon_rdp|guarantee_epsilon)|test\.accuracy(\..+)?|test\.(balanced_accuracy|recall\..+)|train\.(steps|trainable_parameters)"
                     r"|mia\..+|baseline\..+\.mia\.loss\.auc|runtime\..+_s"
                     r"|no_prompt\.(released_difference|noise_sigma|released_gain|fallback|conclusive))$")


@pytest.fixture(scope="module")
def two_runs(prefect_harness, sst2_dir, tmp_path_factory):
    from flows.method_flow import method_flow

    root = tmp_path_factory.mktemp("claims")
    data = _toy_dataset(root / "data", sst2_dir, n_train=160, n_test=40)
    state = root / "state"
    cfg = _config(data, state)
    cfg["methods"]["prompt_sgd"]["enabled"] = False
    first, second = method_flow(cfg), method_flow(cfg)
    return {"first": first, "second": second, "state": state, "data": data, "cfg": cfg}


def _published_prompt(state: Path, summary: dict):
    from tasks.prompts import load_prompt_file

    client = _mlflow(state)
    (art,) = client.list_artifacts(summary["mlflow_run_id"], "prompt")
    return load_prompt_file(client.download_artifacts(summary["mlflow_run_id"], art.path))


def test_same_config_and_seed_publish_different_dp_prompts(two_runs):
    import torch

    a = _published_prompt(two_runs["state"], two_runs["first"])
    b = _published_prompt(two_runs["state"], two_runs["second"])
    assert a.shape == b.shape and not torch.equal(a, b)


def test_replaying_the_logged_config_does_not_reproduce_the_prompt(two_runs):
    """An attacker with the logged config.yaml (seed included) retrains: a different prompt."""
    import torch
    import yaml

    from tasks.config import parse_config
    from tasks.data import Partition
    from tasks.lifecycle import read_private_rows
    from tasks.run_plan import plan_for
    from tasks.methods import MethodContext, get_method
    from tasks.randomness import DpRandomness
    from tasks.state import state_paths

    state, summary = two_runs["state"], two_runs["first"]
    client = _mlflow(state)
    logged = yaml.safe_load(Path(client.download_artifacts(summary["mlflow_run_id"], "config.yaml")).read_text())
    cfg = parse_config(logged)
    part = Partition(**json.loads(next((state / "private" / "partitions").glob("*/manifest.json")).read_text()))
    method = get_method(cfg.method)
    plan = plan_for(cfg, cfg.method, part.sizes)
    # the best an attacker can do without the secret: the seed-derived streams
    replay = method.mechanism.train(MethodContext(cfg, state_paths(str(state)), {}, DpRandomness(seeded=True, seed=cfg.seed),
                                        cfg.seed), plan, read_private_rows(part))
    published = _published_prompt(state, summary)
    assert replay.prompt.shape == published.shape
    assert (replay.prompt - published).abs().max() > 1e-3


def _every_published_number(state: Path, run_id: str) -> dict[str, list[float]]:
    client = _mlflow(state)
    parent = client.get_run(run_id)
    runs = [parent] + client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}'")
    out: dict[str, list[float]] = {}
    for run in runs:
        for key in run.data.metrics:
            out.setdefault(key, []).extend(m.value for m in client.get_metric_history(run.info.run_id, key))
    return out


def test_no_exact_statistic_of_private_training_data_is_published(two_runs):
    state, summary = two_runs["state"], two_runs["first"]
    published = _every_published_number(state, summary["mlflow_run_id"])
    assert {k for k in published if not ALLOWED.match(k)} == set()
    # the exact per-step losses, clipping rates and gradient norms exist, under private/ only
    history_files = list((state / "private" / "runs").rglob("*_history.json"))
    assert history_files
    private = {round(float(v), 9) for f in history_files for h in json.loads(f.read_text())
               for k, v in h.items() if k != "step" and isinstance(v, float)}
    assert private
    leaked = [(k, v) for k, vs in published.items() if not k.startswith("privacy.")
              for v in vs if round(v, 9) in private and v not in (0.0, 1.0)]
    assert not leaked
    # no plot of them either
    client = _mlflow(state)
    plots = [a.path for a in client.list_artifacts(summary["mlflow_run_id"], "plots")]
    assert not [p for p in plots if "training_curve" in p or "loss" in p and "roc" not in p]
    assert not list((state / "outputs").rglob("*training_curve*"))


def test_prefect_logs_and_results_carry_no_private_loss(two_runs):
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    async def logs(flow_run_id):
        async with get_client() as client:
            return await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))

    lines = [l.message for l in asyncio.run(logs(two_runs["first"]["flow_run_id"]))]
    assert any("step" in l for l in lines)  # progress is shown, as steps
    assert not [l for l in lines if re.search(r"(?<!mia\.)\bloss\b(?! MIA)", l) and "audit statistic" not in l]
    # the task results the flow returns: paths and numbers, no history
    text = json.dumps(two_runs["first"], default=str)
    assert "history" not in text and "loss_last" not in text


@pytest.mark.slow  # suite time: runs with -m slow
def test_debug_seeded_randomness_replays_but_claims_and_publishes_nothing(two_runs, tmp_path):
    import torch

    from flows.method_flow import method_flow
    from tasks.prompts import load_prompt_file

    cfg = dict(two_runs["cfg"], state_dir=str(tmp_path / "state"), debug_seeded_dp_randomness=True)
    a, b = method_flow(cfg), method_flow(cfg)
    client = _mlflow(tmp_path / "state")
    run = client.get_run(a["mlflow_run_id"])
    assert run.data.tags["privacy.guarantee"] == "none" and "privacy.epsilon" not in run.data.metrics
    assert "prompt" not in {x.path for x in client.list_artifacts(a["mlflow_run_id"])}
    pa, pb = (load_prompt_file(s["published"]["prompt_path"]) for s in (a, b))
    assert Path(a["published"]["prompt_path"]).is_relative_to(tmp_path / "state" / "private")
    assert torch.equal(pa, pb)  # replayable: that is exactly why it cannot be a DP claim
