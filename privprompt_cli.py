"""``privprompt``: run a config's flow in-process, show the budget ledger, open the UIs.

    privprompt run CONFIG [--set dotted.key=value ...]
    privprompt worker [--idle-timeout SECONDS]
    privprompt audit RUN_ID [--shadows K]
    privprompt plan CONFIG [--set dotted.key=value ...]
    privprompt report EXPERIMENT
    privprompt ledger [--config CONFIG] [--json] | ledger import FILE [--key KEYFILE] | ledger set-key KEYFILE
    privprompt key export FILE | key import FILE | key show
    privprompt budget reservations | lower-cap DATASET EPS --reason R | set-delta DATASET DELTA --reason R
                     | set-unit DATASET UNIT --reason R
    privprompt config --schema
    privprompt ui
    privprompt predict MODEL_URI --input FILE [--output FILE] [--batch-size N] [--device cpu|cuda]
    privprompt promote MODEL_URI [--force]
    privprompt retarget MODEL_URI --target MODEL [--steps N]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time


def _user_errors() -> tuple[type[BaseException], ...]:
    from tasks.errors import user_errors

    return user_errors()


def _quiet_user_error_tracebacks(errors) -> None:
    """Log records about a user error (bad input, exhausted budget) carry no traceback: the CLI
    prints the error as one line. Bugs keep their tracebacks. Done in the record factory, so it
    holds for every logger and for handlers Prefect configures later."""
    import logging

    base = logging.getLogRecordFactory()
    if getattr(base, "_privprompt", False):
        return

    def factory(*args, **kwargs):
        record = base(*args, **kwargs)
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and isinstance(exc, errors):
            record.exc_info, record.exc_text = None, None
        return record

    factory._privprompt = True
    logging.setLogRecordFactory(factory)


def _fail(message: str) -> int:
    print(f"privprompt: error: {message}", file=sys.stderr)
    return 2


def _one_line(err: BaseException) -> str:
    text = str(err).splitlines()[0] if str(err).strip() else ""
    return text or type(err).__name__


def _ledger_snapshot(paths) -> dict[str, str]:
    """run id → status of every DP entry of the ledger (before a run: what it changes is its use)."""
    if not paths.ledger_exists():
        return {}
    return {e["run_id"]: e["status"] for e in paths.open_ledger().entries() if e["kind"] == "dp"}


def _budget_used(paths, before: dict[str, str]) -> str:
    """What the ledger's DP entries made or changed since ``before`` say this command used."""
    from tasks.charge import budget_statement

    try:
        if not paths.ledger_exists():
            return "nothing reserved, no ε used"
        changed = [e for e in paths.open_ledger().entries()
                   if e["kind"] == "dp" and before.get(e["run_id"]) != e["status"]]
    except Exception as exc:  # noqa: BLE001 - never hide the run's own error
        return f"unknown (the ledger could not be read: {type(exc).__name__}); see privprompt ledger"
    if not changed:
        return "nothing reserved, no ε used"
    return "; ".join(f"run {e['run_id']}: {budget_statement(e)}" for e in changed)


def _preflight(cfg) -> None:
    """Checks that need no model or Prefect: fail in a second, not after start-up."""
    from tasks.data import find_split_file, resolve_data_folder
    from tasks.errors import DataError
    from tasks.state import default_data_root

    if cfg.data.hub:
        return
    folder = resolve_data_folder(cfg.data, default_data_root(cfg.data_root))
    if not folder.is_dir():
        raise DataError(f"data folder not found: {folder}")
    for split in (cfg.data.train_split, cfg.data.test_split):
        find_split_file(folder, split)


class _local_prefect_server:
    """A Prefect API server on localhost owned by this command, unless PREFECT_API_URL names one
    already. Its URL is exported, so Dask workers (audit shadows) report to it instead of each
    starting a temporary server of its own on the same database.

    :meth:`start` launches it (the same uvicorn command as Prefect's ``SubprocessASGIServer``) and
    returns at once, so its start-up (seconds of imports) overlaps this process's own imports and
    checks; entering the block waits until it answers. Nothing of ``prefect.server`` is imported
    here (seconds more in this process)."""

    def __init__(self):
        self.process = self.settings = self.port = None
        self.started = False

    def start(self) -> "_local_prefect_server":
        if self.started or os.environ.get("PREFECT_API_URL"):
            return self
        import importlib.util
        import socket

        with socket.socket() as sock:  # a free port, as the OS gives one
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        app_dir = os.path.dirname(importlib.util.find_spec("prefect").submodule_search_locations[0])
        env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--app-dir", app_dir, "--factory", "prefect.server.api.server:create_app",
             "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "error", "--lifespan", "on"], env=env)
        self.started = True
        import atexit

        atexit.register(self.stop)
        return self

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def _wait(self) -> None:
        import urllib.error
        import urllib.request

        limit = time.monotonic() + float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180"))
        while time.monotonic() < limit:
            code = self.process.poll()
            if code == 3:  # uvicorn could not bind: the port was taken in between; another one
                self.started = False
                self.start()
                continue
            if code is not None:
                raise RuntimeError(f"the embedded Prefect server exited with code {code} before it answered")
            try:
                with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("timed out waiting for the embedded Prefect server (PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None

    def __enter__(self):
        if os.environ.get("PREFECT_API_URL") and self.process is None:
            return self
        self.start()
        from prefect.settings import (  # imported while the server may still be starting
            PREFECT_API_URL,
            PREFECT_CLIENT_SERVER_VERSION_CHECK_ENABLED,
            PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
            temporary_settings,
        )

        self._wait()
        os.environ["PREFECT_API_URL"] = self.api_url
        # a server this command started from its own Prefect, and that ends with it: no round trip
        # to check its API version, and no flow-run heartbeats (they let a long-lived server tell a
        # crashed run; this one is gone with the run, and the thread that sends them held up the
        # flow's end by up to a second, its sleep step)
        self.settings = temporary_settings(updates={PREFECT_API_URL: self.api_url,
                                                    PREFECT_CLIENT_SERVER_VERSION_CHECK_ENABLED: False,
                                                    PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})
        self.settings.__enter__()
        return self

    def __exit__(self, *exc):
        if self.process is not None:  # send queued run logs while the server still listens
            import logging

            from prefect.logging.handlers import APILogHandler

            for name in [None, *[n for n in logging.root.manager.loggerDict if n.startswith("prefect")]]:
                for handler in logging.getLogger(name).handlers:
                    if isinstance(handler, APILogHandler):
                        handler.flush()
            # and the queued events: left to the interpreter's exit, their worker met a stopped
            # server and retried for seconds before the process could end
            from prefect.events.worker import EventsWorker

            EventsWorker.drain_all(timeout=10)
        if self.settings is not None:
            self.settings.__exit__(*exc)
            self.settings = None
        if self.process is not None:
            os.environ.pop("PREFECT_API_URL", None)
            self.stop()
        return False


def _flow_of(cfg):
    """The flow that runs ``cfg`` (importing it: Prefect, MLflow, the tasks; no server needed)."""
    if cfg.sweep or cfg.seeds or cfg.grid:
        from flows.sweep import sweep_flow

        return sweep_flow
    from flows.method_flow import method_flow

    return method_flow


def _run_flow(cfg, config) -> dict:
    return _flow_of(cfg)(config)


def _print_sweep(summary: dict) -> None:
    from flows.sweep import present_columns, privacy_cells, short_name

    columns = present_columns(summary["variants"])
    print("variant".ljust(40) + "".join(short_name(c).rjust(16) for c in columns) + "  " + "δ".ljust(9) + "unit")
    for row in summary["variants"]:
        cells = "".join(("-" if row.get(c) is None else f"{row[c]:.4f}").rjust(16) for c in columns)
        delta, unit = privacy_cells(row)
        print(row["variant"][:39].ljust(40) + cells + "  " + delta.ljust(9) + unit)
    if any(g["n"] > 1 for g in summary.get("groups", [])):
        print("mean ± std over seeds")
        for g in summary["groups"]:
            cells = "".join(("-" if g[c]["mean"] is None else f"{g[c]['mean']:.4f}±{g[c]['std']:.4f}").rjust(16)
                            for c in columns)
            print(f"{g['group'][:30]} (n={g['n']})".ljust(40) + cells)


AUDIT_NOTE = "(audit statistic, not DP)"


def _print_attacks(m: dict) -> None:
    """Membership-inference and canary statistics: computed on private data without noise, so each
    line says it is an audit statistic, not covered by ε."""
    for attack in ("loss", "loss_pool", "lira", "lira_offline", "min_k"):
        key = f"mia.{attack}.auc"
        if key in m:
            print(f"{key + ':':<28}{m[key]:.4f} [{m[key + '_low']:.4f}, {m[key + '_high']:.4f}] {AUDIT_NOTE}")
    if "audit.epsilon_lower_bound" in m:
        print(f"{'audit.epsilon_lower_bound:':<28}{m['audit.epsilon_lower_bound']:.4f} {AUDIT_NOTE}")


def _print_prompt(published: dict | None, selected: bool = False, fell_back: bool = False) -> None:
    """Where the run's prompt is: the published file and its MLflow artifact, or that it stays private."""
    if not published or published.get("prompt_path") is None:
        why = ("it lost to no prompt in the released holdout comparison: fallback; use the model without a prompt"
               if fell_back else "the selection chose no prompt" if selected else "the method publishes no prompt")
        print(f"{'prompt:':<28}none ({why})")
    elif published.get("prompt_published"):
        print(f"{'published prompt:':<28}{published['prompt_path']}")
        if published.get("artifact_uri"):
            print(f"{'':<28}MLflow artifact {published['artifact_uri']}")
    else:
        print(f"{'prompt (not published):':<28}{published['prompt_path']} (no formal guarantee: it stays under "
              "private/ and is never published)")


def _print_summary(summary: dict, wall: float) -> None:
    m = summary["metrics"]
    if summary.get("method") == "sweep":
        _print_sweep(summary)
    print(f"{'prefect flow run:':<28}{summary['flow_run_id']}")
    print(f"{'mlflow run:':<28}{summary['mlflow_run_id']} (experiment {summary['experiment']!r})")
    if summary.get("method") == "sweep":
        print(f"{'wall time:':<28}{wall:.1f} s")
        return
    if "privacy.epsilon" in m:
        from tasks.statement import epsilon_statement, unit_phrase

        print(f"{'privacy:':<28}" + epsilon_statement(m["privacy.epsilon"], m["privacy.delta"], summary.get("unit"),
                                                      summary.get("accountant"))
              + f"; RDP cross-check ε = {m['privacy.epsilon_rdp']:.4f}")
        if m.get("privacy.epsilon_per_record") is not None:
            print(f"{'':<28}(the mechanism is per record: ε = {m['privacy.epsilon_per_record']:.4f} per record; "
                  f"charged {unit_phrase(summary.get('unit'))} by group privacy)")
    elif summary.get("guarantee") == "ldp":
        print(f"{'privacy:':<28}local d_X privacy of the inputs (metric LDP; no (ε, δ) claim: see the run's params)")
    else:
        note = (summary.get("budget") or {}).get("note") or f"method {summary.get('method', '?')!r} is non-private"
        print(f"{'privacy:':<28}no formal guarantee ({note})")
    for key in sorted(k for k in m if k.startswith("test.accuracy")):
        print(f"{key + ':':<28}{m[key]:.4f}")
    for key in sorted(k for k in m if k.startswith("audit.baseline.")):  # trained on private data without DP
        print(f"{key + ':':<27} {m[key]:.4f} {AUDIT_NOTE}")
    _print_attacks(m)
    if "selection.winner.holdout_score" in m:  # DP-released (noisy) holdout score of the published winner
        ref = m.get("selection.no_prompt.holdout_score")
        print(f"{'selection (released):':<28}published candidate's holdout score "
              f"{m['selection.winner.holdout_score']:.4f}" + ("" if ref is None else f", no prompt {ref:.4f}")
              + " (noisy, DP; params: selection.metric)")
    _print_prompt(summary.get("published"), "selection.winner_index" in m, bool(m.get("no_prompt.fallback")))
    if summary.get("registered_model"):
        print(f"{'registered model:':<28}{summary['registered_model']} (privprompt predict / privprompt serve)")
    for warning in summary.get("warnings", []):
        print(f"{'WARNING:':<28}{warning}")
    if summary.get("device"):
        print(f"{'device:':<28}{summary['device']}")
    seconds = summary.get("compute_seconds", {})
    audit = seconds.get("audit", 0.0)
    compute = sum(v for k, v in seconds.items() if k != "audit")
    print(f"{'wall time:':<28}{wall:.1f} s ({compute:.1f} s model work, "
          + (f"{audit:.1f} s audit, " if "audit" in seconds else "")
          + f"{wall - compute - audit:.1f} s orchestration, tracking and start-up"
          # the comparison with no prompt's time is left out of the published model work (it follows the
          # exact holdout), so it shows here: say so where a run made it
          + (", with the comparison with no prompt" if "no_prompt.released_difference" in m else "") + ")")


def cmd_run(args) -> int:
    from privprompt_worker import ROOT_ENV, STATE_MISMATCH, run_via_worker

    rc = run_via_worker(args.argv, args.config, args.set, args.state_dir)  # a warm worker (privprompt worker)
    if rc is not None:
        return rc
    from tasks.config import load_config
    from tasks.errors import PrivPromptError
    from tasks.state import config_state_paths, configure_environment

    try:
        cfg = load_config(args.config, args.set)
        _preflight(cfg)
    except PrivPromptError as err:
        return _fail(str(err))
    paths = config_state_paths(cfg)
    if os.environ.get(ROOT_ENV) and str(paths.root) != os.environ[ROOT_ENV]:
        return STATE_MISMATCH  # in a worker's child: another state folder than the worker's; the caller runs it
    configure_environment(paths)  # before Prefect is imported (exports the config's ledger.url)
    from privacy import calibration_cache

    calibration_cache.enable(paths.root)  # noise calibrations kept between runs (and plans)
    if not (cfg.sweep or cfg.seeds or cfg.grid):  # a sweep composes every variant's plan in its flow
        refused = _budget_refusal(cfg, paths)  # the ledger's answer in seconds: before any model, server or baseline
        if refused is not None:
            return refused
    server = _local_prefect_server().start()  # starts up while this process imports and checks
    try:
        return _run_with_server(cfg, paths, server)
    finally:
        server.stop()


def _budget_refusal(cfg, paths) -> int | None:
    """The run's plan composed with the ledger (as `privprompt plan`, without the model checks that
    follow): an exit code and one line when it is over the cap or against the dataset's terms."""
    from privacy.ledger import LedgerError
    from tasks.planning import budget_refusal

    try:
        refusal = budget_refusal(cfg, paths)
    except (*_user_errors(), LedgerError) as err:
        return _fail(_one_line(err) + " (budget: nothing reserved, no ε used)")
    return None if refusal is None else _fail(refusal + " (budget: nothing reserved, no ε used)")


def _run_with_server(cfg, paths, server) -> int:
    config = cfg.model_copy(update={"state_dir": str(paths.root)})  # the one parse, handed to the flow as it is

    errors = _user_errors()
    if not (cfg.sweep or cfg.seeds or cfg.grid):  # a sweep checks every variant in its plan
        from tasks.preflight import preflight

        try:  # what `privprompt plan` checks, before the flow starts (models stay cached in-process)
            preflight(cfg)
        except errors as err:
            return _fail(_one_line(err) + " (budget: nothing reserved, no ε used)")
    from tasks.audit import AuditFailure

    started = time.perf_counter()
    before = _ledger_snapshot(paths)
    try:
        _flow_of(cfg)  # its imports (seconds) while the embedded server may still be starting, not after
        with server:
            _quiet_user_error_tracebacks(errors)  # after the server's settings: logging is set up by then
            summary = _run_flow(cfg, config)
    except errors as err:
        return _fail(f"{_one_line(err)} (budget: {_budget_used(paths, before)})")
    except AuditFailure as err:  # measured leakage above the DP claim: loud, distinct exit code
        print(f"privprompt: AUDIT FAILED: {err}", file=sys.stderr)
        print(f"privprompt: budget: {_budget_used(paths, before)}", file=sys.stderr)
        return 3
    except Exception:  # a bug: its traceback, then what the run used
        import traceback

        traceback.print_exc()
        print(f"privprompt: budget: {_budget_used(paths, before)}", file=sys.stderr)
        return 1
    _print_summary(summary, time.perf_counter() - started)
    return 0


def cmd_worker(args) -> int:
    from privprompt_worker import serve
    from tasks.state import configure_environment, state_paths

    paths = state_paths()
    configure_environment(paths)  # before Prefect is imported, as a run does
    return serve(paths, args.idle_timeout, command=main, prefect_server=_local_prefect_server)


def cmd_audit(args) -> int:
    from tasks.state import configure_environment, state_paths

    paths = state_paths(args.state_dir)
    configure_environment(paths)
    errors = _user_errors()
    from tasks.audit import AuditFailure

    started = time.perf_counter()
    try:
        from flows.audit import run_audit, target_from_run

        target, acfg = target_from_run(args.run_id, str(paths.root), args.shadows)
        with _local_prefect_server():
            _quiet_user_error_tracebacks(errors)
            out = run_audit(target, acfg)
    except errors as err:
        return _fail(str(err).splitlines()[0] if str(err) else type(err).__name__)
    except AuditFailure as err:
        print(f"privprompt: AUDIT FAILED: {err}", file=sys.stderr)
        return 3
    m = out["metrics"]
    print(f"{'audited run:':<28}{args.run_id}")
    print(f"{'audit run:':<28}{out['audit_run_id']}")
    _print_attacks(m)
    print(f"{'claimed ε:':<28}{target.epsilon if target.epsilon is not None else 'none (non-private run)'}")
    print(f"{'wall time:':<28}{time.perf_counter() - started:.1f} s")
    return 0


def cmd_plan(args) -> int:
    """The budget plan of a config (every sweep variant and seed): planned ε per run, composed
    with the ledger per dataset. Creates no run, writes nothing, reads no private rows."""
    from tasks.config import load_config, sweep_variants
    from privacy.ledger import LedgerError
    from tasks.planning import format_plan, plan_runs
    from tasks.state import config_state_paths

    try:  # the same rules and checks as `privprompt run`, before its reservation
        cfg = load_config(args.config, args.set)
        _preflight(cfg)
        variants = sweep_variants(cfg) if cfg.sweep or cfg.seeds or cfg.grid else [("", cfg)]
        paths = config_state_paths(cfg)
        from privacy import calibration_cache

        calibration_cache.enable(paths.root)  # the same calibrations as the run's
        plan = plan_runs(variants, paths, largest=True, estimate=True)
    except (*_user_errors(), LedgerError) as err:
        return _fail(_one_line(err))
    print(format_plan(plan))
    _print_dp_icl_plan(cfg, plan, paths)
    _print_public_overlap(cfg)
    print(f"ledger: {paths.ledger_location}" + ("" if paths.ledger_exists() else " (none yet: nothing spent)"))
    return 0 if plan["fits"] else 4


def _print_public_overlap(cfg) -> None:
    """A config with ``public:`` data: how many of its texts are also private records, on this
    terminal only (runs never look: their outcome must not depend on it)."""
    from tasks.data import DataError, public_overlap

    if cfg.public is None:
        return
    try:
        n, shared = public_overlap(cfg)
    except DataError as err:  # the run refuses it in one line; the plan says why here
        print(f"public data: {_one_line(err)}")
        return
    note = ("none is a private record" if not shared else
            f"{shared} of them are also private records; ε holds for public data chosen without looking at the "
            "private data, so if these came from the private side (a copy, an export), they are not public: "
            "remove them")
    print(f"public data: {n} texts, {note} (this line is for this terminal only: runs never compare them)")


def _print_dp_icl_plan(cfg, plan: dict, paths) -> None:
    """A config with a ``dp_icl`` block: what its expected queries spend, served per query."""
    from tasks.config import DPICLConfig
    from tasks.dp_icl import plan_line

    if cfg.dp_icl == DPICLConfig():
        return
    # the dataset's δ as its runs register it, else the config's (what a server on a new dataset uses)
    delta = next((r["delta"] for r in plan["runs"] if r.get("delta")), None) or cfg.privacy.target_delta
    if delta:  # q of sampling: poisson from the released training size the run would publish (never the exact one)
        from tasks.planning import released_sizes

        print(plan_line(cfg, delta, released_sizes(cfg, paths.private)))


def cmd_report(args) -> int:
    """Rebuild the privacy–utility report of an experiment from MLflow alone."""
    from tasks.comparison import log_report, parent_runs
    from tasks.errors import PrivPromptError
    from tasks.record import RunRecord, client, ensure_experiment
    from tasks.state import state_paths

    paths = state_paths(args.state_dir)
    if not paths.mlflow_db.is_file() and not os.environ.get("MLFLOW_TRACKING_URI"):
        return _fail(f"no MLflow store at {paths.mlflow_db}")
    mlflow = client(paths)
    try:
        rows = parent_runs(mlflow, args.experiment)
    except PrivPromptError as err:
        return _fail(str(err))
    if not rows:
        return _fail(f"experiment {args.experiment!r} has no finished method runs")
    record = RunRecord.create(mlflow, ensure_experiment(mlflow, args.experiment, paths), "report",
                              {"flow": "report", "stage": "report"})
    out = log_report(record, rows, f"{args.experiment}: privacy–utility by method")
    from tasks.promotion import production_table, production_versions

    in_production = production_table(production_versions(mlflow, {r["dataset"] for r in rows}))
    record.log_text(in_production, "report/production.md")
    record.end()
    if args.out:  # the same files, for a folder of results (e.g. docs/results/)
        import tempfile
        from pathlib import Path

        dest = Path(args.out)
        dest.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=dest) as tmp:  # MLflow writes <dst>/report/<files>
            fetched = Path(mlflow.download_artifacts(record.run_id, "report", tmp))
            for f in sorted(fetched.iterdir()):  # the report's flat files, replacing older copies
                os.replace(f, dest / f.name)
    from tasks.comparison import add_composed_spend, comparison_table, selection_table

    if paths.ledger_exists():  # each DP run's dataset: its composed spend on this machine's ledger (printed only)
        add_composed_spend(rows, paths.open_ledger())
    print(comparison_table(rows), end="")
    selected = selection_table(rows)
    if selected is not None:  # the published candidates and their DP-released holdout scores
        print(selected, end="")
    print(in_production, end="")
    print(f"{'report run:':<28}{record.run_id} ({out['n_runs']} runs; {out['table']}, {out['figure']})")
    return 0


def cmd_ledger(args) -> int:
    """The ledger's table (and where the ledger lives); with ``--config``, also the largest
    target_epsilon of that config that still fits its dataset (the answer of `privprompt plan`,
    from the same function); ``--json``: the whole ledger (datasets, entries, cap changes, audit
    trail) as JSON for backup; ``import FILE``: restore such a file into an empty ledger;
    ``set-key PATH``: keep a key file as a shared ledger's team key."""
    from privacy.ledger import LedgerError
    from tasks.state import config_state_paths, state_paths

    paths = state_paths(args.state_dir)
    command = getattr(args, "ledger_command", None)
    try:
        if command == "import":
            return _ledger_import(paths, args)
        if command == "set-key":
            return _ledger_set_key(paths, args)
        largest = {}
        if args.config:
            from tasks.config import load_config
            from tasks.planning import plan_runs

            cfg = load_config(args.config, args.set)
            _preflight(cfg)
            paths = config_state_paths(cfg)
            plan = plan_runs([("", cfg)], paths, largest=True)
            largest = {k: f"{d['largest_hint']} for {args.config}" for k, d in plan["datasets"].items()
                       if d.get("largest_hint")}
        if args.out and not args.json:
            return _fail("--out writes the --json export: privprompt ledger --json --out FILE")
        if not paths.ledger_exists():
            if args.json:
                return _emit_export({"format": "privprompt-ledger", "ledger": paths.ledger_location, "datasets": [],
                                     "entries": [], "cap_changes": [], "trail": []}, args.out)
            print(f"no ledger yet at {paths.ledger_location}: no run has used private data")
            for hint in largest.values():
                print(hint)
            return 0
        ledger = paths.open_ledger()
        if args.json:
            return _emit_export(ledger.export(), args.out)
        print(ledger.summary_table(largest), end="")
        _print_inference_spend(ledger)
        print(_production_lines(paths, {d["name"] for d in ledger.datasets()}), end="")
        print(f"ledger: {paths.ledger_location}" + (" (shared; its team key: privprompt key show)"
                                                   if paths.ledger_is_shared else " (this state folder's own)"))
    except (*_user_errors(), LedgerError) as err:
        return _fail(_one_line(err))
    return 0


def _print_inference_spend(ledger) -> None:
    """Datasets charged at inference time (dp_icl's answered batches): the queries and batches, and
    their ε alone — a spend that grows with every answer, unlike a run's."""
    from privacy import accountant as acct
    from privacy.events import ComposedEvent, event_from_dict
    from tasks.dp_icl import answered_queries

    for row in ledger.datasets():
        # a batch that failed after its read stays reserved, and spent: counted with the committed ones
        batches = [e for e in ledger.entries(row["fingerprint"]) if e["kind"] == "dp"
                   and e["status"] in ("committed", "reserved") and str(e.get("description") or "").startswith("dp_icl:")]
        if not batches:
            continue
        events = [event_from_dict(e["event"]) for e in batches]  # each batch: its votes, one Gaussian each
        compares = [e for e in batches if str(e.get("description")).startswith("dp_icl: comparison")]
        answered = [e for e in batches if e not in compares]
        queries = sum(answered_queries(event_from_dict(e["event"])) for e in answered)
        stopped = sum(answered_queries(event_from_dict(e["event"])) for e in answered if e["status"] == "reserved")
        eps = acct.spend(ComposedEvent(tuple(events)), row["delta"]).epsilon
        unanswered = f" ({stopped} of them in batches not committed: stopped, or under way)" if stopped else ""
        unit = "per record" if row["unit"] == "record" else "per " + row["unit"]
        held = sum(answered_queries(event_from_dict(e["event"])) for e in compares)
        open_ = sum(e["status"] == "reserved" for e in compares)
        compared = (f" and {len(compares)} comparison{'' if len(compares) == 1 else 's'} with zero-shot ({held} held-out "
                    f"queries in all and a released count each{f'; {open_} not committed' if open_ else ''})"
                    if compares else "")
        print(f"inference-time spend on {row['name']!r}: {queries} queries charged to dp_icl{unanswered} in "
              f"{len(answered)} batch{'' if len(answered) == 1 else 'es'}{compared}, ε={eps:.4f} {unit} at "
              f"δ={row['delta']:g} on their own (included above)")


def _production_lines(paths, datasets: set[str]) -> str:
    """Which registered version of each of ``datasets`` is in production (the MLflow registry's
    alias), for ``privprompt ledger``; nothing when this state folder has no MLflow store."""
    remote = os.environ.get("MLFLOW_TRACKING_URI")
    if not paths.mlflow_db.is_file() and not remote:
        return ""
    from tasks.promotion import production_table, production_versions, production_versions_local

    rows = None if remote else production_versions_local(paths.mlflow_db, datasets)  # no MLflow import
    try:
        if rows is None:
            from tasks.record import client

            rows = production_versions(client(paths), datasets)
        return production_table(rows)
    except Exception as exc:  # noqa: BLE001 - the ledger's table stands without the registry
        return f"in production: unknown (the MLflow registry could not be read: {type(exc).__name__})\n"


def _emit_export(data: dict, out: str | None) -> int:
    """The ledger's JSON export on stdout, or (``out``) in a new file of mode 0600 — it holds the keyed
    record digests (membership-sensitive with the key), so it is never left to the shell's umask —
    written whole or not at all, and never over an existing file (a backup is not replaced)."""
    import json
    import tempfile
    from pathlib import Path

    text = json.dumps(data, indent=1, ensure_ascii=False) + "\n"
    if out is None:
        print(text, end="")
        return 0
    target = Path(out).expanduser()
    if target.exists() or target.is_symlink():
        return _fail(f"{target} exists: refusing to replace it (a ledger backup is never overwritten); "
                     "give a new file name or move it away")
    if not target.parent.is_dir():
        return _fail(f"cannot write {target}: no folder {target.parent}")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".ledger-", dir=target.parent)
    except OSError as exc:
        return _fail(f"cannot write {target}: {exc.strerror}")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.link(tmp, target)  # atomic, and never over a file made meanwhile
    except FileExistsError:
        return _fail(f"{target} exists: refusing to replace it (a ledger backup is never overwritten)")
    except OSError as exc:
        return _fail(f"cannot write {target}: {exc.strerror}")
    finally:
        os.unlink(tmp)
    print(f"ledger export written to {target} (mode 0600; with the key it tells who is in the data: keep it "
          "where only the people who may see the data can read it)")
    return 0


def _warn_open_key_file(source: str, where) -> None:
    """After importing ``source``: one warning line when it was open to others than its owner."""
    from tasks.state import key_file_exposure

    exposed = key_file_exposure(source)
    if exposed:
        print(f"privprompt: warning: {exposed}: the key was imported and is kept 0600 in {where}; delete {source} "
              "now (anyone who read it can, with the ledger, tell whether a text is in the data)", file=sys.stderr)


def _ledger_import(paths, args) -> int:
    import json

    try:
        with open(args.file, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError) as exc:
        return _fail(f"cannot read ledger export {args.file}: {exc}")
    key = None
    if args.key:
        from tasks.state import read_key_file

        if not paths.ledger_is_shared:
            return _fail(f"--key is for a shared ledger; this state folder's own ledger uses "
                         f"{paths.installation_key}: privprompt key import {args.key}")
        key = read_key_file(args.key, private=False)  # kept 0600 by import_key below (warned when open)
    counts = paths.open_ledger().import_ledger(data, team_key=key)
    kept = ""
    if key is not None:  # the ledger records the key's id; the key goes to this machine's key file
        from tasks.state import import_key

        key_id, where = import_key(paths, args.key)
        kept = f"; team key {key_id} kept in {where} (never in the ledger)"
        _warn_open_key_file(args.key, where)
    print(f"imported into {paths.ledger_location}: " + ", ".join(f"{n} {t}" for t, n in counts.items()) + kept)
    return 0


def _ledger_set_key(paths, args) -> int:
    if not paths.ledger_is_shared:
        return _fail(f"set-key is for a shared ledger (ledger.url / $PRIVPROMPT_LEDGER_URL); this state folder's "
                     f"ledger uses {paths.installation_key}: privprompt key import {args.key_file}")
    return _key_import(paths, args.key_file)


def _key_import(paths, source: str) -> int:
    from tasks.state import import_key

    key_id, where = import_key(paths, source)
    print(f"key {key_id} kept in {where} (mode 0600) for ledger {paths.ledger_location}; the ledger records its id "
          "only. Delete the copy you brought here once it is imported.")
    _warn_open_key_file(source, where)
    return 0


def cmd_key(args) -> int:
    """The key of keyed record digests, fingerprints and splits of this state folder's ledger, which
    never sits in the ledger's database: ``export FILE`` writes it (mode 0600) for a team member,
    ``import FILE`` keeps a key brought from the team (checked against the ledger's key id),
    ``show`` says which key is in use and where it lives (never the key)."""
    from privacy.ledger import LedgerError, key_id_of
    from tasks.state import TEAM_KEY_FILE_ENV, export_key, ledger_key, state_paths

    paths = state_paths(args.state_dir)
    try:
        if args.key_command == "export":
            key_id, where = export_key(paths, args.file)
            print(f"key {key_id} of ledger {paths.ledger_location} written to {where} (mode 0600). With the ledger's "
                  "database it tells whether any text is in the data: hand it only to the team's machines, privately, "
                  "and there run: privprompt key import FILE")
            return 0
        if args.key_command == "import":
            return _key_import(paths, args.file)
        key = ledger_key(paths, mint=False)
        key_id = key_id_of(key)
        if paths.ledger_is_shared:
            where = paths.team_key_file(key_id)
            note = f" ({TEAM_KEY_FILE_ENV})" if os.environ.get(TEAM_KEY_FILE_ENV) else ""
            print(f"team key {key_id} of shared ledger {paths.ledger_location}: {where}{note}")
        else:
            print(f"key {key_id} of this state folder's own ledger {paths.ledger_location}: {paths.installation_key}")
    except (*_user_errors(), LedgerError) as err:
        return _fail(_one_line(err))
    return 0


def cmd_budget(args) -> int:
    """Deliberate changes to the ledger, each recorded: lower a dataset's cap, compose a dataset at
    a smaller δ (a larger one raises its budget and is refused here, as a cap raise is; neither
    ever lowers what it has spent), release the reservation of a run that died before its first
    private read; and the list of open reservations."""
    from privacy.ledger import LedgerError
    from tasks.state import state_paths

    paths = state_paths(args.state_dir)
    if not paths.ledger_exists():
        return _fail(f"no ledger at {paths.ledger_location}: no run has used private data")
    try:
        ledger = paths.open_ledger()
        if args.budget_command == "reservations":
            rows = ledger.open_reservations()
            if not rows:
                print("no open reservations")
            for e in rows:
                read = (f"began reading private data at {e['read_started_at']}: counted in full"
                        if e["read_started_at"] else "has not read private data yet")
                print(f"{e['dataset']} ({e['fingerprint'][:12]})  run {e['run_id']}  ε={e['epsilon']:.4f}  "
                      f"since {e['created_at']}  {read}")
            return 0
        if args.budget_command == "release":  # a run killed before its first private read (kill -9 cannot release)
            entry = ledger.release(args.run, args.reason)
            print(f"run {entry['run_id']}: its reservation of ε={entry['epsilon_reserved']:.4f} on dataset "
                  f"{entry['dataset']!r} is released (recorded with the reason)")
            return 0
        dataset = ledger.find_dataset(args.dataset)
        if args.budget_command == "lower-cap":
            row = ledger.lower_cap(dataset["fingerprint"], args.epsilon, args.reason)
        elif args.budget_command == "set-unit":
            row = ledger.change_unit(dataset["fingerprint"], args.unit, args.reason)
            print(f"dataset {row['name']} ({row['fingerprint'][:12]}): privacy unit {row['unit']!r} (its cap "
                  f"ε={row['epsilon_cap']:g} is per {'record' if row['unit'] == 'record' else 'person'}; recorded)")
            return 0
        else:
            row = ledger.change_delta(dataset["fingerprint"], args.delta, args.reason)
    except (*_user_errors(), LedgerError, ValueError) as err:
        return _fail(_one_line(err))
    print(f"dataset {row['name']} ({row['fingerprint'][:12]}): cap ε={row['epsilon_cap']:g} at δ={row['delta']:g}, "
          f"spent ε={row['spent_epsilon']:.4f} (recorded in the ledger's cap changes)")
    return 0


def cmd_config(args) -> int:
    """``--schema``: the config reference (every key, type, default, constraint and meaning) as
    Markdown, generated from the pydantic schema; docs/config.md is this output."""
    from tasks.config_reference import markdown

    print(markdown(), end="")
    return 0


def cmd_ui(args) -> int:
    from tasks.state import configure_environment, state_paths, tracking_uri

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
        subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", tracking_uri(paths),
                          "--host", "127.0.0.1", "--port", str(args.mlflow_port)], env=env, start_new_session=True),
    ]
    print(f"Prefect UI: http://127.0.0.1:{args.prefect_port}   MLflow UI: http://127.0.0.1:{args.mlflow_port}"
          "   (Ctrl-C stops both)", flush=True)

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        while all(p.poll() is None for p in procs):
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
    return 0


def serve_command(model_dir: str, host: str, port: int) -> tuple[list[str], dict[str, str]]:
    """``mlflow models serve`` of a downloaded pyfunc folder, from this project's environment: its
    Python (``-m mlflow``), its ``bin`` first on PATH (the server execs ``uvicorn`` by name: without
    the venv activated it was not found) and the project importable (the model's code)."""
    env = dict(os.environ)
    bin_dir = os.path.dirname(os.path.abspath(sys.executable))
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    root = os.path.dirname(os.path.abspath(__file__))
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
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)


def _read_table(path: str):
    """A JSONL / JSON / CSV / Parquet file as a DataFrame (by its extension)."""
    import pandas as pd

    suffix = os.path.splitext(path)[1].lower()
    readers = {".jsonl": lambda: pd.read_json(path, lines=True), ".json": lambda: pd.read_json(path, lines=True),
               ".csv": lambda: pd.read_csv(path), ".parquet": lambda: pd.read_parquet(path)}
    if suffix not in readers:
        raise ValueError(f"{path}: unknown input format {suffix!r} (JSONL, CSV or Parquet)")
    return readers[suffix]()


# predict's output writers by extension: what _check_output accepts is what _write_table writes
_WRITERS = {".jsonl": lambda frame, path: frame.to_json(path, orient="records", lines=True, force_ascii=False),
            ".json": lambda frame, path: frame.to_json(path, orient="records", lines=True, force_ascii=False),
            ".csv": lambda frame, path: frame.to_csv(path, index=False),
            ".parquet": lambda frame, path: frame.to_parquet(path, index=False)}


def _check_output(path: str | None) -> None:
    """An output path predict can write, checked before any model loads or any query is charged."""
    if path is None:
        return
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in _WRITERS:
        raise ValueError(f"--output {path}: unknown output format {suffix!r} (JSONL, CSV or Parquet)")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--output {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"--output {path}: not writable")


def _positive_int(value: str) -> int:
    """An argparse type: an integer of at least 1 (a refusal is argparse's one line)."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def _write_table(frame, path: str | None) -> None:
    if path is None:
        sys.stdout.write(frame.to_json(orient="records", lines=True, force_ascii=False))
        return
    previous = os.umask(0o077)  # the file holds the input texts (a team's private queries): its owner's alone
    try:
        _WRITERS[os.path.splitext(path)[1].lower()](frame, path)  # the suffix checked by _check_output
    finally:
        os.umask(previous)
    os.chmod(path, 0o600)  # a file that was there before keeps its old mode otherwise


def _model_load_error(exc: BaseException):
    from models.backbones import ModelLoadError

    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, ModelLoadError):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def cmd_predict(args) -> int:
    """Labels and per-label scores of a registered model (``models:/NAME/VERSION`` or ``/latest``,
    ``runs:/…``) for the ``text`` column of a file (``--text-field``); an input ``label`` column
    (``--label-field``) gives the accuracy."""
    from tasks.registry_model import input_texts
    from tasks.state import state_paths

    if args.device:
        os.environ["PRIVPROMPT_DEVICE"] = args.device
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # our own progress line only
    try:
        _check_output(args.output)
    except ValueError as exc:
        return _fail(str(exc))
    try:
        frame = _read_table(args.input)
        texts = input_texts(frame, args.text_field)
    except (OSError, ValueError, KeyError) as exc:
        return _fail(f"cannot read {args.input}: {_one_line(exc)}")
    if args.dp_icl:
        return _predict_dp_icl(args, frame, texts)
    if not args.model_uri:
        return _fail("predict needs a MODEL_URI (models:/NAME/VERSION), or --dp-icl CONFIG")
    import tempfile

    import mlflow.pyfunc

    from tasks.record import client
    from tasks.registry_model import download_model

    try:
        with tempfile.TemporaryDirectory(prefix="privprompt-model-") as tmp:
            model = mlflow.pyfunc.load_model(str(download_model(client(state_paths(args.state_dir)),
                                                                args.model_uri, tmp)))
    except Exception as exc:  # noqa: BLE001 - reported as one line
        cause = _model_load_error(exc)
        if cause is not None:
            return _fail(_one_line(cause))
        return _fail(f"cannot load {args.model_uri}: {_one_line(exc)}")
    predictor = model.unwrap_python_model().predictor
    started = time.perf_counter()

    def progress(done: int, total: int) -> None:
        print(f"\rpredict: {done}/{total} texts ({time.perf_counter() - started:.1f} s)", end="",
              file=sys.stderr, flush=True)

    out = predictor.predict(texts, args.batch_size, progress)
    print(file=sys.stderr)
    result = frame.copy()
    result["prediction"] = out["label"].to_numpy()
    for column in out.columns[1:]:
        result[column] = out[column].to_numpy()
    _write_table(result, args.output)
    if args.label_field in frame.columns and len(frame):
        acc = float((frame[args.label_field].astype(str).to_numpy() == out["label"].to_numpy()).mean())
        print(f"accuracy on the {len(frame)} rows' {args.label_field} column: {acc:.4f}", file=sys.stderr)
    if args.output:
        print(f"predictions of {len(texts)} texts on {predictor.classifier.device}: {args.output}", file=sys.stderr)
    return 0


NOT_COMPARED = ("dp_icl: WARNING these answers were not compared with zero-shot (no demonstration) on your data "
                "(dp_icl.compare_queries or fallback.epsilon_share is 0): nothing checks they are better; "
                "demonstrations can hurt (AG News in docs/results/dp_icl/)")


def _predict_dp_icl(args, frame, texts) -> int:
    """``predict --dp-icl CONFIG``: DP-ICL's answers, every batch charged to the config's ledger."""
    from tasks.config import load_config
    from tasks.dp_icl import answer_all, comparison_line, open_server
    from tasks.state import state_paths

    if not texts:  # before anything is read or charged: the comparison with zero-shot would spend for nothing
        return _fail(f"predict --dp-icl: {args.input} holds no rows: nothing to answer, nothing charged")
    missing = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
    if missing is not None:  # a missing value (NaN) would crash a charged batch
        return _fail(f"predict --dp-icl: row {missing + 1} of {args.input} has no text in {args.text_field!r}: "
                     "nothing answered, nothing charged")
    cfg = load_config(args.dp_icl)
    paths = state_paths(args.state_dir or cfg.state_dir, cfg.ledger.url)
    try:
        served = open_server(cfg, paths)
    except KeyboardInterrupt:
        _fail("dp_icl: interrupted before any charge: nothing answered, nothing charged")
        return 130

    def interrupt(signum, frame):  # SIGTERM as Ctrl-C: the answers already charged are written, not lost
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    compared_now = bool(served.compare_queries)
    try:
        answers, refusal = answer_all(served, texts, args.batch_size, _dp_icl_progress(time.perf_counter()))
    except KeyboardInterrupt as stop:  # in the check before any charge
        answers, refusal = [], stop
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(file=sys.stderr)
    result = frame.iloc[:len(answers)].copy()  # a refusal mid-way: the answers already charged, never lost
    result["prediction"] = answers
    _write_table(result, args.output)
    if refusal is not None:
        return _dp_icl_stopped(served, refusal, len(answers), len(texts), compared_now)
    spent = served.server.ledger.spent(served.server.fingerprint)
    how = ("zero-shot (no demonstration), nothing charged for them" if _dp_icl_fell_back(served)
           else f"in {-(-len(texts) // args.batch_size)} charged batch(es)")
    print(f"dp_icl: {len(texts)} queries answered {how}; dataset {served.dataset!r} has now spent "
          f"ε={spent.epsilon:.4f} per record at δ={served.delta:g} of its cap ε={served.cap:.4f} (privprompt ledger)",
          file=sys.stderr)
    print(NOT_COMPARED if served.comparison is None else comparison_line(served.comparison, served.fallback),
          file=sys.stderr)
    if args.label_field in frame.columns and len(frame):
        acc = float((frame[args.label_field].astype(str).to_numpy() == result["prediction"].to_numpy()).mean())
        print(f"accuracy on the {len(frame)} rows' {args.label_field} column: {acc:.4f}", file=sys.stderr)
    return 0


def _dp_icl_fell_back(served) -> bool:
    return served.comparison is not None and served.comparison["difference"] < 0 and served.fallback


def _dp_icl_progress(started: float):
    """dp_icl's progress line: the answers with their seconds, counted from the first answer; the
    held-out comparison only at its start and end, with no time (its rows' times follow their private
    lengths, and its total the number of real rows among the padding)."""
    clock = {"start": started}

    def progress(done: int, total: int, stage: str = "answers") -> None:
        if stage == "comparison":
            if done == 1:
                print(f"dp_icl: comparing with zero-shot on {total} held-out queries …", file=sys.stderr, flush=True)
            if done == total:
                print(f"dp_icl: {total}/{total} held-out queries compared with zero-shot", file=sys.stderr, flush=True)
                clock["start"] = time.perf_counter()
        else:
            print(f"\rdp_icl: {done}/{total} queries answered ({time.perf_counter() - clock['start']:.1f} s)", end="",
                  file=sys.stderr, flush=True)

    return progress


def _dp_icl_stopped(served, refusal, answered: int, total: int, compared_now: bool) -> int:
    """The one line of a dp_icl predict that stopped: what was answered and charged, and why."""
    from privacy.ledger.errors import BudgetExceededError

    charged = "answered zero-shot (not charged)" if _dp_icl_fell_back(served) else "answered and charged"
    comparing = bool(served.compare_queries)  # the comparison was due and did not finish
    if isinstance(refusal, KeyboardInterrupt):
        open_ = served.server.open_charge  # a reservation not committed: spent, unanswered
        if comparing:
            tail = ("; the comparison with zero-shot under way stays charged (privprompt ledger)" if open_ else
                    "; the comparison with zero-shot had not been charged yet: nothing charged")
        else:
            tail = ("; the comparison with zero-shot before them was charged and kept" if compared_now else "")
            tail += ("; the batch under way stays charged, unanswered (privprompt ledger)" if open_ else "")
        _fail(f"dp_icl: interrupted: {answered} of {total} queries {charged} (written){tail}")
        return 130
    why = ("another spend on the dataset took the room left" if isinstance(refusal, BudgetExceededError)
           else "the next batch failed")
    compared = ("" if served.comparison is None or not compared_now else
                "; the comparison with zero-shot before them was charged and kept")
    if comparing:  # it did not finish: charged all the same once reserved (its reservation stays spent)
        why = ("the comparison with zero-shot before them failed (charged: its reservation stays spent)"
               if served.server.open_charge else
               "the comparison with zero-shot before them was refused before its charge (nothing charged)")
    return _fail(f"dp_icl: {answered} of {total} queries {charged} (written){compared}, then {why}: "
                 f"{_one_line(refusal)}")


def _canary_runner(paths):
    """What ``promote`` calls when the DP run has no canary audit logged: the run's canary audit
    now (``tasks.audit.canary_audit``: its planted canaries scored once), recorded in the ledger as a
    non-private use and logged on the run as ``audit.epsilon_lower_bound``."""

    def run(run_id: str):
        import uuid
        from pathlib import Path

        from flows.audit import target_from_run
        from tasks.audit import AuditError, AuditFailure, canary_audit
        from tasks.record import client
        from tasks.release_gates import CanaryAuditFailed

        try:
            target, acfg = target_from_run(run_id, str(paths.root), check=False)
        except AuditError as err:
            return None, _one_line(err)
        except Exception as err:  # noqa: BLE001 - the gate says why no audit ran, in one line
            return None, f"{type(err).__name__}: {_one_line(err)}"
        if not Path(target.part.canaries_path).is_file():
            return None, "the run planted no canaries (data.canaries)"
        paths.open_ledger().record_nonprivate(target.part.dataset_key, f"promote-{uuid.uuid4().hex[:12]}:canary-audit",
                                              f"canary audit of run {run_id} by privprompt promote (not DP)")
        try:
            result = canary_audit(target, acfg)
        except AuditFailure as err:
            raise CanaryAuditFailed(_one_line(err)) from None
        client(paths).log_metric(run_id, "audit.epsilon_lower_bound", result["epsilon_lower_bound"])
        return result["epsilon_lower_bound"], ""

    return run


def cmd_promote(args) -> int:
    """Run the release gates on a registered version and move the alias ``production`` to it when
    none failed (``--force``: despite failures, recorded). One line per gate; exit 5 when refused."""
    from tasks.promotion import promote
    from tasks.record import client
    from tasks.state import state_paths

    paths = state_paths(args.state_dir)
    if not paths.mlflow_db.is_file() and not os.environ.get("MLFLOW_TRACKING_URI"):
        return _fail(f"no MLflow store at {paths.mlflow_db}")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one line per gate, nothing else
    from mlflow.exceptions import MlflowException

    try:
        out = promote(client(paths), args.model_uri, force=args.force, canary_runner=_canary_runner(paths))
    except (ValueError, MlflowException) as err:
        return _fail(_one_line(err))
    for gate in out.gates:
        print(gate.line())
    uri = f"models:/{out.name}/{out.version}"
    if not out.promoted:
        print(f"privprompt: refused: {uri} stays out of production ({len(out.failed)} gate(s) failed; "
              "--force promotes it with the failures recorded)", file=sys.stderr)
        return 5
    forced = f" with --force despite failed gates: {', '.join(g.name for g in out.failed)}" if out.forced else ""
    print(f"promoted {uri}: models:/{out.name}@production{forced}")
    return 0


def cmd_retarget(args) -> int:
    """Move a registered version's prompt to another backbone on public data only (POST's transfer
    for a soft prompt; a text prompt as it is) and register it as a new version: no ε, no ledger entry."""
    from tasks.record import client
    from tasks.retarget import retarget
    from tasks.state import state_paths

    paths = state_paths(args.state_dir)
    if not paths.mlflow_db.is_file() and not os.environ.get("MLFLOW_TRACKING_URI"):
        return _fail(f"no MLflow store at {paths.mlflow_db}")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    started = time.perf_counter()
    from mlflow.exceptions import MlflowException

    try:
        out = retarget(client(paths), paths, args.model_uri, args.target, steps=args.steps)
    except (*_user_errors(), ValueError, OSError, MlflowException) as err:
        return _fail(_one_line(err))
    v = out.version
    print(f"{'retargeted:':<28}{args.model_uri} → {args.target} ({'POST transfer on public data' if out.kind == 'soft' else 'the instruction on the new target'})")
    print(f"{'new version:':<28}models:/{v.name}/{v.version} (alias candidate; privprompt promote runs its gates)")
    print(f"{'privacy:':<28}ε = {v.tags.get('privacy.epsilon')}, δ = {v.tags.get('privacy.delta')} (the parent's: "
          "post-processing, no ε spent, no ledger entry)")
    for key, label in (("retarget.public.accuracy", "public accuracy:"),
                       ("retarget.public.no_prompt.accuracy", "  no prompt's:")):
        if key in out.metrics:
            print(f"{label:<28}{out.metrics[key]:.4f} ({key}: labelled public rows)")
    print(f"{'wall time:':<28}{time.perf_counter() - started:.1f} s")
    return 0


def _exit_now(rc: int) -> None:
    """End the process once the command is done: what a normal exit runs that matters (threads'
    exit hooks — Prefect's event and log workers drain there — and atexit handlers: MLflow's,
    logging's), then ``os._exit``, skipping the interpreter's teardown of torch, transformers, MLflow
    and Prefect modules, which took 3–7 s of a smoke run with no effect on any file."""
    import atexit
    import threading

    sys.stdout.flush()
    sys.stderr.flush()
    threading._shutdown()  # noqa: SLF001 - the same call Py_FinalizeEx makes first
    atexit._run_exitfuncs()  # noqa: SLF001
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def _add_run_commands(sub) -> None:
    """run, worker, audit, plan and report."""
    run = sub.add_parser("run", help="run a config's flow in-process (embedded Prefect, local MLflow)")
    run.add_argument("config")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config key, e.g. --set privacy.target_epsilon=4")
    worker = sub.add_parser("worker", help="keep the imports and a Prefect server warm for this state folder's runs "
                                           "(`privprompt run` hands its run to it: a forked process per run)")
    worker.add_argument("--idle-timeout", type=float, default=1800.0, help="stop after this many seconds without a run")
    audit = sub.add_parser("audit", help="membership-inference audit of a finished run's published prompt")
    audit.add_argument("run_id")
    audit.add_argument("--shadows", type=int, default=None, help="shadow prompts for LiRA (even; default: the run's config)")
    plan = sub.add_parser("plan", help="planned ε of a config's runs, composed with the ledger (dry run)")
    plan.add_argument("config")
    plan.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    report = sub.add_parser("report", help="privacy–utility table and figure of an experiment, from MLflow")
    report.add_argument("experiment")
    report.add_argument("--out", default=None, help="also write the report's table and figures to this folder")


def _add_ledger_commands(sub) -> None:
    """ledger (with import and set-key)."""
    ledger = sub.add_parser("ledger", help="DP spend per dataset against its cap, and non-private uses")
    ledger.add_argument("--config", default=None, help="also say the largest target_epsilon of this config that fits")
    ledger.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ledger.add_argument("--json", action="store_true", help="the whole ledger (datasets, entries, cap changes, audit "
                                                            "trail) as JSON, for backup")
    ledger.add_argument("--out", default=None, metavar="FILE", help="with --json: write it to FILE, a new file of mode "
                                                                    "0600 (never over an existing one)")
    ledger_sub = ledger.add_subparsers(dest="ledger_command")
    restore = ledger_sub.add_parser("import", help="restore a `privprompt ledger --json` file into an empty ledger")
    restore.add_argument("file")
    restore.add_argument("--key", default=None, help="a shared ledger: also import this key file (the installation.key "
                                                     "the imported fingerprints were made with) as the team key "
                                                     "(privprompt key import)")
    setkey = ledger_sub.add_parser("set-key", help="a shared ledger: privprompt key import KEYFILE (the key its "
                                                   "registered fingerprints were made with)")
    setkey.add_argument("key_file")


def _add_key_commands(sub) -> None:
    """key export / import / show."""
    key = sub.add_parser("key", help="the key of the ledger's keyed record digests (never in the ledger): export it "
                                     "for the team, import it on a machine that joins, show which is in use")
    key_sub = key.add_subparsers(dest="key_command", required=True)
    key_export = key_sub.add_parser("export", help="write the ledger's key to FILE (mode 0600; a new team ledger's key "
                                                   "is created here) for the team's machines")
    key_export.add_argument("file")
    key_import = key_sub.add_parser("import", help="keep the key in FILE as this machine's key for the ledger (checked "
                                                   "against the key id the ledger records)")
    key_import.add_argument("file")
    key_sub.add_parser("show", help="which key the ledger's datasets are keyed with, and where it lives (never the key)")


def _add_budget_commands(sub) -> None:
    """budget reservations / release / lower-cap / set-delta / set-unit."""
    budget = sub.add_parser("budget", help="open reservations; lower a cap; compose a dataset at a smaller δ")
    budget_sub = budget.add_subparsers(dest="budget_command", required=True)
    budget_sub.add_parser("reservations", help="runs holding a reservation (running, or stopped after reading data)")
    release = budget_sub.add_parser(
        "release", help="release the open reservation of a run that died before its first private read (a run killed "
                        "outright cannot release its own); refused once the run began reading private data")
    release.add_argument("run", help="the run's ledger id, <flow run id>:<method> (privprompt budget reservations)")
    release.add_argument("--reason", required=True, help="why (recorded in the ledger)")
    lower = budget_sub.add_parser("lower-cap", help="lower a dataset's ε cap (recorded)")
    lower.add_argument("dataset", help="dataset name or fingerprint prefix (privprompt ledger)")
    lower.add_argument("epsilon", type=float)
    lower.add_argument("--reason", required=True, help="why (recorded in the ledger)")
    redelta = budget_sub.add_parser("set-delta", help="compose a dataset at a smaller δ from now on (recorded; its "
                                                      "spent ε never drops); a larger δ raises the budget and is "
                                                      "refused, like a cap raise")
    redelta.add_argument("dataset", help="dataset name or fingerprint prefix (privprompt ledger)")
    redelta.add_argument("delta", type=float)
    redelta.add_argument("--reason", required=True, help="why (recorded in the ledger)")
    reunit = budget_sub.add_parser("set-unit", help="set the privacy unit (record, or the field naming a person) of "
                                                    "a dataset nothing is charged to yet (recorded)")
    reunit.add_argument("dataset", help="dataset name or fingerprint prefix (privprompt ledger)")
    reunit.add_argument("unit", help="record, or the data.privacy_unit field")
    reunit.add_argument("--reason", required=True, help="why (recorded in the ledger)")


def _add_tool_commands(sub) -> None:
    """config, ui, predict and serve."""
    config = sub.add_parser("config", help="the config reference, generated from the schema (docs/config.md)")
    config.add_argument("--schema", action="store_true", required=True,
                        help="print every config key with its type, default and meaning as Markdown")
    ui = sub.add_parser("ui", help="start the Prefect server and the MLflow UI on localhost")
    ui.add_argument("--prefect-port", type=int, default=4200)
    ui.add_argument("--mlflow-port", type=int, default=5000)
    predict = sub.add_parser("predict", help="labels and scores of a registered model for a JSONL / CSV / Parquet "
                                             "file's text column")
    predict.add_argument("model_uri", nargs="?", help="models:/NAME/VERSION (or /latest), as `privprompt run` "
                         "registered it (not with --dp-icl)")
    predict.add_argument("--dp-icl", metavar="CONFIG", default=None, help="answer by DP-ICL over CONFIG's private "
                         "dataset (its dp_icl block): every batch is charged to the ledger, refused past the cap")
    predict.add_argument("--input", required=True, help="JSONL, CSV or Parquet with a 'text' column (or --text-field)")
    predict.add_argument("--text-field", default="text", metavar="NAME", help="the input's text column (default: text; "
                         "e.g. the config's data.text_field)")
    predict.add_argument("--label-field", default="label", metavar="NAME", help="a column of true labels: the accuracy "
                         "is printed when present (default: label)")
    predict.add_argument("--output", default=None, help="JSONL, CSV or Parquet (default: JSONL on stdout)")
    predict.add_argument("--batch-size", type=_positive_int, default=64)
    predict.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: CUDA when available)")
    serve = sub.add_parser("serve", help="serve a registered model over HTTP on localhost (mlflow models serve from "
                                         "this environment)")
    serve.add_argument("model_uri", help="models:/NAME/VERSION (or /latest), as `privprompt run` printed it")
    serve.add_argument("--port", type=int, default=5001)
    serve.add_argument("--host", default="127.0.0.1", help="default: localhost only")


def _add_registry_commands(sub) -> None:
    """promote and retarget (the MLflow registry's versions)."""
    promote = sub.add_parser("promote", help="run the release gates on a registered version and move the alias "
                                             "'production' to it when none fails")
    promote.add_argument("model_uri", help="models:/NAME/VERSION, models:/NAME/latest or models:/NAME@candidate")
    promote.add_argument("--force", action="store_true", help="promote despite failed gates (recorded in the "
                                                              "version's tags and model card)")
    retarget = sub.add_parser("retarget", help="move a registered version's prompt to another backbone on public "
                                               "data only and register it (no ε, no ledger entry)")
    retarget.add_argument("model_uri", help="models:/NAME/VERSION, models:/NAME/latest or models:/NAME@production")
    retarget.add_argument("--target", required=True, help="the backbone to move it to (a model name, as models.target)")
    retarget.add_argument("--steps", type=int, default=None, help="transfer steps of a soft prompt (default: the "
                                                                  "parent config's methods.post.transfer.steps)")


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser: every command, in the order ``--help`` lists them."""
    parser = argparse.ArgumentParser(prog="privprompt", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-dir", default=None, help="state folder (default $PRIVPROMPT_HOME, else a per-user folder: privprompt plan / ledger say where)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run_commands(sub)
    _add_ledger_commands(sub)
    _add_key_commands(sub)
    _add_budget_commands(sub)
    _add_tool_commands(sub)
    _add_registry_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The CLI. With ``argv=None`` (the console script) the process ends when the command is done
    (:func:`_exit_now`); with a list (tests, scripts) it returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a warm worker's child runs again
    if args.state_dir:
        os.environ["PRIVPROMPT_HOME"] = args.state_dir
    command = {"run": cmd_run, "worker": cmd_worker, "audit": cmd_audit, "plan": cmd_plan, "report": cmd_report, "ledger": cmd_ledger,
               "key": cmd_key, "budget": cmd_budget, "config": cmd_config, "ui": cmd_ui, "predict": cmd_predict,
               "serve": cmd_serve, "promote": cmd_promote,
               "retarget": cmd_retarget}[args.command]
    try:
        rc = command(args)
        sys.stdout.flush()  # inside the try: a closed pipe is met here, not in the interpreter's exit
        if argv is None:  # the process's own command line (the console script): end it now
            _exit_now(rc)
        return rc
    except BrokenPipeError:  # `privprompt ledger | head`: the reader left; no traceback
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's own flush at exit must not fail again
        return 141
    except _user_errors() as err:  # one line, whichever command met it
        return _fail(_one_line(err))


if __name__ == "__main__":
    sys.exit(main())
