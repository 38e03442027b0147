"""The MLflow UI that `privprompt ui` starts neither shows MLflow's "collects usage data" notice nor
sends UI telemetry: its page sets both local-storage settings before MLflow's bundle runs."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _settings(html: str) -> dict:
    """The local-storage settings the page's first script writes, as the browser would read them."""
    head = html[html.index("<head>"):]
    first = re.search(r"<script>(.*?)</script>", head).group(1)
    assert head.index(first) < head.index("static/js/main."), "the settings come after MLflow's bundle"
    return {k: json.loads(json.loads(v)) for k, v in re.findall(r"localStorage\.setItem\(\"([^\"]+)\",(\"[^)]*\")\)",
                                                                     first)}


def test_the_page_dismisses_the_notice_and_switches_ui_telemetry_off():
    from tasks.mlflow_ui import flask_app

    response = flask_app.test_client().get("/")
    assert response.status_code == 200
    assert _settings(response.get_data(as_text=True)) == {"mlflow.telemetry.info.alert.dismissed_v1": True,
                                                          "mlflow.settings.telemetry.enabled_v1": False}
    # the notice's own check in MLflow's bundle reads exactly this key (`<key>_v<version>`)
    bundle = Path(flask_app.static_folder) / "static" / "js"
    main = next(bundle.glob("main.*.js")).read_text()
    assert '"mlflow.telemetry.info.alert.dismissed"' in main and '"mlflow.settings.telemetry.enabled"' in main
    assert "`${e}_v${t}`" in main
    # a browser holding the page unchanged (its own ETag) revalidates and gets this one; this one's ETag answers 304
    etag = response.headers["ETag"]
    assert etag.strip('"') != hashlib.sha256((Path(flask_app.static_folder) / "index.html").read_bytes()).hexdigest()
    assert flask_app.test_client().get("/", headers={"If-None-Match": etag}).status_code == 304
    # only the index page is MLflow's page with the script; nothing else it serves (artifacts) is rewritten
    assert not flask_app.after_request_funcs.get(None)


@pytest.mark.slow  # the MLflow server's uvicorn workers take ~30-60 s to come up on 2 cores
def test_privprompt_ui_serves_that_page_on_localhost(tmp_path):
    prefect_port, mlflow_port = _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    ui = subprocess.Popen([sys.executable, str(ROOT / "privprompt_cli.py"), "--state-dir", str(tmp_path), "ui",
                           "--prefect-port", str(prefect_port), "--mlflow-port", str(mlflow_port)],
                          env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        end, html = time.time() + 120, None
        while html is None and time.time() < end and ui.poll() is None:
            try:
                html = urllib.request.urlopen(f"http://127.0.0.1:{mlflow_port}/", timeout=2).read().decode()
            except OSError:
                time.sleep(0.5)
        assert html is not None, "the MLflow UI did not come up"
        assert _settings(html)["mlflow.telemetry.info.alert.dismissed_v1"] is True
        assert "collects usage data" not in html  # the notice is MLflow's bundle's, shown only when not dismissed
    finally:
        ui.terminate()
        ui.wait(timeout=90)
    # both servers stopped with it, their uvicorn children included (none keeps a port or a core)
    for port in (prefect_port, mlflow_port):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"a server still answers on port {port}"
