"""``privprompt predict / promote / retarget``: a registered model's labels, release gates and retargeting."""

from __future__ import annotations

import os
import signal
import sys
import time

from .common import _fail, _one_line, _user_errors


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


def _say_what_it_is(mlflow, model_uri: str) -> None:
    """One line on stderr for a registered version without a prompt (``prompt.source = none``)."""
    from tasks.registry_model import resolve_version

    if not model_uri.startswith("models:/"):
        return
    tags = resolve_version(mlflow, model_uri).tags or {}
    if tags.get("prompt.source") == "none":
        from tasks.statement import unit_phrase

        print(f"{model_uri}: no prompt — the model with its template and label words (the run's prompt did not beat "
              f"it); ε = {float(tags.get('privacy.epsilon', 'nan')):.4f} {unit_phrase(tags.get('privacy.unit'))}, "
              f"δ = {tags.get('privacy.delta')} spent by that run", file=sys.stderr)


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
        tracking = client(state_paths(args.state_dir))
        with tempfile.TemporaryDirectory(prefix="privprompt-model-") as tmp:
            model = mlflow.pyfunc.load_model(str(download_model(tracking, args.model_uri, tmp)))
        _say_what_it_is(tracking, args.model_uri)
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
