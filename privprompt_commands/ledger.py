"""``privprompt ledger / key / budget``: the budget ledger, the key of its record digests, reservations and caps."""

from __future__ import annotations

import os
import sys

from .common import _fail, _one_line, _user_errors
from .run import _preflight


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
    import json

    from privacy.events import ComposedEvent, event_from_dict
    from privacy.ledger.common import _counted
    from tasks.dp_icl import answered_queries

    for row in ledger.datasets():
        # a batch that failed after its read stays reserved, and spent: counted with the committed ones
        batches = [e for e in ledger.entries(row["fingerprint"]) if e["kind"] == "dp"
                   and e["status"] in ("committed", "reserved") and str(e.get("description") or "").startswith("dp_icl:")]
        if not batches:
            continue
        # each batch: its votes, one Gaussian each; counted as the ledger counts it (an older first batch's
        # sizes release split off)
        events = [_counted(json.dumps(e["event"])) for e in batches]
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
