"""A warm worker for ``privprompt run`` (issue 29): the imports and the Prefect server paid once.

A small run spends most of its orchestration seconds importing torch, transformers, Prefect and
MLflow (≈ 6 s on an idle machine) and starting its embedded Prefect server (another process, 5–6 s
CPU), before any work. ``privprompt worker`` pays both once, for one state folder:

    privprompt [--state-dir DIR] worker [--idle-timeout SECONDS] &
    privprompt [--state-dir DIR] run CONFIG ...       # now handed to the worker

The worker imports what a run needs, starts a Prefect server it keeps, and listens on a Unix socket
``DIR/worker.sock`` (mode 0600: this user only). ``privprompt run`` finds the socket and hands the
worker its command line, working directory, environment and its terminal (stdin, stdout, stderr as
file descriptors, SCM_RIGHTS): the worker FORKS a child per run, which runs exactly the command's
code (``privprompt_cli.main``) in a fresh process with the imports already done, writes to the
caller's terminal, and sends back the exit code. So each run is still its own process: a crash
or a kill ends that run only, and a run's budget, ledger and records behave as in-process — the
same code does them. Ctrl-C in the caller interrupts the run (KeyboardInterrupt in the child); the
caller killed outright ends the child at once (as a killed run: a reservation taken stays open, as
``privprompt budget reservations`` shows). Without a worker, or when it does not answer, ``run``
runs in-process as before; ``PRIVPROMPT_NO_WORKER=1`` never uses one.

The worker serves its own state folder only: a config whose ``state_dir`` or ``ledger.url`` names
another is run in-process. It stops after ``--idle-timeout`` seconds without a run (default 1800),
on SIGTERM/SIGINT, or when the checkout's code changed since it started (a run that finds it stale
is run in-process, and the worker exits: start it again).

Nothing private passes through the worker's own process: it receives a command line, a working
directory and an environment, never data, and keeps nothing between runs (each child exits).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent
SOCKET_NAME = "worker.sock"
STATE_MISMATCH = 75  # a child's exit code: the run's state folder is not the worker's; run in-process
NO_WORKER_ENV = "PRIVPROMPT_NO_WORKER"
ROOT_ENV = "PRIVPROMPT_WORKER_ROOT"  # set in a worker's child: the state folder it may serve
CODE_DIRS = ("privacy", "models", "tasks", "flows", "privprompt_commands")


def socket_path(root) -> Path:
    return Path(root) / SOCKET_NAME


def code_stamp() -> float:
    """The newest modification time of the checkout's Python code (a worker started before it is
    stale: its modules are the old ones)."""
    newest = max((REPO / "privprompt_cli.py").stat().st_mtime, Path(__file__).stat().st_mtime)
    for top in CODE_DIRS:
        for folder, _, files in os.walk(REPO / top):
            for name in files:
                if name.endswith(".py"):
                    newest = max(newest, os.stat(os.path.join(folder, name)).st_mtime)
    return newest


# ---- the caller's side (``privprompt run``): no heavy import here ------------------------------

def _config_state(config: str, overrides: list[str]) -> tuple[str | None, str | None]:
    """(state_dir, ledger.url) a config names, read without the config schema (cheap); the worker's
    child checks the full parse again."""
    state, ledger = None, None
    try:
        import yaml

        with open(config, encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
        if isinstance(raw, dict):
            state = raw.get("state_dir")
            ledger = (raw.get("ledger") or {}).get("url") if isinstance(raw.get("ledger"), dict) else None
    except Exception:  # noqa: BLE001 — the child reports config errors; here only the folder matters
        pass
    for item in overrides:
        key, _, value = item.partition("=")
        if key.strip() == "state_dir":
            state = value.strip()
        elif key.strip() == "ledger.url":
            ledger = value.strip()
    return state, ledger


def run_via_worker(argv: list[str], config: str, overrides: list[str], state_dir: str | None) -> int | None:
    """Hand ``privprompt`` ``argv`` to the warm worker of the run's state folder; its exit code, or
    None when there is no worker to use (then the caller runs in-process)."""
    if os.environ.get(NO_WORKER_ENV) or os.environ.get(ROOT_ENV):
        return None
    cfg_state, ledger = _config_state(config, overrides)
    if ledger:
        return None  # a config's own ledger: exported per run before Prefect's import; run in-process
    from tasks.state import state_paths

    root = state_paths(cfg_state or state_dir).root
    path = socket_path(root)
    if not path.exists():
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(path))
    except OSError:
        conn.close()
        return None
    request = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "root": str(root)}).encode()
    try:
        socket.send_fds(conn, [len(request).to_bytes(8, "big") + request],
                        [sys.stdin.fileno(), sys.stdout.fileno(), sys.stderr.fileno()])
    except OSError:
        conn.close()
        return None
    previous = signal.signal(signal.SIGINT, lambda *_: _send(conn, b"INT\n"))
    try:
        reply = b""
        while True:
            chunk = conn.recv(4096)
            if not chunk:
                break
            reply += chunk
    finally:
        signal.signal(signal.SIGINT, previous)
        conn.close()
    text = reply.decode(errors="replace")
    if text.startswith("stale"):
        print("privprompt: the warm worker runs older code than this checkout and stopped; running in-process "
              "(start `privprompt worker` again)", file=sys.stderr)
        return None
    if not text.startswith("rc "):
        print("privprompt: the warm worker's run ended without an exit code (killed?)", file=sys.stderr)
        return 1
    rc = int(text.split()[1])
    return None if rc == STATE_MISMATCH else rc


def _send(conn, data: bytes) -> None:
    try:
        conn.sendall(data)
    except OSError:
        pass


# ---- the worker ---------------------------------------------------------------------------------

def _preimport() -> None:
    """What a run imports (seconds each), done once before any fork. Nothing here starts a thread
    or runs a torch operation (forking after either is unsafe)."""
    import tasks.config  # noqa: F401
    import tasks.lifecycle  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoModel, AutoTokenizer  # noqa: F401
    from transformers.models.bert import modeling_bert  # noqa: F401

    import flows.method_flow  # noqa: F401  (Prefect, MLflow, the tasks)
    import flows.sweep  # noqa: F401
    import mlflow.pyfunc  # noqa: F401
    import peft  # noqa: F401
    from mlflow.store.tracking import sqlalchemy_store  # noqa: F401


# the command a forked run executes: the CLI's ``main``, handed in by ``privprompt worker`` (the CLI
# imports this module; this module never imports the CLI)
_COMMAND: list = []


def serve(paths, idle_timeout: float = 1800.0, *, command, prefect_server) -> int:
    """Run the worker for state folder ``paths`` (``configure_environment`` already applied) until
    it is idle for ``idle_timeout`` seconds, stopped, or stale; each run executes ``command(argv)``
    (the CLI's ``main``) in a forked process, against the Prefect server ``prefect_server()``
    starts. Returns the exit code."""
    import threading

    _COMMAND[:] = [command]
    started = time.perf_counter()
    stamp = code_stamp()
    server = prefect_server().start()  # starts up while the imports run
    _preimport()
    server._wait()  # noqa: SLF001 — the same wait as a run's
    os.environ["PREFECT_API_URL"] = server.api_url
    if threading.active_count() != 1:
        print(f"privprompt worker: {threading.active_count() - 1} thread(s) started by the imports; forking would be "
              "unsafe; not serving", file=sys.stderr)
        server.stop()
        return 1
    path = socket_path(paths.root)
    listener = _listen(path, paths.root)
    if listener is None:
        server.stop()
        return 1
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append("SIGTERM"))
    signal.signal(signal.SIGINT, lambda *_: stopping.append("SIGINT"))
    print(f"privprompt worker: serving {paths.root} on {path} (pid {os.getpid()}; ready in "
          f"{time.perf_counter() - started:.1f} s; Prefect server {server.api_url}; stops after {idle_timeout:g} s "
          "idle)", flush=True)
    children: set[int] = set()
    try:
        _accept_runs(listener, str(paths.root), server, stamp, idle_timeout, stopping, children)
    finally:
        listener.close()
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        for pid in children:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        server.stop()
    return 0


def _listen(path: Path, root) -> socket.socket | None:
    """The worker's socket at ``path`` (mode 0600), listening; None when another worker serves
    ``root`` already (a stale socket of a worker that died is removed)."""
    if path.exists():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
            probe.close()
            print(f"privprompt worker: another worker already serves {root}", file=sys.stderr)
            return None
        except OSError:
            path.unlink()  # a stale socket of a worker that died
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        listener.bind(str(path))
    finally:
        os.umask(old_umask)
    listener.listen(8)
    listener.settimeout(1.0)
    return listener


def _accept_runs(listener, root: str, server, stamp: float, idle_timeout: float, stopping: list,
                 children: set[int]) -> None:
    """Accept runs until stopped, idle for ``idle_timeout`` seconds or stale: each run is a forked
    child (its pid added to ``children``)."""
    last = time.monotonic()
    while not stopping:
        children -= {pid for pid in list(children) if _reaped(pid)}
        if not children and time.monotonic() - last > idle_timeout:
            print(f"privprompt worker: idle for {idle_timeout:g} s; stopping", flush=True)
            return
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            continue
        except InterruptedError:
            continue
        last = time.monotonic()
        try:
            request, fds = _receive(conn)
        except (OSError, ValueError) as exc:
            print(f"privprompt worker: a bad request ({exc}); ignored", flush=True)
            conn.close()
            continue
        if code_stamp() > stamp:
            _send(conn, b"stale\n")
            conn.close()
            for fd in fds:
                os.close(fd)
            print("privprompt worker: the checkout's code changed since it started; stopping", flush=True)
            return
        children.add(_fork_run(listener, conn, request, fds, root, server))
        del request  # the caller's environment (its keys too) is not kept between runs


def _fork_run(listener, conn, request: dict, fds: list[int], root: str, server) -> int:
    """Fork the run's own process (:func:`_child`); the worker keeps none of the caller's
    descriptors. Returns the child's pid."""
    pid = os.fork()
    if pid == 0:  # the run's own process
        listener.close()
        _child(conn, request, fds, root, server)
    conn.close()
    for fd in fds:
        os.close(fd)
    print(f"privprompt worker: run pid {pid}: privprompt {request['argv'][0] if request['argv'] else ''}",
          flush=True)
    return pid


def _reaped(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return done == pid


def _receive(conn) -> tuple[dict, list[int]]:
    conn.settimeout(10)
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    if len(data) < 8:
        raise ValueError("short request")
    size = int.from_bytes(data[:8], "big")
    body = data[8:]
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ValueError("truncated request")
        body += chunk
    conn.settimeout(None)
    if len(fds) != 3:
        raise ValueError(f"expected 3 file descriptors, got {len(fds)}")
    return json.loads(body), list(fds)


def _child(conn, request: dict, fds: list[int], root: str, server) -> None:
    """In the forked child: become the caller's command (its terminal, directory, environment), run
    it, send the exit code back, and end the process."""
    keep = _become_caller(conn, request, fds, root, server)
    _report_to_worker_server(keep["PREFECT_API_URL"])
    rc = _run_command(list(request["argv"]))
    _send(conn, f"rc {int(rc)}\n".encode())
    os._exit(int(rc) & 0xFF)


def _become_caller(conn, request: dict, fds: list[int], root: str, server) -> dict:
    """Take the caller's terminal (its three descriptors), environment and directory, and follow its
    connection (its Ctrl-C becomes ours; the caller gone ends this run at once). Returns the
    worker's Prefect settings kept in the caller's environment."""
    import atexit
    import threading
    import _thread

    atexit.unregister(server.stop)  # the worker's server is the worker's: this run must not stop it
    server.process = None
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    keep = {k: os.environ[k] for k in ("PREFECT_API_URL", "PREFECT_HOME", "PREFECT_RESULTS_LOCAL_STORAGE_PATH")
            if k in os.environ}
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ.update(keep)
    os.environ[ROOT_ENV] = root
    os.chdir(request["cwd"])

    def watch():  # the caller's Ctrl-C becomes ours; the caller gone ends this run at once
        while True:
            try:
                data = conn.recv(64)
            except OSError:
                data = b""
            if not data:
                os._exit(137)
            if b"INT" in data:
                _thread.interrupt_main()

    threading.Thread(target=watch, daemon=True, name="privprompt-worker-caller").start()
    return keep


def _report_to_worker_server(api_url: str) -> None:
    """Prefect read its settings when the worker imported it, before the server's URL was known: the
    run's flow must report to the worker's server (not start a temporary one of its own); as with
    a run's embedded server, no API-version round trip and no heartbeat thread. The global context
    too: threads the run starts (Prefect's log and event workers) begin from it, not from ours."""
    from prefect.context import refresh_global_settings_context
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_CLIENT_SERVER_VERSION_CHECK_ENABLED,
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        temporary_settings,
    )

    refresh_global_settings_context()
    temporary_settings(updates={PREFECT_API_URL: api_url,
                                PREFECT_CLIENT_SERVER_VERSION_CHECK_ENABLED: False,
                                PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}).__enter__()


def _run_command(argv: list[str]) -> int:
    """The caller's ``privprompt`` command, its exit code; then what a normal exit runs that
    matters (as ``privprompt_cli._exit_now``)."""
    import atexit
    import threading

    rc = 1
    try:
        rc = _COMMAND[0](argv)
    except KeyboardInterrupt:
        print("privprompt: interrupted", file=sys.stderr)
        rc = 130
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 — a bug: its traceback on the caller's terminal
        import traceback

        traceback.print_exc()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:
        pass
    try:  # threads' exit hooks
        threading._shutdown()  # noqa: SLF001 — (Prefect's log and event workers drain there)
        atexit._run_exitfuncs()  # noqa: SLF001 — MLflow's, logging's (the server's was removed above)
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:  # noqa: BLE001
        pass
    return rc

