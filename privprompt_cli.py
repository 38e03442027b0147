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
import sys

from privprompt_commands.common import _fail, _one_line, _positive_int, _user_errors
from privprompt_commands.ledger import cmd_budget, cmd_key, cmd_ledger
from privprompt_commands.models import cmd_predict, cmd_promote, cmd_retarget
from privprompt_commands.run import cmd_audit, cmd_plan, cmd_report, cmd_run, cmd_worker
from privprompt_commands.tools import cmd_config, cmd_serve, cmd_ui


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
    plan.add_argument("--probe", action="store_true",
                      help="measure the model's speed on this machine again (else the cached probe is used)")
    plan.add_argument("--largest", action="store_true",
                      help="also search the largest target_epsilon that fits where the plan fits (a plan over the "
                           "cap always says it)")
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
    args.main = main  # the CLI itself, which a worker runs each job's command line through
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
