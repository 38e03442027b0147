"""On demand (-m browser; `bash scripts/browser_setup.sh` first): both UIs in a real browser.

`privprompt ui` starts the Prefect server and the MLflow UI on localhost; the smoke config runs
against them (PREFECT_API_URL, the same state folder); Debian's Chromium, driven by Playwright
through `executable_path`, finds the flow run in the Prefect UI and the run with its
`privacy.epsilon` in the MLflow UI, and the registry page with the `candidate` / `production`
aliases and a promoted version's model card (issue 40). Screenshots go to docs/browser/."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.browser
PREFECT_PORT, MLFLOW_PORT = 4319, 5069
SHOTS = ROOT / "docs" / "browser"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _wait(url: str, timeout: float = 240) -> None:
    end = time.time() + timeout
    while time.time() < end:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"{url} did not come up")


@pytest.fixture(scope="module")
def uis(tmp_path_factory):
    if shutil.which("chromium") is None:
        pytest.skip("Debian's chromium is not installed: bash scripts/browser_setup.sh")
    pytest.importorskip("playwright")
    state = tmp_path_factory.mktemp("ui-state")
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    ui = subprocess.Popen([sys.executable, str(ROOT / "privprompt_cli.py"), "--state-dir", str(state), "ui",
                           "--prefect-port", str(PREFECT_PORT), "--mlflow-port", str(MLFLOW_PORT)],
                          env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait(f"http://127.0.0.1:{PREFECT_PORT}/api/health")
        _wait(f"http://127.0.0.1:{MLFLOW_PORT}/health")
        run = subprocess.run([sys.executable, str(ROOT / "privprompt_cli.py"), "--state-dir", str(state), "run",
                              str(ROOT / "configs" / "smoke.yaml")],
                             env={**env, "PREFECT_API_URL": f"http://127.0.0.1:{PREFECT_PORT}/api"},
                             cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        ids = dict(re.findall(r"^(prefect flow run|mlflow run):\s+(\S+)", run.stdout, re.M))
        yield {**ids, "state": state}
    finally:
        ui.terminate()
        ui.wait(timeout=60)


def _browser(playwright):
    return playwright.chromium.launch(executable_path=shutil.which("chromium"), headless=True, args=CHROMIUM_ARGS)


def test_flow_run_shows_in_the_prefect_ui(uis):
    from playwright.sync_api import expect, sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    flow_run_id = uis["prefect flow run"]
    with sync_playwright() as p:
        browser = _browser(p)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(f"http://127.0.0.1:{PREFECT_PORT}/runs/flow-run/{flow_run_id}")
        expect(page.get_by_text("Completed").first).to_be_visible(timeout=60_000)
        expect(page.get_by_text("method").first).to_be_visible(timeout=60_000)  # the flow's name
        page.screenshot(path=str(SHOTS / "prefect_flow_run.png"))
        page.goto(f"http://127.0.0.1:{PREFECT_PORT}/runs")
        expect(page.get_by_text("method").first).to_be_visible(timeout=60_000)
        page.screenshot(path=str(SHOTS / "prefect_runs.png"))
        browser.close()


def test_run_with_its_epsilon_shows_in_the_mlflow_ui(uis):
    from mlflow.tracking import MlflowClient
    from playwright.sync_api import expect, sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    run_id = uis["mlflow run"].split()[0]
    run = MlflowClient(tracking_uri=f"http://127.0.0.1:{MLFLOW_PORT}").get_run(run_id)
    epsilon = run.data.metrics["privacy.epsilon"]
    with sync_playwright() as p:
        browser = _browser(p)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"http://127.0.0.1:{MLFLOW_PORT}/#/experiments/{run.info.experiment_id}/runs/{run_id}")
        expect(page.get_by_text("privacy.epsilon").first).to_be_visible(timeout=60_000)
        expect(page.get_by_text(f"{epsilon:.4f}"[:5]).first).to_be_visible(timeout=60_000)
        page.screenshot(path=str(SHOTS / "mlflow_run.png"), full_page=True)
        browser.close()


def test_the_registry_page_shows_the_aliases_and_the_model_card(uis, tmp_path):
    """Issue 40: a DP run registered as `candidate`, promoted through its gates to `production`; the
    MLflow registry page shows both aliases and the version page the model card with the gates."""
    from playwright.sync_api import expect, sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    env = {**{k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")},
           "PREFECT_API_URL": f"http://127.0.0.1:{PREFECT_PORT}/api"}
    cli = [sys.executable, str(ROOT / "privprompt_cli.py"), "--state-dir", str(uis["state"])]
    name = "privprompt.sst2.prompt_dpsgd"
    runs = [subprocess.run(cli + ["run", str(ROOT / "configs" / "smoke.yaml"), "--set", "fallback.enabled=false"],
                           env=env, cwd=ROOT, capture_output=True, text=True, timeout=900) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-3000:]
    versions = re.findall(rf"models:/{re.escape(name)}/(\d+)", runs[0].stdout + runs[1].stdout)
    assert len(versions) == 2, runs[0].stdout[-2000:]
    # a random tiny model's prompt may lose to no prompt (the holdout gate refuses it, exit 5): the first
    # version whose gates pass goes to production, else the first with --force (its failures recorded)
    for args in ([f"models:/{name}/{v}"] for v in versions):
        promote = subprocess.run(cli + ["promote", *args], env=env, cwd=ROOT, capture_output=True, text=True,
                                 timeout=900)
        assert promote.returncode in (0, 5), promote.stdout[-2000:] + promote.stderr[-2000:]
        if promote.returncode == 0:
            promoted = args[0].rsplit("/", 1)[1]
            break
    else:
        promote = subprocess.run(cli + ["promote", f"models:/{name}/{versions[0]}", "--force"], env=env, cwd=ROOT,
                                 capture_output=True, text=True, timeout=900)
        assert promote.returncode == 0, promote.stdout[-2000:] + promote.stderr[-2000:]
        promoted = versions[0]
    assert "gate holdout" in promote.stdout and "gate adapter" in promote.stdout
    with sync_playwright() as p:
        browser = _browser(p)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"http://127.0.0.1:{MLFLOW_PORT}/#/models/{name}")
        expect(page.get_by_text("production").first).to_be_visible(timeout=60_000)
        expect(page.get_by_text("candidate").first).to_be_visible(timeout=60_000)
        page.screenshot(path=str(SHOTS / "mlflow_registry_aliases.png"), full_page=True)
        page.goto(f"http://127.0.0.1:{MLFLOW_PORT}/#/models/{name}/versions/{promoted}")
        expect(page.get_by_text("Release gates").first).to_be_visible(timeout=60_000)
        expect(page.get_by_text("production").first).to_be_visible(timeout=60_000)
        page.screenshot(path=str(SHOTS / "mlflow_model_card.png"), full_page=True)
        browser.close()
