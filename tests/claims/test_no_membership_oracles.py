"""Nothing outside the private side depends on whether a chosen text is in the private source.

* Which registered dataset a source is charged to depends on its records: the line saying so goes
  to the operator's terminal and ``private/operator.log``, never into Prefect's logs or MLflow.
* Public data is never compared with the private source by a run: two POST runs whose public files
  differ only in whether one line is a private training sentence end the same way, with the same
  messages (``-m slow``); ``privprompt plan`` counts the shared texts on the operator's terminal.
"""

import asyncio
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

from tests.pipeline.test_flow import _config, _toy_dataset

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data"


def _flow_logs(flow_run_id: str) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=30)  # the log worker sends in batches: every line of the flow run, sent

    async def logs():
        async with get_client() as client:
            return await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))

    return [log.message for log in asyncio.run(logs())]


def test_an_operator_note_goes_to_the_terminal_and_the_private_log_only(tmp_path, capsys):
    import logging

    from tasks.state import OPERATOR_LOG, operator_note, state_paths

    paths = state_paths(str(tmp_path / "state")).create()
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    logging.getLogger().addHandler(handler)
    try:
        operator_note(paths, "data source 'x' shares records with registered dataset 'y'")
    finally:
        logging.getLogger().removeHandler(handler)
    assert "shares records with registered dataset 'y'" in capsys.readouterr().err and not seen
    log = paths.private / OPERATOR_LOG
    assert "'y'" in log.read_text() and log.stat().st_mode & 0o077 == 0


def _operator_log(paths) -> str:
    from tasks.state import OPERATOR_LOG

    log = paths.private / OPERATOR_LOG
    return log.read_text() if log.is_file() else ""


def _grown_source(sst2_dir, tmp_path):
    """A registered dataset 'toy-sst2' (120 SST-2 records, δ 1e-4) and a source 'grown' holding its
    records and one more: (the source's folder, the state folder, its paths)."""
    from tasks.charge import ensure_dataset
    from tasks.config import parse_config
    from tasks.data import partition_dataset
    from tasks.state import state_paths

    rows = [json.loads(line) for line in (sst2_dir / "train.jsonl").open().readlines()[:121]]
    registered = _toy_dataset(tmp_path / "registered", sst2_dir, n_train=120, n_test=20)
    grown = tmp_path / "grown"
    grown.mkdir()
    (grown / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (grown / "test.jsonl").write_text((registered / "test.jsonl").read_text())
    state = tmp_path / "state"
    first = parse_config(_config(registered, state))
    paths = state_paths(str(state)).create()
    part = partition_dataset(first.data, first.seed, paths.private, None)
    ensure_dataset(paths.open_ledger(), part, first.privacy.dataset_epsilon_cap, 1e-4)
    return grown, state, paths


def test_the_dataset_a_source_is_charged_to_reaches_the_operator_only(prefect_harness, sst2_dir, tmp_path):
    """A source holding a registered dataset's records plus one more is charged to it; the run's
    Prefect logs and its MLflow run say nothing of it; the operator's terminal and log do."""
    from flows.method_flow import method_flow
    from tasks.record import client

    grown, state, paths = _grown_source(sst2_dir, tmp_path)
    cfg = _config(grown, state, method="zero_shot", **{"data.name": "probe", "privacy.target_delta": 1e-5})
    cfg["mia"]["enabled"] = False
    refused = method_flow(cfg, return_state=True)  # δ 1e-5 against the registered dataset's 1e-4
    assert refused.is_failed() and "differs from δ=0.0001 at which dataset 'toy-sst2'" in _operator_log(paths)
    assert "toy-sst2" not in str(refused.message) and "operator's terminal" in str(refused.message)
    logs = _flow_logs(str(refused.state_details.flow_run_id))
    assert logs and not [line for line in logs if "toy-sst2" in line or "shares records" in line]
    summary = method_flow({**cfg, "privacy": {**cfg["privacy"], "target_delta": 1e-4}})
    assert "'probe' shares records with registered dataset 'toy-sst2'" in _operator_log(paths)
    logs = _flow_logs(summary["flow_run_id"])
    assert logs and not [line for line in logs if "shares records" in line or "toy-sst2" in line]
    run = client(paths).get_run(summary["mlflow_run_id"])
    published = json.dumps([run.data.tags, run.data.params, run.data.metrics])
    assert "toy-sst2" not in published and "shares records" not in published


def test_the_sweep_logs_no_dataset_its_variants_are_charged_to(sst2_dir, tmp_path):
    """The sweep's plan in Prefect and MLflow has no dataset rows and no notes; the operator's
    terminal gets them; a refusal of the plan names no dataset."""
    from flows.sweep import pending_variants
    from tasks.charge import ChargedRefusal
    from tasks.config import parse_config, sweep_variants
    from tasks.planning import format_plan

    grown, state, paths = _grown_source(sst2_dir, tmp_path)
    cfg = _config(grown, state, **{"data.name": "probe", "privacy.target_delta": 1e-4})
    cfg["seeds"] = [0, 1]
    _, _, budget = pending_variants(sweep_variants(parse_config(cfg)), paths)
    assert "'probe' shares records with registered dataset 'toy-sst2'" in _operator_log(paths)
    public = format_plan(budget, datasets=False)
    assert "toy-sst2" not in public and "shares records" not in public and "prompt_dpsgd" in public
    with pytest.raises(ChargedRefusal) as refused:  # δ against the registered dataset's
        pending_variants(sweep_variants(parse_config({**cfg, "privacy": {**cfg["privacy"], "target_delta": 1e-5}})),
                         paths)
    assert "toy-sst2" not in str(refused.value) and "differs from δ=0.0001" in _operator_log(paths)


# ---- public data against the private source ------------------------------------------------------

def _cli(args, state: Path, cwd: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update({"PRIVPROMPT_HOME": str(state), "PYTHONPATH": str(REPO)})
    return subprocess.run([sys.executable, "-m", "privprompt_cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


def _shape(text: str) -> list[str]:
    """A run's output with what differs between any two runs taken out (ids, numbers, times, paths)."""
    text = re.sub(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|\b[0-9a-f]{12,}\b", "<id>", text)
    text = re.sub(r"'[a-z]+-[a-z]+'", "<name>", text)  # Prefect's random flow run names
    text = re.sub(r"(Task run '[a-z_:-]+)-[0-9a-f]+'", r"\1'", text)  # and its task runs' suffixes
    text = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "<n>", text)
    text = re.sub(r"/tmp/\S+", "<path>", text)
    # MLflow's own first-use lines (the first CLI run of a test session makes the store's template)
    return [line for line in text.splitlines() if line.strip() and "mlflow.store.db.utils" not in line]


@pytest.mark.slow  # two POST runs on tiny-bert through the CLI (≈ 1-2 min each on two cores)
def test_two_post_runs_whose_public_files_differ_in_one_private_sentence_end_the_same_way(sst2_dir, tmp_path):
    if not (SHARED / "tweet_sentiment" / "validation.jsonl").is_file():
        pytest.skip("../shared/data/tweet_sentiment is not available")
    data = _toy_dataset(tmp_path / "data", sst2_dir, n_train=160, n_test=40)
    member = json.loads((data / "train.jsonl").open().readline())["text"]
    outsider = member.replace("e", "a", 1) if "e" in member else member + " x"
    tweets = [json.loads(line) for line in (SHARED / "tweet_sentiment" / "validation.jsonl").open().readlines()[:199]]
    results = []
    for name, line in (("member", member), ("outsider", outsider)):
        public = tmp_path / name / "public"
        public.mkdir(parents=True)
        (public / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in tweets + [{"text": line}]))
        cfg = _config(data, tmp_path / "unused", method="post", **{"data.name": "toy"})
        del cfg["state_dir"]
        cfg["methods"] = {"zero_shot": {"enabled": False},
                          "post": {"tuning": {"n_tokens": 3, "epochs": 1, "batch_size": 32},
                                   "distill": {"student_layers": 1, "steps": 5, "batch_size": 16},
                                   "transfer": {"steps": 5, "batch_size": 16}}}
        cfg["models"].update({"local": "tiny-bert", "target": "tiny-bert"})
        cfg["public"] = {"name": "public", "path": str(public), "split": "validation"}
        cfg["mia"]["enabled"] = False
        # no released comparison with no prompt: the sign of its noisy D̃ (secret DP noise, and a student
        # distilled on other public text) picks one of two warnings, whichever line the public file holds
        cfg["fallback"] = {"enabled": False, "epsilon_share": 0.0}
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
        state = tmp_path / f"state-{name}"
        results.append(_cli(["run", str(tmp_path / f"{name}.yaml")], state, tmp_path))
        plan = _cli(["plan", str(tmp_path / f"{name}.yaml")], state, tmp_path)
        results.append(plan)
    run_m, plan_m, run_o, plan_o = results
    assert run_m.returncode == run_o.returncode == 0, (run_m.stderr[-2000:], run_o.stderr[-2000:])
    import difflib

    a, b = _shape(run_m.stdout), _shape(run_o.stdout)
    assert a == b, "\n".join(difflib.unified_diff(a, b, lineterm=""))
    # the log's lines, each as often (Prefect's threads interleave them, and how many progress lines a
    # stage prints follows the wall clock, not the data: those are compared as a set)
    progress = re.compile(r"step <n>/<n>|<n>%")
    a, b = (Counter(line for line in _shape(p.stderr) if not progress.search(line)) for p in (run_m, run_o))
    assert a == b, (a - b, b - a)
    assert {line for line in _shape(run_m.stderr) if progress.search(line)} == \
        {line for line in _shape(run_o.stderr) if progress.search(line)}
    # the operator's plan, on this terminal only, says what the runs never looked at
    assert "1 of them are also private records" in plan_m.stdout
    assert "none is a private record" in plan_o.stdout
