"""``privprompt config / ui / serve``: the config reference, the UIs, a registered model over HTTP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from .common import _fail, _one_line


def cmd_config(args) -> int:
    """``--schema``: the config reference (every key, type, default, constraint and meaning) as
    Markdown, generated from the pydantic schema; docs/config.md is this output."""
    from tasks.config_reference import markdown

    print(markdown(), end="")
    return 0


def cmd_ui(args) -> int:
    from importlib.metadata import entry_points

    from tasks.state import configure_environment, state_paths, tracking_uri

    if not entry_points(group="mlflow.app", name="privprompt"):
        return _fail("this environment lacks PrivPrompt's MLflow app (installed before it existed): run "
                     "bash scripts/setup.sh, then privprompt ui again")

    paths = state_paths(args.state_dir)
    configure_environment(paths)
    env = dict(os.environ)
    api = f"http://127.0.0.1:{args.prefect_port}/api"  # the UI's API on the port asked for (default: 4200)
    env.update({"PREFECT_UI_API_URL": api, "PREFECT_SERVER_UI_API_URL": api})
    # each server in its own process group, stopped as a group (the MLflow UI runs uvicorn and job
    # consumers as children); SIGTERM stops them like Ctrl-C
    procs = [
        subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                          "--port", str(args.prefect_port)], env=env, start_new_session=True),
        # MLflow's server with this project's app (tasks.mlflow_ui): its page neither shows the usage-data
        # notice nor sends UI telemetry; one worker (uvicorn's default 4 take a minute to start on 2 cores)
        subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--app-name", "privprompt",
                          "--backend-store-uri", tracking_uri(paths), "--host", "127.0.0.1",
                          "--port", str(args.mlflow_port), "--workers", "1"], env=env, start_new_session=True),
    ]
    print(f"Prefect UI: http://127.0.0.1:{args.prefect_port}   MLflow UI: http://127.0.0.1:{args.mlflow_port}"
          "   (Ctrl-C stops both)", flush=True)
    from tasks.state import UI_MARKER

    marker = paths.prefect_home / UI_MARKER  # runs on this state folder link their flow runs to this UI
    marker.write_text(json.dumps({"url": f"http://127.0.0.1:{args.prefect_port}", "pid": os.getpid()}))

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        while all(p.poll() is None for p in procs):
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        marker.unlink(missing_ok=True)
        _stop_groups(procs)
    return 0


def _stop_groups(procs: list, grace_s: float = 30.0) -> None:
    """SIGTERM the process group each of ``procs`` leads (each started with ``start_new_session``),
    wait up to ``grace_s`` (one deadline for all) for every process in them to end, then SIGKILL what
    is left and reap the leaders: a server's own CLI may exit before its uvicorn child has, which
    would otherwise keep the port and a core. A second Ctrl-C or SIGTERM meanwhile is ignored (it
    would cut the stop short); the handlers are restored after."""
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        _terminate_groups(procs, grace_s)
        for p in procs:
            p.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _terminate_groups(procs: list, grace_s: float) -> None:
    pgids = [p.pid for p in procs]
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    end = time.monotonic() + grace_s
    alive = list(pgids)
    while alive and time.monotonic() < end:
        for p in procs:
            p.poll()  # reap a leader that has exited: a zombie still counts as its group's member
        alive = [g for g in alive if _group_alive(g)]
        if alive:
            time.sleep(0.2)
    for pgid in alive:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def serve_command(model_dir: str, host: str, port: int) -> tuple[list[str], dict[str, str]]:
    """``mlflow models serve`` of a downloaded pyfunc folder, from this project's environment: its
    Python (``-m mlflow``), its ``bin`` first on PATH (the server execs ``uvicorn`` by name: without
    the venv activated it was not found) and the project importable (the model's code)."""
    env = dict(os.environ)
    bin_dir = os.path.dirname(os.path.abspath(sys.executable))
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout, not privprompt_commands/
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return ([sys.executable, "-m", "mlflow", "models", "serve", "-m", model_dir, "--env-manager", "local",
             "--host", host, "--port", str(port)], env)


def cmd_serve(args) -> int:
    """Serve a registered model (``models:/NAME/VERSION`` or ``/latest``, as ``privprompt run``
    printed it) over HTTP on localhost: ``POST /invocations`` with ``{"dataframe_records": [{"text":
    ...}]}`` answers labels and scores. Runs until Ctrl-C."""
    import tempfile

    from tasks.record import client
    from tasks.registry_model import download_model
    from tasks.state import state_paths

    with tempfile.TemporaryDirectory(prefix="privprompt-serve-") as tmp:
        try:
            folder = download_model(client(state_paths(args.state_dir)), args.model_uri, tmp)
        except Exception as exc:  # noqa: BLE001 - reported as one line
            return _fail(f"cannot load {args.model_uri}: {_one_line(exc)}")
        command, env = serve_command(str(folder), args.host, args.port)
        print(f"serving {args.model_uri} at http://{args.host}:{args.port}/invocations (POST JSON "
              '{"dataframe_records": [{"text": "..."}]}; Ctrl-C stops it)', flush=True)
        proc = subprocess.Popen(command, env=env, start_new_session=True)

        def stop(signum, frame):
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, stop)
        try:
            return proc.wait()
        except KeyboardInterrupt:
            return 0
        finally:
            _stop_groups([proc])
