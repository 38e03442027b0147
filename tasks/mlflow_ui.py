"""The MLflow UI as ``privprompt ui`` serves it: MLflow's own server app, with its browser-side
telemetry switched off before the page's code runs.

MLflow's server sends nothing when ``MLFLOW_DISABLE_TELEMETRY`` / ``DO_NOT_TRACK`` are set
(:func:`tasks.state.configure_environment` sets both), but its web page decides on its own: it shows
"MLflow collects usage data to improve the product" until the browser's local storage says the
notice was dismissed, and its client sends UI events unless the settings page's switch is off.
Beside a product whose promise is that nothing leaves the machine, the page must neither say it
collects nor try to. This app writes both settings into local storage from the page's ``<head>``,
ahead of MLflow's bundle, so the bundle reads them on its first render. Registered as the
``mlflow.app`` entry point ``privprompt`` (``mlflow server --app-name privprompt``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from mlflow.server import app as flask_app
from mlflow.server.fastapi_app import app  # the ASGI app uvicorn serves; it wraps ``flask_app``

# MLflow 3's UI keys its local-storage settings as `<key>_v<version>` with a JSON value
# (mlflow/server/js: useLocalStorage; the telemetry constants' module)
LOCAL_SETTINGS = {
    "mlflow.telemetry.info.alert.dismissed_v1": True,  # the "collects usage data" notice: dismissed
    "mlflow.settings.telemetry.enabled_v1": False,  # the settings page's UI telemetry switch: off
}
SCRIPT = ("<script>" + "".join(f"localStorage.setItem({json.dumps(k)},{json.dumps(json.dumps(v))});"
                               for k, v in LOCAL_SETTINGS.items()) + "</script>").encode()


def page_without_telemetry(html: bytes) -> bytes:
    """``html`` with :data:`SCRIPT` first in its ``<head>`` (unchanged when it has none)."""
    head = html.find(b"<head>")
    if head < 0:
        return html
    at = head + len(b"<head>")
    return html[:at] + SCRIPT + html[at:]


def _index():
    """MLflow's index page with :data:`SCRIPT` in it, under its own ETag (a browser that cached the
    unchanged page revalidates and gets this one) and answered conditionally as Flask answers a file."""
    from flask import Response, request

    folder = Path(flask_app.static_folder)
    if not (folder / "index.html").is_file():
        return _mlflow_index()  # MLflow's own answer for an install without its built UI
    body = page_without_telemetry((folder / "index.html").read_bytes())
    response = Response(body, mimetype="text/html")
    response.set_etag(hashlib.sha256(body).hexdigest())
    response.cache_control.no_cache = True
    return response.make_conditional(request)


_mlflow_index = flask_app.view_functions["serve"]  # the only route that serves index.html ("/")
flask_app.view_functions["serve"] = _index  # artifacts and every other page stay as MLflow serves them


__all__ = ["app", "flask_app", "page_without_telemetry"]
