"""The warm worker (issue 29): ``privprompt worker`` keeps the imports and a Prefect server for one
state folder; ``privprompt run`` hands it the command, which runs in a process forked per run.

* without a worker (no socket, a dead socket, PRIVPROMPT_NO_WORKER, a config naming another state
  folder or its own ledger) ``run`` runs in-process: :func:`run_via_worker` says None;
* with one, a run goes through it end to end (its summary on the caller's terminal, its exit code,
  its ledger entry committed), a config mistake still fails in one line with nothing reserved, and
  the worker stops on SIGTERM (socket removed, its Prefect server stopped).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import privprompt_worker as pw

REPO = Path(__file__).resolve().parents[2]


def _env(state: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_", "PRIVPROMPT_TEST_")) and k not in ("MLFLOW_TRACKING_URI", pw.NO_WORKER_ENV)}
    env.update({"PRIVPROMPT_HOME": str(state), **extra})
    return env


def test_without_a_worker_the_run_is_in_process(tmp_path, monkeypatch):
    monkeypatch.delenv(pw.NO_WORKER_ENV, raising=False)
    monkeypatch.delenv(pw.ROOT_ENV, raising=False)
    state = tmp_path / "state"
    state.mkdir()
    config = tmp_path / "c.yaml"
    config.write_text("method: prompt_dpsgd\n")
    assert pw.run_via_worker(["run", str(config)], str(config), [], str(state)) is None  # no socket
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(pw.socket_path(state)))  # a socket file nobody listens on (a worker that died)
    dead.close()
    assert pw.run_via_worker(["run", str(config)], str(config), [], str(state)) is None
    monkeypatch.setenv(pw.NO_WORKER_ENV, "1")
    assert pw.run_via_worker(["run", str(config)], str(config), [], str(state)) is None
    # what the caller reads of a config without its schema: its state folder and ledger
    config.write_text(f"method: prompt_dpsgd\nstate_dir: {tmp_path / 'other'}\nledger:\n  url: sqlite:///x.db\n")
    assert pw._config_state(str(config), []) == (str(tmp_path / "other"), "sqlite:///x.db")
    assert pw._config_state(str(config), ["state_dir=/s", "ledger.url=postgresql://h/l"]) == ("/s", "postgresql://h/l")
    assert pw._config_state(str(tmp_path / "missing.yaml"), []) == (None, None)


def test_code_stamp_sees_the_checkouts_newest_python_file():
    newest = max(p.stat().st_mtime for top in pw.CODE_DIRS for p in (REPO / top).rglob("*.py"))
    assert pw.code_stamp() >= newest


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    state = tmp_path_factory.mktemp("worker-state")
    log = open(state.parent / f"{state.name}-worker.log", "w+")
    proc = subprocess.Popen([sys.executable, str(REPO / "privprompt_cli.py"), "worker", "--idle-timeout", "600"],
                            cwd=REPO, env=_env(state), stdout=log, stderr=subprocess.STDOUT)
    sock = pw.socket_path(state)
    deadline = time.monotonic() + 600
    while not sock.exists():
        assert proc.poll() is None, Path(log.name).read_text()[-3000:]
        assert time.monotonic() < deadline, "the worker did not come up"
        time.sleep(0.5)
    yield {"state": state, "proc": proc, "log": Path(log.name)}
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _run(state: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "privprompt_cli.py"), "run", *args], cwd=REPO,
                          env=_env(state), capture_output=True, text=True, timeout=900)


@pytest.mark.slow  # suite time: runs with -m slow
def test_a_run_through_the_worker_and_a_config_mistake_and_the_stop(worker):
    from privacy.ledger import Ledger

    state, proc = worker["state"], worker["proc"]
    bad = _run(state, str(REPO / "configs" / "smoke.yaml"), "--set", "methods.prompt_dpsgd.lr=-1")
    assert bad.returncode != 0
    err_lines = [line for line in bad.stderr.splitlines() if line.startswith("privprompt:")]
    assert err_lines and "lr" in err_lines[0] and "Traceback" not in bad.stderr
    assert "run pid" in worker["log"].read_text()  # it was the worker's child that answered

    ok = _run(state, str(REPO / "configs" / "smoke.yaml"), "--set", "fallback.enabled=false")  # a prompt to print
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    assert "published prompt:" in ok.stdout and "privacy:" in ok.stdout  # the summary, on the caller's stdout
    assert "Starting temporary server" not in ok.stdout + ok.stderr  # the worker's server, not one of its own
    assert worker["log"].read_text().count("run pid") == 2
    entries = [e for e in Ledger(f"sqlite:///{state / 'ledger.sqlite'}").entries() if e["kind"] == "dp"]
    assert [e["status"] for e in entries] == ["committed"]  # one run; the bad config reserved nothing

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert not pw.socket_path(state).exists()
    # with the worker gone, the same command runs in-process
    assert pw.run_via_worker(["run", "x"], str(REPO / "configs" / "smoke.yaml"), [], str(state)) is None
