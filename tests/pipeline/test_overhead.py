"""Issue 29, orchestration overhead: what was cut from every run keeps its behaviour — noise
calibrations cached on disk give the accountant's own σ, the embedded Prefect server starts in
the background and answers inside the block, the console script's fast exit loses no output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from privacy import accountant, calibration_cache
from privacy import events as ev

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache_file(tmp_path, monkeypatch):
    path = tmp_path / "state" / "cache" / "accounting.json"
    monkeypatch.delenv(calibration_cache.ENV, raising=False)
    calibration_cache.enable(tmp_path / "state")
    assert os.environ[calibration_cache.ENV] == str(path)
    real = accountant._calibrate_noise_multiplier
    real.cache_clear()
    yield path
    real.cache_clear()


@pytest.mark.slow  # suite time: runs with -m slow
def test_calibration_is_cached_on_disk_and_keyed_by_the_code(cache_file, monkeypatch):
    calls = []
    real = accountant._calibrate_noise_multiplier

    def counting(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(accountant, "_calibrate_noise_multiplier", counting)
    sigma = accountant.calibrate_noise_multiplier(8.0, 1e-5, 0.1, 10)
    assert len(calls) == 1 and cache_file.is_file()
    stored = json.loads(cache_file.read_text())
    assert stored["code"] == calibration_cache.code_key() and list(stored["values"].values()) == [sigma]
    # another process (no in-process cache): the disk answer, not a new calibration
    assert accountant.calibrate_noise_multiplier(8.0, 1e-5, 0.1, 10) == sigma and len(calls) == 1
    # the cached σ is the accountant's: it spends at most the target, and a little less noise would not
    assert accountant.spend(ev.dpsgd_event(0.1, sigma, 10), 1e-5).epsilon <= 8.0 + 1e-9
    assert accountant.spend(ev.dpsgd_event(0.1, sigma * 0.99, 10), 1e-5).epsilon > 8.0
    # other numbers: calibrated afresh
    accountant.calibrate_noise_multiplier(4.0, 1e-5, 0.1, 10)
    assert len(calls) == 2 and len(json.loads(cache_file.read_text())["values"]) == 2
    # a cache written by other accounting code is ignored (and replaced)
    stored["code"] = "another-accountant"
    cache_file.write_text(json.dumps(stored))
    assert accountant.calibrate_noise_multiplier(8.0, 1e-5, 0.1, 10) == pytest.approx(sigma)
    assert len(calls) == 3 and json.loads(cache_file.read_text())["code"] == calibration_cache.code_key()


def test_calibration_without_a_cache_or_with_a_broken_one(tmp_path, monkeypatch):
    monkeypatch.delenv(calibration_cache.ENV, raising=False)
    assert calibration_cache.cached("k", lambda x: x * 2, 1.5) == 3.0  # no state folder: no file
    bad = tmp_path / "accounting.json"
    bad.write_text("{not json")
    monkeypatch.setenv(calibration_cache.ENV, str(bad))
    assert calibration_cache.cached("k", lambda x: x * 2, 1.5) == 3.0
    assert json.loads(bad.read_text())["values"] == {"k:[1.5]": 3.0}


@pytest.mark.slow  # suite time: runs with -m slow
def test_embedded_prefect_server_starts_in_the_background(tmp_path, monkeypatch):
    import privprompt_commands.run
    from tasks.state import configure_environment, state_paths

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    for key in ("PREFECT_HOME", "PREFECT_RESULTS_LOCAL_STORAGE_PATH"):
        monkeypatch.setenv(key, os.environ.get(key, ""))  # restored after the test
    configure_environment(state_paths(str(tmp_path / "state")))
    from prefect.settings import get_current_settings

    heartbeat = get_current_settings().flows.heartbeat_frequency
    started = time.perf_counter()
    server = privprompt_commands.run._local_prefect_server().start()
    try:
        assert time.perf_counter() - started < 5  # returns before the server is up
        assert server.process is not None and server.process.poll() is None
        with server:
            assert os.environ["PREFECT_API_URL"] == server.api_url
            with urllib.request.urlopen(f"{server.api_url}/health", timeout=5) as response:
                assert response.status == 200
            from prefect.settings import PREFECT_API_URL, get_current_settings

            assert PREFECT_API_URL.value() == server.api_url
            # its own server, gone with the command: no version round trip, no heartbeat thread
            settings = get_current_settings()
            assert settings.flows.heartbeat_frequency is None
            assert settings.client.server_version_check_enabled is False
        assert server.process is None and "PREFECT_API_URL" not in os.environ
        assert get_current_settings().flows.heartbeat_frequency == heartbeat
    finally:
        server.stop()


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_the_embedded_server_ends_with_its_command_however_that_ends(tmp_path):
    """A command killed outright (SIGKILL: no atexit, no finally) leaves no Prefect server behind."""
    code = ("import sys, time; from privprompt_commands.run import _local_prefect_server; "
            "s = _local_prefect_server().start(); print(s.process.pid, flush=True); time.sleep(120)")
    command = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PREFECT_HOME": str(tmp_path)})
    server_pid = int(command.stdout.readline())
    os.kill(command.pid, signal.SIGKILL)
    command.wait()
    end = time.monotonic() + 30
    while time.monotonic() < end and _running(server_pid):
        time.sleep(0.2)
    assert not _running(server_pid), "the embedded server outlived its command"


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_a_named_server_is_used_as_is(monkeypatch):
    import privprompt_commands.run

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    server = privprompt_commands.run._local_prefect_server().start()
    assert server.process is None
    with server:
        assert os.environ["PREFECT_API_URL"] == "http://127.0.0.1:9/api"
        from prefect.settings import get_current_settings

        # someone else's server (a team's, a deployment's): its heartbeats and version check stay
        settings = get_current_settings()
        assert settings.flows.heartbeat_frequency is not None and settings.client.server_version_check_enabled
    assert os.environ["PREFECT_API_URL"] == "http://127.0.0.1:9/api"


def test_console_script_exits_fast_without_losing_output():
    from tasks.config_reference import markdown

    proc = subprocess.run([sys.executable, "-m", "privprompt_cli", "config", "--schema"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == markdown()  # every byte flushed before os._exit
    proc = subprocess.run([sys.executable, "-m", "privprompt_cli", "run", "no/such/config.yaml"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "config file not found: no/such/config.yaml" in proc.stderr


@pytest.mark.slow  # suite time: runs with -m slow
def test_a_tampered_calibration_is_refused_before_any_reservation(cache_file):
    """The cache only saves time: a σ in it that misses its target (edited, or copied from other
    code) cannot make a run spend above privacy.target_epsilon — plan and run refuse the plan."""
    import yaml

    from tasks.config import parse_config
    from tasks.errors import ConfigError
    from tasks.run_plan import planned_epsilon
    from tasks.methods import get_method

    cfg = parse_config(yaml.safe_load((REPO / "configs" / "smoke.yaml").read_text()))
    method = get_method(cfg.method)
    honest = planned_epsilon(cfg, cfg.method, method.mechanism.plan(cfg, 1000, 1e-5), 1e-5)
    assert honest <= cfg.privacy.target_epsilon * (1 + 1e-6)
    stored = json.loads(cache_file.read_text())
    assert stored["values"]  # the calibration went through the cache
    stored["values"] = {k: v * 0.3 for k, v in stored["values"].items()}  # far less noise than needed
    cache_file.write_text(json.dumps(stored))
    accountant._calibrate_noise_multiplier.cache_clear()
    with pytest.raises(ConfigError, match="above privacy.target_epsilon .* nothing reserved"):
        planned_epsilon(cfg, cfg.method, method.mechanism.plan(cfg, 1000, 1e-5), 1e-5)


def test_a_saved_pyfunc_pins_this_environment_without_mlflows_package_scan(tmp_path, monkeypatch):
    """The pyfunc's requirements are this environment's own versions, so MLflow's check that the
    environment satisfies them (after a scan of every installed distribution) is skipped while it
    is saved — and only then: the check is MLflow's own again afterwards."""
    import importlib.metadata as md

    import torch
    from mlflow.utils import environment as mlflow_environment
    from mlflow.utils import requirements_utils

    from models.backbone_ref import backbone_reference
    from models.prompts import save_prompt_artifact
    from tasks.registry_model import save_pyfunc

    scans = []
    monkeypatch.setattr(requirements_utils, "_init_packages_to_modules_map", lambda: scans.append(1))
    check = mlflow_environment.warn_dependency_requirement_mismatches
    prompt = save_prompt_artifact(tmp_path / "p.safetensors", torch.zeros(2, 32), {"privacy.guarantee": "dp"})
    spec = {"method": "prompt_dpsgd", "backbone": backbone_reference("tiny-bert", 0), "model": "tiny-bert",
            "labels": ["a", "b"], "label_descriptions": {}, "template": None, "max_length": 16, "seed": 0}
    folder = save_pyfunc(tmp_path / "model", spec, prompt)
    assert scans == [] and mlflow_environment.warn_dependency_requirement_mismatches is check
    pins = set((folder / "requirements.txt").read_text().split())
    assert {f"{p}=={md.version(p)}" for p in ("torch", "transformers", "safetensors", "pandas", "mlflow")} <= pins


@pytest.mark.slow  # suite time: runs with -m slow
def test_a_ledgers_compositions_resume_from_a_kept_prefix_with_the_same_pld(monkeypatch):
    """Composing a dataset's entries with one more event (or a last one changed) starts from the
    fold of the entries before it: the same compositions in the same order, so the same PLD and
    the same ε as composed from scratch — and one composition instead of all of them."""
    from privacy import pld

    entries = [ev.dpsgd_event(0.05, 1.1 + 0.1 * i, 20) for i in range(4)]
    planned, committed = ev.dpsgd_event(0.05, 0.9, 20), ev.dpsgd_event(0.05, 0.9, 12)
    runs = {"existing": entries, "reserved": entries + [planned], "committed": entries + [committed]}

    expected = {}
    for name, events in runs.items():
        pld.clear_caches()
        expected[name] = pld.pld_for(ev.ComposedEvent(tuple(events)))
    pld.clear_caches()
    pld_class, composed = type(expected["existing"]), []
    compose = pld_class.compose

    def counting(self, other, *args, **kwargs):
        composed.append(other)
        return compose(self, other, *args, **kwargs)

    monkeypatch.setattr(pld_class, "compose", counting)
    got = {"existing": pld.pld_for(ev.ComposedEvent(tuple(entries)))}
    assert len(composed) == len(entries)  # the first fold composes every entry
    got["reserved"] = pld.pld_for(ev.ComposedEvent(tuple(runs["reserved"])))
    got["committed"] = pld.pld_for(ev.ComposedEvent(tuple(runs["committed"])))
    assert len(composed) == len(entries) + 2  # then one composition each
    for name, want in expected.items():
        assert got[name]._pmf_remove._probs.tolist() == want._pmf_remove._probs.tolist(), name
        for delta in (1e-5, 1e-6):
            assert got[name].get_epsilon_for_delta(delta) == want.get_epsilon_for_delta(delta), name
    assert len(pld._FOLDS) <= pld._FOLDS_KEPT
