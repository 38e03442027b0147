"""``privprompt run / worker / audit / plan / report``: a config's flow, its plan and its report."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from .common import _fail, _one_line, _quiet_user_error_tracebacks, _user_errors


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


def _die_with_parent() -> None:
    """In a server's child process, before it execs: it gets SIGTERM when this command's process
    ends, however that ends (SIGTERM from a scheduler or `timeout`, SIGKILL), so no embedded server
    is left running on its own (Linux's PR_SET_PDEATHSIG; elsewhere the atexit stop alone)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


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
             "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "error", "--lifespan", "on"], env=env,
            preexec_fn=_die_with_parent)
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
            PREFECT_UI_URL,
            temporary_settings,
        )

        from tasks.state import persistent_ui_url

        self._wait()
        os.environ["PREFECT_API_URL"] = self.api_url
        # a server this command started from its own Prefect, and that ends with it: no round trip
        # to check its API version, and no flow-run heartbeats (they let a long-lived server tell a
        # crashed run; this one is gone with the run, and the thread that sends them held up the
        # flow's end by up to a second, its sleep step). It serves no UI and is gone with the run: the
        # "View at" link points at `privprompt ui`'s Prefect UI on the same home (the same database) while
        # one runs, else there is none (a persistent server, PREFECT_API_URL, keeps its own)
        self.settings = temporary_settings(updates={PREFECT_API_URL: self.api_url,
                                                    PREFECT_CLIENT_SERVER_VERSION_CHECK_ENABLED: False,
                                                    PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None,
                                                    PREFECT_UI_URL: persistent_ui_url(os.environ.get("PREFECT_HOME"))})
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
        why = ("it lost to no prompt in the released holdout comparison: fallback; the model without a prompt is "
               "registered instead" if fell_back else "the selection chose no prompt" if selected else "the method publishes no prompt")
        print(f"{'prompt:':<28}none ({why})")
    elif published.get("prompt_published"):
        label = "published adapter (LoRA):" if _artifact_kind(published["prompt_path"]) == "lora" else "published prompt:"
        print(f"{label:<28}{published['prompt_path']}")
        if published.get("artifact_uri"):
            print(f"{'':<28}MLflow artifact {published['artifact_uri']}")
    else:
        print(f"{'prompt (not published):':<28}{published['prompt_path']} (no formal guarantee: it stays under "
              "private/ and is never published)")


def _artifact_kind(path: str) -> str | None:
    """The prompt kind a published file states (its safetensors metadata; a .json file is a text
    prompt), None when it cannot be read."""
    if str(path).endswith(".json"):
        return "text"
    try:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as fh:
            return (fh.metadata() or {}).get("kind", "soft")
    except Exception:  # noqa: BLE001 - a label only
        return None


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
              + f"; the RDP bound, a looser cross-check: ε = {m['privacy.epsilon_rdp']:.4f}")
        if m.get("privacy.epsilon_per_record") is not None:
            print(f"{'':<28}(the mechanism is per record: ε = {m['privacy.epsilon_per_record']:.4f} per record; "
                  f"charged {unit_phrase(summary.get('unit'))} by group privacy)")
        if m.get("privacy.size_epsilon") is not None:
            print(f"{'':<28}(the split sizes' release at δ/10 and the rest at 9δ/10, by basic composition: it holds "
                  "whatever the method chose from the released sizes; the ledger charges this ε)")
    elif summary.get("guarantee") == "ldp":
        print(f"{'privacy:':<28}local d_X privacy of the inputs (metric LDP; no (ε, δ) claim: see the run's params)")
    else:
        note = (summary.get("budget") or {}).get("note") or f"method {summary.get('method', '?')!r} is non-private"
        print(f"{'privacy:':<28}no formal guarantee ({note})")
    whose = " (no prompt's: none was published)" if m.get("no_prompt.fallback") else ""
    for key in sorted(k for k in m if k.startswith("test.accuracy")):
        print(f"{key + ':':<28}{m[key]:.4f}" + (whose if key == "test.accuracy" else ""))
    if "test.balanced_accuracy" in m:
        from tasks.statement import recall_phrase

        print(f"{'test.balanced_accuracy:':<28}{m['test.balanced_accuracy']:.4f} (recall per class: "
              f"{recall_phrase(m)})")
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
        none = not (summary.get("published") or {}).get("prompt_path")
        print(f"{'registered model:':<28}{summary['registered_model']} (privprompt predict / privprompt serve"
              + ("; no prompt: the model with its template and label words" if none else "") + ")")
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
    started = time.perf_counter()  # the wall time a user waits for: checks and start-up included
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
        return _run_with_server(cfg, paths, server, started)
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


def _run_with_server(cfg, paths, server, started: float) -> int:
    config = cfg.model_copy(update={"state_dir": str(paths.root)})  # the one parse, handed to the flow as it is

    errors = _user_errors()
    if not (cfg.sweep or cfg.seeds or cfg.grid):  # a sweep checks every variant in its plan
        from tasks.preflight import preflight

        try:  # what `privprompt plan` checks, before the flow starts (models stay cached in-process)
            preflight(cfg)
        except errors as err:
            return _fail(_one_line(err) + " (budget: nothing reserved, no ε used)")
    from tasks.audit import AuditFailure

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
    return serve(paths, args.idle_timeout, command=args.main, prefect_server=_local_prefect_server)


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
        from tasks import estimate

        estimate.enable_cache(paths.root)  # the model's speed on this machine, measured once (--probe: again)
        if getattr(args, "probe", False):
            os.environ[estimate.REFRESH_ENV] = "1"
        plan = plan_runs(variants, paths, largest=True if getattr(args, "largest", False) else "over", estimate=True)
    except (*_user_errors(), LedgerError) as err:
        return _fail(_one_line(err))
    print(format_plan(plan))
    _print_source_notes(variants, paths)
    _print_dp_icl_plan(cfg, plan, paths)
    _print_public_overlap(cfg)
    print(f"ledger: {paths.ledger_location}" + ("" if paths.ledger_exists() else " (none yet: nothing spent)"))
    print("which route for your case (a local model you can train, an API-only target, answers per query), "
          "measured at ε 1, 3 and 8: docs/routes.md")
    return 0 if plan["fits"] else 4


def _print_source_notes(variants: list, paths) -> None:
    """What the partitions leave out or hold few of (exact: this terminal and private/operator.log only)."""
    from tasks.planning import source_notes
    from tasks.state import operator_note

    seen = set()
    for _, cfg in variants:
        for line in source_notes(cfg, paths.private):
            if line not in seen:
                seen.add(line)
                operator_note(paths, line)


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
