"""Crash guarantees of issue 25: a `privprompt run` killed with SIGKILL at each stage of the
lifecycle (after the reservation, during training, after the commit, during publishing).

Each run is a real `python -m privprompt_cli run CONFIG` subprocess (its own session, so the kill
takes its embedded Prefect server too) on a tiny model. A stage hook of the door
(tests/claims/pause_at_stage.py, ``PRIVPROMPT_TEST_PAUSE_AT=<stage>:<marker>``) makes it write a
marker and wait at the stage point; the test then kills the whole process group with SIGKILL and checks what the kill left:

* the ledger entry of the killed run still counts in the dataset's budget: ``reserved`` (killed
  before the commit; a kill cannot release, so a reservation killed before the first private read
  stays counted too, until an operator releases it with ``privprompt budget release``, which the
  ledger refuses once the run began reading) or ``committed``;
* nothing is published without a commit: no file in ``outputs/`` and no prompt artifact in MLflow
  belongs to a run whose ledger entry is not committed;
* its MLflow runs are left RUNNING, and the next run's start marks them FAILED (the sweep of
  flows/parent_run.py: the owner process is gone), so no run stays RUNNING;
* a rerun of the same config succeeds, and the budget composes the killed run's counted event
  with the rerun's (one charge each);
* after a kill past the commit, a retry of the same flow run (what a Prefect retry does)
  republishes the stored DP output under the one charge, without reading or training.

The stage "committed" (kill, rerun, release rule) runs in the default suite; the four stages in a
row, with the same-flow-run retries, are ``slow``."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.pipeline.test_flow import _config, _mlflow, _toy_dataset

REPO = Path(__file__).resolve().parents[2]
METHOD = "prompt_dpsgd"


def _setup(root: Path, sst2_dir: Path, api_url: str | None = None) -> dict:
    """A toy SST-2 sample and a prompt_dpsgd config on tiny-bert. ``api_url``: the Prefect server
    the runs report to (the session's test server); None: each run starts its own embedded server,
    as `privprompt run` does by default, and the kill takes it down with the run."""
    data = _toy_dataset(root / "data", sst2_dir, n_train=120, n_test=20)
    state = root / "state"
    cfg = _config(data, state)
    cfg["methods"]["zero_shot"]["enabled"] = False
    cfg["methods"]["prompt_sgd"]["enabled"] = False
    cfg["mia"]["enabled"] = False
    (root / "run.yaml").write_text(yaml.safe_dump(cfg))
    return {"root": root, "state": state, "config": root / "run.yaml", "cfg": cfg,
            "env": {"PREFECT_API_URL": api_url} if api_url else {}}


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "PRIVPROMPT_TEST_"))}
    env.update({"PYTHONPATH": str(REPO), **extra})
    return env


def _cli(setup: dict, *args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "privprompt_cli", *args], cwd=setup["root"], env=_env(**setup["env"]),
                          capture_output=True, text=True, timeout=timeout)


def _run_and_kill(setup: dict, stage: str, timeout_s: float = 400) -> int:
    """Start `privprompt run`, wait until it pauses at ``stage``, SIGKILL its process group.
    Returns the killed process's pid."""
    from tests.claims.pause_at_stage import PAUSE_ENV

    marker = setup["root"] / f"paused-{stage}"
    marker.unlink(missing_ok=True)
    log = open(setup["root"] / f"killed-{stage}.log", "w")
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("pause_at_stage.py")), "run",
                             str(setup["config"])],
                            cwd=setup["root"], env=_env(**setup["env"], **{PAUSE_ENV: f"{stage}:{marker}"}),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        limit = time.monotonic() + timeout_s
        while not (marker.is_file() and marker.read_text()):
            if proc.poll() is not None:
                log.close()
                raise AssertionError(f"the run ended (rc {proc.returncode}) before stage {stage!r}:\n"
                                     + (setup["root"] / f"killed-{stage}.log").read_text()[-3000:])
            assert time.monotonic() < limit, f"the run never reached stage {stage!r}"
            time.sleep(0.2)
        assert int(marker.read_text()) == proc.pid  # paused in the CLI's own process (the flow runs in it)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the CLI and its embedded Prefect server
        except ProcessLookupError:
            pass
        proc.wait(timeout=60)
        log.close()
    assert proc.returncode == -signal.SIGKILL
    return proc.pid


# ---- reading what a run left ----------------------------------------------------------------

def _ledger(setup):
    from privacy.ledger import Ledger

    return Ledger(setup["state"] / "ledger.sqlite")


def _dp_entries(setup) -> dict[str, dict]:
    """run key → ledger entry, of every dp entry."""
    return {e["run_id"]: e for e in _ledger(setup).entries() if e["kind"] == "dp"}


def _runs(setup) -> list:
    from mlflow.entities import ViewType

    client = _mlflow(setup["state"])
    exps = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    return client.search_runs(exps, run_view_type=ViewType.ALL, max_results=10_000)


def _parents(setup) -> dict[str, object]:
    """flow run id → its MLflow parent run."""
    return {r.data.tags["prefect.flow_run_id"]: r for r in _runs(setup) if "mlflow.parentRunId" not in r.data.tags}


def _prompt_artifacts(setup, run) -> list[str]:
    """Prompt artifacts of a parent run and of its child runs."""
    client = _mlflow(setup["state"])
    runs = [run] + [r for r in _runs(setup) if r.data.tags.get("mlflow.parentRunId") == run.info.run_id]
    return [a.path for r in runs for a in client.list_artifacts(r.info.run_id, "prompt")]


def _output_files(setup, flow_run_id: str) -> list[str]:
    """The published prompt files of a flow run. Its other forms (the PEFT adapter folder
    ``<method>_peft/``, written after the prompt was logged) only ever sit beside such a file."""
    folder = setup["state"] / "outputs" / flow_run_id
    if not folder.is_dir():
        return []
    files = sorted(p.name for p in folder.iterdir() if p.is_file())
    for derived in (p for p in folder.iterdir() if p.is_dir()):
        assert derived.name.endswith("_peft") and f"{derived.name[:-5]}.safetensors" in files, derived
    return files


def _assert_nothing_published_without_a_commit(setup) -> int:
    """Every file in outputs/ and every prompt artifact in MLflow belongs to a flow run whose
    ledger entry is committed. Returns how many flow runs published anything."""
    entries = _dp_entries(setup)
    publishing = 0
    for flow_run_id, parent in _parents(setup).items():
        files, artifacts = _output_files(setup, flow_run_id), _prompt_artifacts(setup, parent)
        if files or artifacts:
            publishing += 1
            entry = entries.get(f"{flow_run_id}:{METHOD}")
            assert entry is not None and entry["status"] == "committed", (flow_run_id, files, artifacts, entry)
    outputs = setup["state"] / "outputs"
    for folder in (outputs.iterdir() if outputs.is_dir() else []):  # a folder of a run MLflow does not know
        if any(p.is_file() for p in folder.rglob("*")):
            assert entries[f"{folder.name}:{METHOD}"]["status"] == "committed", folder
    return publishing


def _composed_spend(setup) -> tuple[float, float]:
    """(the ledger's spent ε of the dataset, the accountant's composition of every counted entry's event)."""
    from privacy import accountant as acct
    from privacy import events as ev

    ledger = _ledger(setup)
    (ds,) = ledger.datasets()
    counted = [e for e in _dp_entries(setup).values() if e["status"] in ("reserved", "committed")]
    events = [ev.event_from_json(json.dumps(e["committed_event"] if e["status"] == "committed"
                                            else e["reserved_event"])) for e in counted]
    return ledger.spent(ds["fingerprint"]).epsilon, acct.spend(ev.ComposedEvent(tuple(events)), ds["delta"]).epsilon


EXPECTED = {  # stage → (ledger status of the killed run, marked read, prompt file in outputs/)
    "reserved": ("reserved", False, False),
    "training": ("reserved", True, False),
    "committed": ("committed", True, False),
    "publishing": ("committed", True, True),
}


def _kill_at(setup, stage: str) -> dict:
    """Kill a run at ``stage`` and check what it left; returns what the rerun checks."""
    before = set(_parents(setup)) if (setup["state"] / "mlflow.db").is_file() else set()
    spent_before = _composed_spend(setup)[0] if (setup["state"] / "ledger.sqlite").is_file() else 0.0
    pid = _run_and_kill(setup, stage)
    parents = _parents(setup)
    (flow_run_id,) = set(parents) - before
    killed = parents[flow_run_id]
    assert killed.info.status == "RUNNING"  # nobody ended it
    assert killed.data.tags["privprompt.owner.pid"] == str(pid)
    status, read, published_file = EXPECTED[stage]
    entry = _dp_entries(setup)[f"{flow_run_id}:{METHOD}"]
    assert entry["status"] == status, entry
    assert (entry["read_started_at"] is not None) == read
    spent, composed = _composed_spend(setup)
    assert spent == pytest.approx(composed) and spent > spent_before  # the killed run's event counts
    assert _prompt_artifacts(setup, killed) == []  # killed before anything reached MLflow
    assert _output_files(setup, flow_run_id) == ([f"{METHOD}.safetensors"] if published_file else [])
    _assert_nothing_published_without_a_commit(setup)
    stored = setup["state"] / "private" / "runs" / flow_run_id / "releases" / f"{METHOD}.json"
    assert stored.is_file() == (status == "committed")  # the DP output is stored before the commit
    return {"flow_run_id": flow_run_id, "entry": entry, "run_id": killed.info.run_id, "spent": spent}


def _rerun(setup, killed: list[dict]) -> dict:
    """A rerun of the same config: it succeeds, its start sweeps the killed runs, the budget composes."""
    before = set(_parents(setup))
    proc = _cli(setup, "run", str(setup["config"]))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    parents = _parents(setup)
    (flow_run_id,) = set(parents) - before
    assert parents[flow_run_id].info.status == "FINISHED"
    runs = {r.info.run_id: r for r in _runs(setup)}
    assert [r.info.run_id for r in runs.values() if r.info.status == "RUNNING"] == []  # none left RUNNING
    for k in killed:
        family = [r for r in runs.values()
                  if k["run_id"] in (r.info.run_id, r.data.tags.get("mlflow.parentRunId"))]
        assert len(family) >= 2  # the parent and its training child
        for r in family:
            assert r.info.status == "FAILED", r.info
            why = r.data.tags["privprompt.swept"]
            assert "owner process" in why and "killed or crashed" in why
            assert flow_run_id in why or k is not killed[-1]  # the last one swept by the rerun's start
        entry = _dp_entries(setup)[f"{k['flow_run_id']}:{METHOD}"]
        assert entry["status"] == k["entry"]["status"]  # a rerun releases nothing: still counted
    entries = _dp_entries(setup)
    assert entries[f"{flow_run_id}:{METHOD}"]["status"] == "committed"
    assert _output_files(setup, flow_run_id) == [f"{METHOD}.safetensors"]
    assert _prompt_artifacts(setup, parents[flow_run_id]) != []
    spent, composed = _composed_spend(setup)
    assert spent == pytest.approx(composed) and spent > killed[-1]["spent"]  # the rerun composes on top
    assert _assert_nothing_published_without_a_commit(setup) >= 1
    return {"flow_run_id": flow_run_id, "spent": spent}


def _retry_same_flow_run(setup, killed: dict) -> None:
    """What a Prefect retry of the killed flow run does: the lifecycle again under the same flow run
    id. Past the commit it republishes the stored DP output: no read, no training, one charge."""
    import torch

    from tasks import lifecycle
    from tasks.config import parse_config
    from tasks.data import partition_dataset
    from tasks.prompts import load_prompt_file
    from tasks.stages import StageContext
    from tasks.state import state_paths

    cfg = parse_config(setup["cfg"])
    part = partition_dataset(cfg.data, cfg.seed, state_paths(str(setup["state"])).private, None)
    ctx = StageContext(cfg=cfg, state_dir=str(setup["state"]), partition=part.to_dict(),
                       parent_run_id=killed["run_id"], flow_run_id=killed["flow_run_id"])
    spent = _composed_spend(setup)[0]
    reads = []
    real_read = lifecycle.read_private_rows
    lifecycle.read_private_rows = lambda *a, **k: reads.append(1) or real_read(*a, **k)
    try:
        info = lifecycle.run_method(ctx, METHOD, {})
    finally:
        lifecycle.read_private_rows = real_read
    assert info.republished and info.reserved_new is False and reads == []
    entry = _dp_entries(setup)[f"{killed['flow_run_id']}:{METHOD}"]
    assert entry["status"] == "committed" and entry["epsilon"] == pytest.approx(killed["entry"]["epsilon"])
    assert _composed_spend(setup)[0] == pytest.approx(spent)  # one charge
    (stored,) = (setup["state"] / "private" / "runs" / killed["flow_run_id"] / "releases").glob(
        f"{METHOD}_dp_output.*.safetensors")
    assert torch.equal(load_prompt_file(info.prompt_path), load_prompt_file(str(stored)))
    assert _output_files(setup, killed["flow_run_id"]) == [f"{METHOD}.safetensors"]
    _assert_nothing_published_without_a_commit(setup)


def _release_rule(setup, killed: list[dict], monkeypatch) -> None:
    """A killed reservation is released only by an operator (`privprompt budget release`), and only
    when the run had not begun reading private data."""
    import privprompt_cli

    monkeypatch.setenv("PRIVPROMPT_HOME", os.environ["PRIVPROMPT_HOME"])  # main() sets it: restored after the test
    for k in killed:
        run_key = f"{k['flow_run_id']}:{METHOD}"
        rc = privprompt_cli.main(["--state-dir", str(setup["state"]), "budget", "release", run_key,
                                  "--reason", "killed before its first private read (test)"])
        entry = _dp_entries(setup)[run_key]
        if k["entry"]["read_started_at"] is None and k["entry"]["status"] == "reserved":
            assert rc == 0 and entry["status"] == "released"
        else:
            assert rc == 2 and entry["status"] == k["entry"]["status"]  # one-line refusal
    spent, composed = _composed_spend(setup)
    assert spent == pytest.approx(composed)


# ---- the tests ------------------------------------------------------------------------------

@pytest.mark.slow  # suite time: runs with -m slow
def test_kill_after_the_commit_then_rerun(sst2_dir, tmp_path, monkeypatch, prefect_harness):
    """The representative stage: killed after the commit, before publishing; the runs report to the
    session's Prefect test server (no database migrations per run: the slow test below kills the
    embedded server with the run, as a plain `privprompt run` has it)."""
    from prefect.settings import PREFECT_API_URL

    setup = _setup(tmp_path, sst2_dir, PREFECT_API_URL.value())
    killed = _kill_at(setup, "committed")
    _rerun(setup, [killed])
    _release_rule(setup, [killed], monkeypatch)  # committed: never released


@pytest.mark.slow
def test_kill_at_every_stage(sst2_dir, tmp_path, monkeypatch):
    """The four stages in a row on one state folder, each run with its embedded Prefect server
    (killed with it); each run's start sweeps the previous killed run; a rerun that completes; the
    same-flow-run retries past the commit; and the release rule."""
    setup = _setup(tmp_path, sst2_dir)
    killed = []
    for stage in ("reserved", "training", "committed", "publishing"):
        killed.append(_kill_at(setup, stage))
        if len(killed) > 1:  # this run's start swept the previous killed run
            previous = {r.info.run_id: r for r in _runs(setup)}[killed[-2]["run_id"]]
            assert previous.info.status == "FAILED" and "privprompt.swept" in previous.data.tags
    rerun = _rerun(setup, killed)
    for k in killed[2:]:
        _retry_same_flow_run(setup, k)
    entries = _dp_entries(setup)
    counted = [k for k in killed if entries[f"{k['flow_run_id']}:{METHOD}"]["status"] in ("reserved", "committed")]
    uncommitted_publishing = [k for k in killed if entries[f"{k['flow_run_id']}:{METHOD}"]["status"] != "committed"
                              and (_output_files(setup, k["flow_run_id"])
                                   or _prompt_artifacts(setup, _parents(setup)[k["flow_run_id"]]))]
    running = [r for r in _runs(setup) if r.info.status == "RUNNING"]
    assert len(counted) == 4 and uncommitted_publishing == [] and running == []
    print(f"\ncrash figures: stages killed {len(killed)}, killed reservations still counted {len(counted)}/4, "
          f"outputs published without a commit {len(uncommitted_publishing)}, MLflow runs RUNNING after the "
          f"sweep {len(running)}, rerun ok (ε spent {rerun['spent']:.4f} composed over "
          f"{len(entries)} entries), same-flow-run retries republished 2/2")
    _release_rule(setup, killed, monkeypatch)


def test_the_sweep_fails_only_runs_of_this_host_whose_owner_is_gone(tmp_path):
    """No model: runs made by hand with owner tags. Swept: this host's dead owner (and its RUNNING
    child, not its FINISHED one), a reused pid (same pid, another start time). Left alone: a live
    owner, another host's run, a run without owner tags, a run that already ended."""
    from mlflow.tracking import MlflowClient

    from tasks import record

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("sweep", artifact_location=(tmp_path / "artifacts").as_uri())
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_tags = {record.OWNER_HOST: record._host(), record.OWNER_PID: str(dead.pid),
                 record.OWNER_STARTED: repr(record._process_started(dead.pid) or 0.0)}
    dead.wait()
    alive = record.owner_tags()
    runs = {
        "dead": dead_tags,
        "reused_pid": {**alive, record.OWNER_STARTED: repr(float(alive[record.OWNER_STARTED]) - 100.0)},
        "alive": alive,
        "other_host": {**dead_tags, record.OWNER_HOST: record._host() + "-elsewhere"},
        "no_owner": {},
        "ended": dead_tags,
    }
    ids = {name: record.RunRecord.create(client, exp, name, tags).run_id for name, tags in runs.items()}
    record.RunRecord(client, ids["ended"]).end(ok=True)
    child = record.RunRecord(client, ids["dead"]).child("train", {})
    done_child = record.RunRecord(client, ids["dead"]).child("evaluate", {})
    done_child.end(ok=True)

    swept = record.sweep_dead_runs(client, by="the test")
    assert sorted(swept) == sorted([ids["dead"], ids["reused_pid"], child.run_id])
    status = {name: client.get_run(i).info.status for name, i in ids.items()}
    assert status == {"dead": "FAILED", "reused_pid": "FAILED", "alive": "RUNNING", "other_host": "RUNNING",
                      "no_owner": "RUNNING", "ended": "FINISHED"}
    assert client.get_run(child.run_id).info.status == "FAILED"
    assert client.get_run(done_child.run_id).info.status == "FINISHED"
    why = client.get_run(ids["dead"]).data.tags[record.SWEPT]
    assert f"owner process {dead.pid} on {record._host()}" in why and why.endswith("by the test")
    assert record.SWEPT not in client.get_run(ids["alive"]).data.tags
    assert record.sweep_dead_runs(client) == []  # nothing left to sweep
