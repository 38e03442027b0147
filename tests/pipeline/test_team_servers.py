"""On demand (-m servers): the smoke config against real team servers — PostgreSQL (Debian's
package), an MLflow tracking server on it with served artifacts, and a Prefect server — started
by scripts/team_servers.sh in a temporary folder. The run record reads back from the MLflow
server, the flow run from the Prefect API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.servers
PORTS = {"PG_PORT": "5439", "MLFLOW_PORT": "5059", "PREFECT_PORT": "4309"}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("team")
    env = {**os.environ, **PORTS}
    env.pop("PREFECT_API_URL", None)
    env.pop("MLFLOW_TRACKING_URI", None)
    out = subprocess.run(["bash", str(ROOT / "scripts" / "team_servers.sh"), "start", str(folder)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    urls = {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{PORTS['MLFLOW_PORT']}",
            "PREFECT_API_URL": f"http://127.0.0.1:{PORTS['PREFECT_PORT']}/api"}
    yield urls, folder
    # (the PostgreSQL cluster of a root run stays under /var/tmp: a few MB)
    subprocess.run(["bash", str(ROOT / "scripts" / "team_servers.sh"), "stop", str(folder)], env=env, timeout=120)


def test_smoke_run_record_reads_back_from_the_team_servers(servers, tmp_path):
    urls, folder = servers
    env = {**os.environ, **urls}
    out = subprocess.run([sys.executable, str(ROOT / "privprompt_cli.py"), "--state-dir", str(tmp_path / "client"),
                          "run", str(ROOT / "configs" / "smoke.yaml"), "--set", "experiment=team-smoke",
                          "--set", "fallback.enabled=false"],  # a prompt to read back
                         env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert not (tmp_path / "client" / "mlflow.db").exists()  # nothing tracked locally

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=urls["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("team-smoke")
    runs = [r for r in client.search_runs([exp.experiment_id]) if "mlflow.parentRunId" not in r.data.tags]
    assert len(runs) == 1
    run = runs[0]
    assert run.data.tags["privacy.guarantee"] == "dp" and run.data.tags["method"] == "prompt_dpsgd"
    assert 0 < run.data.metrics["privacy.epsilon"] <= 8.0 + 1e-6 and "test.accuracy" in run.data.metrics
    budget = json.loads(Path(client.download_artifacts(run.info.run_id, "privacy/budget.json", str(tmp_path))).read_text())
    assert budget["privacy.guarantee"] == "dp" and budget["published"]["prompt_published"]
    assert any(a.path == "prompt" for a in client.list_artifacts(run.info.run_id))
    assert list((folder / "artifacts").rglob("*.safetensors"))  # stored by the server, not the client

    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def flow_runs():
        with temporary_settings(updates={PREFECT_API_URL: urls["PREFECT_API_URL"]}):
            async with get_client() as prefect:
                return await prefect.read_flow_runs()

    runs = asyncio.run(flow_runs())
    flow_run_id = run.data.tags["prefect.flow_run_id"]
    assert any(str(r.id) == flow_run_id and r.state.is_completed() for r in runs)
