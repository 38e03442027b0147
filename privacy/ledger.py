"""A persistent privacy budget ledger in a database: the embedded SQLite file of one machine, or a
team's PostgreSQL, reached by URL (:mod:`privacy.ledger_store`).

Every private training partition is identified by a *fingerprint* (e.g. the keyed hash of its
records) and gets a cap (ε_cap, δ) when it is first registered. Every run that touches the
partition goes through the ledger:

1. ``reserve(fingerprint, run_id, event)`` **before** the run touches private data, with the
   run's declared worst-case event (e.g. the DP-SGD event of all planned steps). The ledger
   composes the events of *all* counted entries of the dataset plus the new one with the
   accountant (``spend(ComposedEvent(...), δ)``: composition of the stored events, never a sum
   of ε's) and refuses with :class:`BudgetExceededError` if the composed ε exceeds the cap.
   Reservation is atomic across processes and machines: the check and the insert run in one
   transaction holding the ledger's write lock (SQLite: ``BEGIN IMMEDIATE``; PostgreSQL:
   ``pg_advisory_xact_lock``), so concurrent reservations are serialised by the database and
   can never overspend together.
2. ``commit(run_id, event)`` after the run, with the event it actually spent (it may be smaller,
   e.g. after early stopping). From then on the committed event is the one composed.

A spent budget stays spent:

* A run that crashes after it began reading private data keeps its reservation, and a
  reservation (status ``'reserved'``) counts in full: the run may have touched the data before
  it died. The lifecycle calls ``mark_read(run_id)`` BEFORE its first private read; from then
  on the entry can never be released.
* ``release(run_id, reason)`` is for a run that failed before that mark (a model that does not
  load, a config mistake found late): no private record was read, so the reservation costs
  nothing. The entry stays in the ledger with status ``'released'``, its reason and time; the
  ledger refuses it for an entry marked read.
* ``abort(run_id, reason)`` exists **only** for runs that provably never touched private data
  (e.g. config validation failed before any data was loaded). It marks the entry ``'aborted'``
  and the entry then costs nothing. Calling it for a run that did read the data voids the
  ledger's guarantee. A committed entry can never be aborted.

Non-private uses of a dataset (e.g. non-private baselines) are recorded with
``record_nonprivate``: they have no DP guarantee, so they cannot be composed, but they are listed
in ``entries``, ``datasets`` and ``summary_table`` so that they are never silently ignored.

Entries are keyed by ``run_id``, unique across the whole ledger (``commit`` and ``abort`` take
only the run id). A run that touches two datasets reserves once per dataset with two run ids.
Reserving again with the same run id and the same event returns the existing reservation
(Prefect task retries must not charge twice); a different event under the same run id is an error.

Every change (register, cap or δ change, reserve, commit, abort, release, mark_read, a
non-private or local-DP use, the team key, an import) appends a row to the append-only
``trail`` (time, action, dataset, run, details, machine, OS user, process) in the same
transaction as the change; a refused reservation changes nothing and appends nothing.
``export()`` returns the whole ledger as JSON-able data and ``import_ledger`` restores it into
an empty ledger.

The key of the keyed record digests, fingerprints and splits is never kept in the ledger's
database (schemas ≥ 7): with the key, the record digests stored here would answer "is this text in
the data?" for any text, to anyone who can read the database or a backup of it. The database
records only the key's id (:func:`key_id_of`: an HMAC of a constant under it, from which no digest
can be computed), so that a machine holding no key, or another one, is refused with a clear line.
The key lives in a file of each machine's state folder, which the team shares
(``privprompt key export`` / ``privprompt key import``: tasks/state.py); a ledger of schemas 4-6
that still holds it has it moved out on first use (:meth:`Ledger.move_team_key_out`).

A larger δ lets the same runs cost less ε under the same cap, so raising it is a budget raise: only
the explicit step of a cap raise does it, and the trail marks it (``delta_raised``). The
``set-delta`` of schemas ≤ 6 raised δ freely; on migration to schema 8 (and on importing an older
export) a dataset with a δ raise that no such mark records is put back to its smallest δ before that
raise (:meth:`Ledger._undo_unrecorded_delta_raises`), and a reservation on a dataset whose stored δ
is ≥ 1/n for the n records the ledger knows it by is refused.

Datasets are known by their records (schema 5). With :meth:`register_source` a run's data source
comes with its *keyed record digests* (16 bytes each: an HMAC, under the installation's or team's
key, of each normalised record; never text, never an unkeyed hash) and its own key; the ledger
keeps every registered dataset's digests (``dataset_records``: the digest is the primary key, so a
record belongs to at most one dataset ledger-wide) and charges the source to the ONE registered
dataset it shares a key or any record with, adding the source's other records to that dataset.
A source that shares records with two or more registered datasets is refused
(:class:`RecordOverlapError`): each record's budget lives in one dataset, and a run on that
source would draw on several at once. A source that shares nothing is registered as a new dataset.
So the record sets of the registered datasets stay disjoint, every source is charged to the
dataset holding all of its records, and a record never gets a second cap. :meth:`match_source`
answers the same question without writing (plans).

Every ε the ledger reports comes from ``spend(ComposedEvent(events), δ)``. A composition of one
entry is accounted as that entry (``accountant.spend`` unwraps it), so a single run is charged
exactly its own report. With several entries a ``ParallelEvent`` (disjoint data, e.g. DP-OPT's
generation vs. selection, or a private selection's trainings vs. its holdout scores) is nested
inside the composition, where the accountant bounds it less tightly than at the top level (PLD
composes the parts sequentially, RDP takes the pointwise maximum of their curves): the ledger may
count such runs slightly above their own reports, never below them.

Events are stored as JSON (``event_to_dict``). SQLAlchemy plus the accountant: no torch, Prefect
or MLflow here.
"""

from __future__ import annotations

import base64
import dataclasses
import getpass
import hashlib
import hmac
import json
import math
import os
import socket
import sqlite3
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa

from . import events as ev
from .accountant import PrivacySpend, spend
from .ledger_store import (DEFAULT_BUSY_TIMEOUT_S, LEGACY_TEAM_KEY_TABLE, RECORD_DIGEST_BYTES,  # noqa: F401
                           SCHEMA_VERSION, TEAM_KEY_ID, LedgerError, LedgerUnavailableError, LedgerURLError, Store,
                           mask_url)
from .validation import check_delta, check_epsilon

__all__ = [
    "BudgetExceededError",
    "DeltaMismatchError",
    "Ledger",
    "LedgerError",
    "LedgerKeyError",
    "LedgerURLError",
    "LedgerUnavailableError",
    "RecordOverlapError",
    "Reservation",
    "UnknownDatasetError",
    "UnknownRunError",
]

# Relative slack when comparing a committed ε with the reserved one (the accountant is
# deterministic; this only absorbs float noise).
_EPS_RTOL = 1e-9
EXPORT_FORMAT = "privprompt-ledger"
_TABLES = ("datasets", "entries", "cap_changes", "trail")


def _q(conn: sa.Connection, sql: str, params: tuple = ()):
    """Run ``sql`` with ``?`` placeholders bound to ``params`` in order; rows as mappings."""
    parts = sql.split("?")
    if len(parts) - 1 != len(params):
        raise AssertionError(f"{len(parts) - 1} placeholders, {len(params)} parameters: {sql}")
    named = parts[0] + "".join(f":p{i}{part}" for i, part in enumerate(parts[1:]))
    return conn.execute(sa.text(named), {f"p{i}": v for i, v in enumerate(params)}).mappings()


# ---- errors -------------------------------------------------------------------------------------

class BudgetExceededError(ValueError):
    """A reservation would take the dataset's composed ε over its cap; nothing was recorded."""

    def __init__(self, message: str, *, fingerprint: str, name: str, needed: float, spent: float,
                 total: float, cap: float, delta: float):
        super().__init__(message)
        self.fingerprint = fingerprint
        self.name = name
        self.needed = needed        # ε of the refused run alone
        self.spent = spent          # composed ε already spent (reserved + committed)
        self.total = total          # composed ε if the run had been admitted
        self.cap = cap
        self.delta = delta
        self.remaining = max(0.0, cap - spent)
        self.largest_fitting_epsilon: float | None = None  # set by callers that know the run's config

    def with_hint(self, hint: str, largest_fitting_epsilon: float | None = None) -> "BudgetExceededError":
        """The same refusal with ``hint`` appended to its (one-line) message."""
        err = BudgetExceededError(f"{self.args[0]}; {hint}", fingerprint=self.fingerprint, name=self.name,
                                  needed=self.needed, spent=self.spent, total=self.total, cap=self.cap,
                                  delta=self.delta)
        err.largest_fitting_epsilon = largest_fitting_epsilon
        return err

    def __reduce__(self):  # picklable across Prefect / Dask boundaries with its numbers
        return (_rebuild_budget_error, (self.args[0], self.fingerprint, self.name, self.needed, self.spent,
                                        self.total, self.cap, self.delta, self.largest_fitting_epsilon))


def _rebuild_budget_error(message, fingerprint, name, needed, spent, total, cap, delta, largest):
    err = BudgetExceededError(message, fingerprint=fingerprint, name=name, needed=needed, spent=spent,
                              total=total, cap=cap, delta=delta)
    err.largest_fitting_epsilon = largest
    return err


class _LookupValueError(KeyError, ValueError):
    """A KeyError (missing key) that is also a ValueError (bad argument), with a readable str."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class LedgerKeyError(LedgerError):
    """The shared ledger's team key is missing where it must not be minted, or differs."""


class RecordOverlapError(LedgerError):
    """A data source shares records with more than one registered dataset: no one budget covers
    a run on it. Nothing was recorded."""


class DeltaMismatchError(ValueError):
    """A run's δ differs from the δ its dataset is composed at."""


class UnitMismatchError(ValueError):
    """A run's privacy unit differs from the unit its dataset's cap and charges are stated for."""


def unit_mismatch_message(name: str, fingerprint: str, registered: str, unit: str) -> str:
    """One line: why a run of privacy unit ``unit`` is refused on a dataset registered with ``registered``."""
    where = f"dataset {name!r} (fingerprint {_short(fingerprint)})"
    if registered != "record" and unit == "record":
        return (f"{where} is registered with privacy unit {registered!r}: its cap and every ε charged to it are per "
                f"person, and a record-level run's ε is per record — a person with k records could lose up to k·ε "
                f"(group privacy), which the ledger would under-count; without a bound on each person's records it "
                f"cannot be charged; refused: set data.privacy_unit: {registered} (user-level DP), or keep the run "
                f"record-level and have it charged the group-privacy bound per person by setting data.person_field: "
                f"{registered} and data.max_records_per_unit: K (at most K records of each person are kept)")
    if registered == "record":
        return (f"{where} is registered with privacy unit 'record': its cap and charges are per record, and a run "
                f"with data.privacy_unit: {unit} states its ε per person — the two do not compose into one budget; "
                f"refused: set data.privacy_unit: record, or, while nothing is charged to the dataset, "
                f"`privprompt budget set-unit {_short(fingerprint)} {unit} --reason TEXT`")
    return (f"{where} is registered with privacy unit {registered!r}, this run's is {unit!r}: people identified by "
            f"another field do not compose into one budget; refused: set data.privacy_unit: {registered}")


class UnknownDatasetError(_LookupValueError):
    """No dataset with this fingerprint is registered."""


class UnknownRunError(_LookupValueError):
    """No ledger entry with this run id."""


# ---- records ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Reservation:
    """The answer of :meth:`Ledger.reserve`.

    ``spent_epsilon`` / ``remaining_epsilon`` describe the dataset *including* this reservation,
    at the time of the call. ``new`` is False when an existing reservation was returned
    (idempotent retry) instead of a new one being made.
    """

    run_id: str
    fingerprint: str
    event: ev.DpEvent
    epsilon: float            # ε of this run alone at the dataset's δ
    delta: float
    epsilon_cap: float
    spent_epsilon: float      # composed ε of all counted entries, this one included
    remaining_epsilon: float
    status: str
    created_at: str
    new: bool = True


# ---- helpers ------------------------------------------------------------------------------------

def key_id_of(key: bytes) -> str:
    """The id of a 32-byte key: 16 hex digits of an HMAC of a constant under it. It tells keys apart
    (the ledger records the id of the key its datasets are keyed with) and reveals nothing of the key:
    no record digest can be computed from it."""
    if not isinstance(key, (bytes, bytearray)) or len(key) != 32:
        raise LedgerKeyError("a team key is 32 bytes")
    return hmac.new(bytes(key), b"privprompt/key-id", hashlib.sha256).hexdigest()[:16]


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def _store_tables():
    from .ledger_store import cap_changes_table, datasets_table, entries_table, trail_table

    return (datasets_table, entries_table, cap_changes_table, trail_table)


def _host() -> str:
    return socket.gethostname() or "unknown"


def _os_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry and no $USER: the numeric id
        return f"uid {os.getuid()}"


def _short(fingerprint: str, n: int = 12) -> str:
    return fingerprint if len(fingerprint) <= n else fingerprint[:n] + "…"


def _check_text(value, name: str, allow_empty: bool = False) -> str:
    if not isinstance(value, str) or (not allow_empty and not value.strip()):
        kind = "a string" if allow_empty else "a non-empty string"
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    return value


def _event_json(event, name: str = "event") -> str:
    try:
        return ev.event_to_json(event)
    except TypeError as exc:
        raise ValueError(f"{name} must be a privacy event (privacy.events), got {event!r}") from exc


def _counted_event_json(row: Any) -> str | None:
    """The event an entry counts with: committed if committed, reserved if reserved, else none
    (aborted and released entries cost nothing)."""
    if row["kind"] != "dp" or row["status"] in ("aborted", "released"):
        return None
    if row["status"] == "committed":
        return row["committed_event"]
    return row["reserved_event"]


def _compose(event_jsons: list[str], delta: float) -> PrivacySpend:
    events = tuple(ev.event_from_json(text) for text in event_jsons)
    return spend(ev.ComposedEvent(events), delta)


def _held(s: PrivacySpend, floor: float) -> PrivacySpend:
    """``s`` (the composition at the dataset's δ) held at ``floor``, the largest ε the dataset was
    recorded as having spent when its δ changed (:meth:`Ledger._delta_floor`): a δ change never
    lowers what the ledger says a dataset has spent."""
    if not floor > s.epsilon:
        return s
    return dataclasses.replace(s, epsilon=float(floor),
                               accountant=f"{s.accountant}, held at the ε spent before a δ change")


def _preview(existing: list[str], events: list[ev.DpEvent], delta: float, cap: float, name: str,
             floor: float = 0.0) -> dict:
    planned = [_event_json(e) for e in events]
    spent_eps = max(floor, _compose(existing, delta).epsilon)
    total = max(floor, _compose(existing + planned, delta).epsilon)
    return {"name": name, "cap": cap, "delta": delta, "spent_epsilon": spent_eps,
            "planned_epsilon": [_compose([p], delta).epsilon for p in planned], "total_epsilon": total,
            "remaining_after": cap - total, "fits": bool(total <= cap)}


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isinf(x):
        return "inf"
    return f"{x:.4f}"


# ---- the ledger ---------------------------------------------------------------------------------

class Ledger:
    """Persistent privacy budget ledger: a SQLite file (created with its directory) given by path
    or ``sqlite:////abs/path`` URL, or a team's PostgreSQL given by ``postgresql://`` URL.

    Each operation opens its own short-lived connection, so a ``Ledger`` object can be created in
    one process and used after ``fork``/``spawn``, and several processes (and, on PostgreSQL,
    machines) can share one ledger.
    """

    def __init__(self, path, busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S):
        self._store = Store(path, busy_timeout_s)
        self.path = self._store.path       # the SQLite file; None for a PostgreSQL ledger
        self.url = self._store.masked_url  # where the ledger lives, password masked
        self.busy_timeout_s = self._store.busy_timeout_s
        self._store.init_schema(self._migrate_rows)

    def __repr__(self) -> str:
        return f"Ledger({str(self.path) if self.path is not None else self.url!r})"

    @property
    def location(self) -> str:
        """Where the ledger lives, for people: the file path, or the URL with its password masked."""
        return str(self.path) if self.path is not None else self.url

    @property
    def shared(self) -> bool:
        """True for a database server's ledger (PostgreSQL), False for an embedded SQLite file."""
        return self.path is None

    def _write(self):
        return self._store.write()

    def _read(self):
        return self._store.read()

    @staticmethod
    def _trail(conn: sa.Connection, action: str, fingerprint: str | None = None, run_id: str | None = None,
               **detail) -> None:
        """Append one row to the audit trail, in the transaction of the change it records."""
        _q(conn, "INSERT INTO trail (at, action, fingerprint, run_id, detail, host, os_user, pid)"
                 " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
           (_now(), action, fingerprint, run_id, json.dumps(detail, sort_keys=True, default=str),
            _host(), _os_user(), os.getpid()))

    # -- internal queries --

    @staticmethod
    def _dataset_row(conn: sa.Connection, fingerprint: str) -> Any:
        _check_text(fingerprint, "fingerprint")
        row = _q(conn, "SELECT * FROM datasets WHERE fingerprint = ?", (fingerprint,)).fetchone()
        if row is None:
            raise UnknownDatasetError(
                f"unknown dataset fingerprint {fingerprint!r}: register it first with "
                "Ledger.register_dataset(fingerprint, name, epsilon_cap, delta)")
        return row

    @staticmethod
    def _entry_row(conn: sa.Connection, run_id: str) -> Any:
        _check_text(run_id, "run_id")
        row = _q(conn, "SELECT * FROM entries WHERE run_id = ?", (run_id,)).fetchone()
        if row is None:
            raise UnknownRunError(f"no ledger entry for run_id {run_id!r}")
        return row

    @staticmethod
    def _counted_events(conn: sa.Connection, fingerprint: str, exclude_run_id: str | None = None
                        ) -> list[str]:
        rows = _q(conn, 
            "SELECT * FROM entries WHERE fingerprint = ? AND kind = 'dp' AND status NOT IN ('aborted', 'released') "
            "ORDER BY id", (fingerprint,)).fetchall()
        return [_counted_event_json(r) for r in rows if r["run_id"] != exclude_run_id]

    @staticmethod
    def _delta_floor(conn: sa.Connection, fingerprint: str) -> float:
        """The largest ε the dataset was recorded as having spent when its δ changed (0.0 when its δ
        never changed): its spent ε is never reported, nor composed, below it. A δ change needs no
        open reservation, so what was spent then is committed and stays counted."""
        row = _q(conn, "SELECT MAX(spent_epsilon_at_change) AS m FROM cap_changes WHERE fingerprint = ? "
                       "AND new_delta <> old_delta", (fingerprint,)).fetchone()
        return float(row["m"]) if row is not None and row["m"] is not None else 0.0

    def _spent_in(self, conn: sa.Connection, fingerprint: str) -> tuple[Any, PrivacySpend]:
        ds = self._dataset_row(conn, fingerprint)
        return ds, _held(_compose(self._counted_events(conn, fingerprint), ds["delta"]),
                         self._delta_floor(conn, fingerprint))

    @staticmethod
    def _record_count(conn: sa.Connection, fingerprint: str) -> int | None:
        """How many records the ledger knows the dataset by (None: its records are not known)."""
        row = _q(conn, "SELECT s.id AS id, COUNT(r.digest) AS n FROM record_sets s LEFT JOIN dataset_records r "
                       "ON r.set_id = s.id WHERE s.fingerprint = ? GROUP BY s.id", (fingerprint,)).fetchone()
        return None if row is None or not row["n"] else int(row["n"])

    # -- datasets --

    def register_dataset(self, fingerprint: str, name: str, epsilon_cap: float, delta: float,
                         allow_cap_change: bool = False, unit: str = "record") -> dict[str, Any]:
        """Register a dataset with its budget cap (ε_cap, δ); returns its ``datasets()`` row.

        Re-registering with the same name, cap and δ is a no-op. Different values raise
        ``ValueError`` unless ``allow_cap_change=True``, which applies them and records the change
        (old and new values, the ε spent at the time) in the ``cap_changes`` table. Caps should
        only ever be *lowered*: raising a cap — or δ, which weakens what the same cap guarantees —
        after runs have spent against it is a policy decision, which is why this explicit call is
        the one way to do it and every change is kept in the record. Lowering a cap below what is
        already spent is allowed; the dataset then has no budget left. A δ change never lowers what
        the dataset has spent (:meth:`change_delta`). ``unit``: the privacy unit the cap is stated
        for (``record``, or the field naming a person); a registered dataset's unit is never changed
        here (:class:`UnitMismatchError`; :meth:`change_unit` while nothing is charged).
        """
        _check_text(fingerprint, "fingerprint")
        _check_text(name, "name")
        _check_text(unit, "unit")
        epsilon_cap = check_epsilon(epsilon_cap, "epsilon_cap")
        delta = check_delta(delta, "delta")
        if not isinstance(allow_cap_change, bool):
            raise ValueError(f"allow_cap_change must be a bool, got {allow_cap_change!r}")
        with self._write() as conn:
            row = _q(conn, "SELECT * FROM datasets WHERE fingerprint = ?", (fingerprint,)).fetchone()
            now = _now()
            if row is None:
                _q(conn, 
                    "INSERT INTO datasets (fingerprint, name, epsilon_cap, delta, created_at, updated_at, unit)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)", (fingerprint, name, epsilon_cap, delta, now, now, unit))
                self._trail(conn, "register", fingerprint, name=name, epsilon_cap=epsilon_cap, delta=delta,
                            **({"unit": unit} if unit != "record" else {}))
            else:
                if row["unit"] != unit:
                    raise UnitMismatchError(unit_mismatch_message(row["name"], fingerprint, row["unit"], unit))
                same = (row["name"] == name
                        and math.isclose(row["epsilon_cap"], epsilon_cap, rel_tol=1e-12, abs_tol=0.0)
                        and math.isclose(row["delta"], delta, rel_tol=1e-12, abs_tol=0.0))
                if not same:
                    if not allow_cap_change:
                        raise ValueError(
                            f"dataset {row['name']!r} (fingerprint {_short(fingerprint)}) is already "
                            f"registered with epsilon_cap={row['epsilon_cap']!r}, delta={row['delta']!r}; "
                            f"refusing to change it to name={name!r}, epsilon_cap={epsilon_cap!r}, "
                            f"delta={delta!r} (pass allow_cap_change=True to change it; the change is "
                            "recorded, and caps should only be lowered)")
                    self._change(conn, row, name, epsilon_cap, delta, None, allow_raise=True)
        return self.dataset(fingerprint)

    def _change(self, conn: sa.Connection, row: Any, name: str, epsilon_cap: float, delta: float,
                reason: str | None, allow_raise: bool = False, undoing_raise: bool = False) -> None:
        """Apply a change of a dataset's name / cap / δ and record it (old and new values, the ε
        spent at the time, the reason) in ``cap_changes``.

        A δ change never lowers what the ledger says the dataset has spent: the ε spent at the old
        δ is kept in ``cap_changes.spent_epsilon_at_change`` and holds the dataset's spent ε from
        below from then on (:meth:`_delta_floor`), and each entry's ε becomes the larger of what it
        was charged and its ε at the new δ. A δ change is refused while a reservation is open (its
        run was planned at the old δ). A larger δ — under which the same events cost less ε, i.e. a
        raise of the budget — is refused unless ``allow_raise`` (the explicit step of a cap raise),
        and even then when the dataset's records are known and δ ≥ 1/n for them.
        ``undoing_raise``: the migration putting back a δ that an unrecorded raise enlarged
        (:meth:`_undo_unrecorded_delta_raises`): a lowering, made with reservations open too (they
        are then composed at the smaller δ, i.e. counted higher), and marked so in the trail."""
        fingerprint, now = row["fingerprint"], _now()
        spent_eps = _held(_compose(self._counted_events(conn, fingerprint), row["delta"]),
                          self._delta_floor(conn, fingerprint)).epsilon
        delta_changes = not math.isclose(row["delta"], delta, rel_tol=1e-12, abs_tol=0.0)
        raised = delta_changes and delta > row["delta"]
        where = f"dataset {row['name']!r} (fingerprint {_short(fingerprint)})"
        if delta_changes and not undoing_raise:
            open_runs = [r["run_id"] for r in _q(conn,
                "SELECT run_id FROM entries WHERE fingerprint = ? AND kind = 'dp' AND status = 'reserved'",
                (fingerprint,))]
            if open_runs:
                raise ValueError(f"{where} has {len(open_runs)} open reservation(s) ({', '.join(open_runs)}) "
                                 f"planned at δ={row['delta']:g}: change δ when none is open")
        if raised:
            if not allow_raise:
                raise ValueError(
                    f"δ={delta:g} is above {where}'s δ={row['delta']:g}: a larger δ lets the same runs cost less ε, "
                    f"so it raises the budget its cap ε={row['epsilon_cap']:g} states, and like a cap raise it is "
                    f"refused here (its spent ε={_fmt(spent_eps)} stays spent either way); a raise is a policy "
                    "decision made in code and recorded, as a cap raise is: Ledger.register_dataset(fingerprint, "
                    "name, cap, delta, allow_cap_change=True)")
            n = self._record_count(conn, fingerprint)
            if n is not None and delta >= 1.0 / n:  # n is not in the message (the rule of check_delta)
                raise ValueError(f"δ={delta:g} is >= 1/n for the n records {where} is known by: such a δ permits "
                                 "releasing whole records; refused")
        _q(conn, 
            "INSERT INTO cap_changes (fingerprint, old_name, old_cap, old_delta, new_name,"
            " new_cap, new_delta, spent_epsilon_at_change, changed_at, reason)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (fingerprint, row["name"], row["epsilon_cap"], row["delta"], name, epsilon_cap,
             delta, spent_eps, now, reason))
        self._trail(conn, "cap_change", fingerprint, old_name=row["name"], old_cap=row["epsilon_cap"],
                    old_delta=row["delta"], new_name=name, new_cap=epsilon_cap, new_delta=delta,
                    spent_epsilon=spent_eps, reason=reason, **({"delta_raised": True} if raised else {}),
                    **({"undoes_unrecorded_delta_raise": True} if undoing_raise else {}))
        _q(conn, 
            "UPDATE datasets SET name = ?, epsilon_cap = ?, delta = ?, updated_at = ?"
            " WHERE fingerprint = ?", (name, epsilon_cap, delta, now, fingerprint))
        if delta_changes:
            for entry in _q(conn, "SELECT * FROM entries WHERE fingerprint = ? AND kind = 'dp'",
                                      (fingerprint,)).fetchall():
                update = {}
                for column, event_column in (("epsilon_reserved", "reserved_event"),
                                             ("epsilon_committed", "committed_event")):
                    if entry[event_column]:
                        at_new = _compose([entry[event_column]], delta).epsilon
                        update[column] = max(at_new, entry[column]) if entry[column] is not None else at_new
                if update:
                    _q(conn, f"UPDATE entries SET {', '.join(f'{k} = ?' for k in update)} WHERE id = ?",
                                 (*update.values(), entry["id"]))

    def _migrate_rows(self, conn: sa.Connection, version: int) -> None:
        """The row changes of a migration to the current schema (:meth:`Store.init_schema`)."""
        if version < 8:
            self._undo_unrecorded_delta_raises(conn, f"schema {version}")

    def _undo_unrecorded_delta_raises(self, conn: sa.Connection, origin: str) -> list[str]:
        """Put back every dataset whose ``cap_changes`` show a δ raise that the recorded raise step
        did not make (no ``cap_change`` trail row marked ``delta_raised`` for it: the ``set-delta`` /
        ``change_delta`` of schemas ≤ 6 raised δ with no such step) to the smallest δ it had before
        that raise. That is a lowering, always allowed: :meth:`_change` records it in ``cap_changes``
        and the trail (``undoes_unrecorded_delta_raise``), re-states each entry's ε at that δ, and
        the floor of every earlier δ change still holds its spent ε from below. Returns the
        fingerprints put back. ``origin``: what the rows came from (for the reason)."""
        recorded: dict[tuple, int] = {}
        for t in _q(conn, "SELECT fingerprint, detail FROM trail WHERE action = 'cap_change' ORDER BY id"):
            detail = json.loads(t["detail"])
            if detail.get("delta_raised"):
                k = (t["fingerprint"], float(detail["old_delta"]), float(detail["new_delta"]))
                recorded[k] = recorded.get(k, 0) + 1
        undone = []
        for ds in _q(conn, "SELECT * FROM datasets ORDER BY fingerprint").fetchall():
            fp, target, smallest = ds["fingerprint"], None, None
            for c in _q(conn, "SELECT * FROM cap_changes WHERE fingerprint = ? ORDER BY id", (fp,)).fetchall():
                old, new = float(c["old_delta"]), float(c["new_delta"])
                smallest = old if smallest is None else min(smallest, old)
                if new > old and not math.isclose(new, old, rel_tol=1e-12, abs_tol=0.0):
                    if recorded.get((fp, old, new), 0) > 0:
                        recorded[(fp, old, new)] -= 1
                    else:
                        target = smallest if target is None else min(target, smallest)
                smallest = min(smallest, new)
            if target is None or not ds["delta"] > target or math.isclose(ds["delta"], target, rel_tol=1e-12,
                                                                            abs_tol=0.0):
                continue
            self._change(conn, ds, ds["name"], ds["epsilon_cap"], target,
                         f"δ put back from {ds['delta']:g} to {target:g}, the smallest δ before a raise made without "
                         f"the recorded raise step (the set-delta of {origin}): a larger δ lets the same runs cost "
                         "less ε under the same cap", undoing_raise=True)
            undone.append(fp)
        return undone

    def lower_cap(self, fingerprint: str, epsilon_cap: float, reason: str) -> dict[str, Any]:
        """Lower the dataset's cap to ``epsilon_cap`` (recorded with ``reason``); raising is refused
        (a raise is a policy decision, made with ``register_dataset(..., allow_cap_change=True)``).
        Below what is spent, the dataset has no budget left. Returns its ``datasets()`` row."""
        _check_text(reason, "reason")
        epsilon_cap = check_epsilon(epsilon_cap, "epsilon_cap")
        with self._write() as conn:
            row = self._dataset_row(conn, fingerprint)
            if epsilon_cap > row["epsilon_cap"] * (1 + 1e-12):
                raise ValueError(f"ε cap {epsilon_cap:g} is above dataset {row['name']!r}'s cap ε={row['epsilon_cap']:g}: "
                                 "a cap is only lowered here")
            if epsilon_cap < row["epsilon_cap"]:
                self._change(conn, row, row["name"], epsilon_cap, row["delta"], reason)
        return self.dataset(fingerprint)

    def change_delta(self, fingerprint: str, delta: float, reason: str, allow_raise: bool = False
                     ) -> dict[str, Any]:
        """Compose the dataset at another δ from now on, deliberately, recorded with ``reason`` and
        the ε spent at the old δ. Refused while a reservation is open (its run was planned at the
        old δ). What the dataset has spent never drops: a smaller δ re-states every entry's ε at it
        (higher), and the spent ε at the old δ stays the floor of the dataset's spent ε. A larger δ
        raises the budget (the same events cost less ε under the same cap): refused unless
        ``allow_raise=True`` — the explicit, recorded step of a cap raise (as
        ``register_dataset(..., allow_cap_change=True)``) — and refused when δ ≥ 1/n for the
        dataset's known records. The cap stays."""
        _check_text(reason, "reason")
        delta = check_delta(delta, "delta")
        if not isinstance(allow_raise, bool):
            raise ValueError(f"allow_raise must be a bool, got {allow_raise!r}")
        with self._write() as conn:
            row = self._dataset_row(conn, fingerprint)
            if not math.isclose(row["delta"], delta, rel_tol=1e-12, abs_tol=0.0):
                self._change(conn, row, row["name"], row["epsilon_cap"], delta, reason, allow_raise=allow_raise)
        return self.dataset(fingerprint)

    def find_dataset(self, name_or_fingerprint: str) -> dict[str, Any]:
        """The one dataset whose fingerprint starts with, or whose name is, ``name_or_fingerprint``."""
        _check_text(name_or_fingerprint, "dataset")
        found = [d for d in self.datasets()
                 if d["fingerprint"].startswith(name_or_fingerprint) or d["name"] == name_or_fingerprint]
        if len(found) != 1:
            known = ", ".join(f"{d['name']} ({_short(d['fingerprint'])})" for d in self.datasets()) or "none"
            what = "no dataset" if not found else f"{len(found)} datasets"
            raise UnknownDatasetError(f"{what} named or with a fingerprint starting {name_or_fingerprint!r} in "
                                      f"ledger {self.location} (datasets: {known}); give a longer fingerprint prefix")
        return found[0]

    def cap_changes(self, fingerprint: str | None = None) -> list[dict[str, Any]]:
        """Every recorded cap change (``register_dataset(..., allow_cap_change=True)``), oldest first."""
        with self._read() as conn:
            if fingerprint is None:
                rows = _q(conn, "SELECT * FROM cap_changes ORDER BY id").fetchall()
            else:
                self._dataset_row(conn, fingerprint)
                rows = _q(conn, "SELECT * FROM cap_changes WHERE fingerprint = ? ORDER BY id",
                                    (fingerprint,)).fetchall()
        return [{k: r[k] for k in r.keys() if k != "id"} for r in rows]

    # -- datasets known by their records --

    @staticmethod
    def _digest_list(digests) -> list[bytes]:
        """``digests`` (16-byte keyed record digests end to end, or an iterable of them) as a sorted
        list of distinct digests."""
        n = RECORD_DIGEST_BYTES
        if isinstance(digests, (bytes, bytearray, memoryview)):
            raw = bytes(digests)
            if len(raw) % n:
                raise ValueError(f"record digests must be {n}-byte digests end to end, got {len(raw)} bytes")
            items = {raw[i:i + n] for i in range(0, len(raw), n)}
        else:
            items = set()
            for d in digests:
                if not isinstance(d, (bytes, bytearray)) or len(d) != n:
                    raise ValueError(f"a record digest is {n} bytes, got a {type(d).__name__}")
                items.add(bytes(d))
        return sorted(items)

    _CHUNK = 900  # bound parameters per lookup (below SQLite's oldest limit, 999)

    @classmethod
    def _owners(cls, conn: sa.Connection, digests: list[bytes]) -> dict[str, set[bytes]]:
        """fingerprint → those of ``digests`` that registered dataset holds (indexed lookups)."""
        stmt = sa.text("SELECT r.digest AS digest, s.fingerprint AS fingerprint FROM dataset_records r "
                       "JOIN record_sets s ON s.id = r.set_id WHERE r.digest IN :d"
                       ).bindparams(sa.bindparam("d", expanding=True))
        out: dict[str, set[bytes]] = {}
        for i in range(0, len(digests), cls._CHUNK):
            for row in conn.execute(stmt, {"d": digests[i:i + cls._CHUNK]}):
                out.setdefault(row.fingerprint, set()).add(bytes(row.digest))
        return out

    @staticmethod
    def _record_set_id(conn: sa.Connection, fingerprint: str) -> int | None:
        row = _q(conn, "SELECT id FROM record_sets WHERE fingerprint = ?", (fingerprint,)).fetchone()
        return None if row is None else int(row["id"])

    def _source_match(self, conn: sa.Connection, key: str, digests: list[bytes], legacy_key: str | None
                      ) -> tuple[dict[str, str], dict[str, set[bytes]] | None]:
        """The registered datasets a source is bound to (fingerprint → how: 'key', its own key is
        registered; 'legacy', its file-bytes key of ledgers before schema 5; 'records', it shares
        records), and which of its digests each holds (None: not looked up). The lookup is skipped
        only when the source's own key is registered WITH records: that dataset then holds every
        record of the source (a key is the HMAC of its record set, and records are never removed),
        and no other dataset holds any (record sets are disjoint)."""
        found: dict[str, str] = {}
        for fp, how in ((key, "key"), (legacy_key, "legacy")):
            if fp and fp not in found and _q(conn, "SELECT fingerprint FROM datasets WHERE fingerprint = ?",
                                             (fp,)).fetchone() is not None:
                found[fp] = how
        if found.get(key) == "key" and len(found) == 1 and self._record_set_id(conn, key) is not None:
            return found, None
        owners = self._owners(conn, digests) if digests else {}
        for fp in owners:
            found.setdefault(fp, "records")
        return found, owners

    @staticmethod
    def _overlap_error(conn: sa.Connection, found: dict[str, str], key: str, name: str) -> RecordOverlapError:
        names = {r["fingerprint"]: r["name"] for r in _q(conn, "SELECT fingerprint, name FROM datasets")}
        listed = ", ".join(f"{names[fp]!r} (fingerprint {_short(fp)})" for fp in sorted(found, key=lambda f: names[f]))
        # no count of shared records: whoever writes a source file would learn how many of its
        # records another dataset holds (a membership oracle)
        return RecordOverlapError(
            f"data source {name!r} (records key {_short(key)}) shares records with {len(found)} registered datasets: "
            f"{listed}; each record is charged to the one dataset that holds it, and a run on this source would "
            "draw on several budgets at once: use a source whose records lie in one registered dataset (or in "
            "none); nothing was recorded")

    def match_source(self, key: str, digests=b"", legacy_key: str | None = None, name: str = "source"
                     ) -> dict[str, Any] | None:
        """The registered dataset a source (its own key, its keyed record digests, its old
        file-bytes key) is charged to, WITHOUT writing: its :meth:`datasets` row with ``how``
        ('key', 'legacy' or 'records'); None when it is a new dataset. Raises
        :class:`RecordOverlapError` when it shares records with two or more registered datasets
        (the rule of :meth:`register_source`)."""
        _check_text(key, "key")
        digest_list = self._digest_list(digests)
        with self._read() as conn:
            found, _ = self._source_match(conn, key, digest_list, legacy_key)
            if len(found) > 1:
                raise self._overlap_error(conn, found, key, name)
        if not found:
            return None
        ((fp, how),) = found.items()
        return {**self.dataset(fp), "how": how}

    def register_source(self, key: str, name: str, epsilon_cap: float, delta: float, digests,
                        legacy_key: str | None = None, unit: str = "record") -> dict[str, Any]:
        """Charge a data source to its dataset, in one transaction under the ledger's write lock
        (concurrent runs on overlapping new sources cannot both register): returns the
        :meth:`datasets` row of the dataset charged, with ``how``:

        * 'new': it shares no key and no record with any registered dataset: registered under
          ``key`` with (``name``, ``epsilon_cap``, ``delta``) and its record digests;
        * 'key' / 'legacy' / 'records': it is, or shares records with, exactly one registered
          dataset: charged to it (its cap, δ and name stay; the caller checks its terms), and
          the source's records that dataset did not hold are added to it (so any later source
          holding them is charged to it too);
        * two or more: refused (:class:`RecordOverlapError`), nothing recorded.

        ``digests``: the source's keyed record digests (16 bytes each, end to end or as a list);
        ``legacy_key``: its key before schema 5 (a dataset registered then has no digests and
        gets them here). ``unit``: the source's privacy unit; a source matched to a dataset of
        another unit is refused (:class:`UnitMismatchError`), nothing recorded."""
        _check_text(key, "key")
        _check_text(name, "name")
        _check_text(unit, "unit")
        epsilon_cap = check_epsilon(epsilon_cap, "epsilon_cap")
        delta = check_delta(delta, "delta")
        digest_list = self._digest_list(digests)
        with self._write() as conn:
            found, owners = self._source_match(conn, key, digest_list, legacy_key)
            if len(found) > 1:
                raise self._overlap_error(conn, found, key, name)
            now = _now()
            if not found:
                fp, how = key, "new"
                _q(conn, "INSERT INTO datasets (fingerprint, name, epsilon_cap, delta, created_at, updated_at, unit)"
                         " VALUES (?, ?, ?, ?, ?, ?, ?)", (key, name, epsilon_cap, delta, now, now, unit))
                self._trail(conn, "register", key, name=name, epsilon_cap=epsilon_cap, delta=delta,
                            records=len(digest_list), **({"unit": unit} if unit != "record" else {}))
            else:
                ((fp, how),) = found.items()
                row = self._dataset_row(conn, fp)
                if row["unit"] != unit:  # before any record is added to it
                    raise UnitMismatchError(unit_mismatch_message(row["name"], fp, row["unit"], unit))
            if owners is not None and digest_list:  # None: the dataset holds every record already
                set_id = self._record_set_id(conn, fp)
                if set_id is None:
                    _q(conn, "INSERT INTO record_sets (fingerprint, created_at) VALUES (?, ?)", (fp, now))
                    set_id = self._record_set_id(conn, fp)
                held = owners.get(fp, set())
                missing = [d for d in digest_list if d not in held]  # sorted: appends to the B-tree
                self._insert_digests(conn, set_id, missing)
                if how != "new" and missing:
                    # no count of the records added: with the source's size it would tell whoever
                    # wrote the source how many of its rows the dataset held (the refusals give none)
                    self._trail(conn, "records", fp, source_key=key, source_name=name, matched_by=how)
        return {**self.dataset(fp), "how": how}

    def _insert_digests(self, conn: sa.Connection, set_id: int, digests: list[bytes]) -> None:
        """Bulk insert (one executemany): SQLite through its driver (SQLAlchemy's per-row parameter
        handling took 3/4 of a 69k-record registration), PostgreSQL through SQLAlchemy's batched
        multi-row VALUES."""
        if not digests:
            return
        if self._store.dialect == "sqlite":
            conn.exec_driver_sql("INSERT INTO dataset_records (digest, set_id) VALUES (?, ?)",
                                 [(d, set_id) for d in digests])
        else:
            from .ledger_store import records_table

            conn.execute(records_table.insert(), [{"digest": d, "set_id": set_id} for d in digests])

    def record_digests(self, fingerprint: str) -> bytes:
        """The keyed record digests a dataset holds, sorted, end to end (b"" when none are known)."""
        with self._read() as conn:
            self._dataset_row(conn, fingerprint)
            set_id = self._record_set_id(conn, fingerprint)
            if set_id is None:
                return b""
            rows = _q(conn, "SELECT digest FROM dataset_records WHERE set_id = ? ORDER BY digest", (set_id,))
            return b"".join(bytes(r["digest"]) for r in rows)

    # -- reserving, committing, aborting --

    def reserve(self, fingerprint: str, run_id: str, event: ev.DpEvent, description: str = "",
                allow_delta_at_least_one_over_n: bool = False) -> Reservation:
        """Reserve ``event`` (the run's declared worst case) against the dataset's budget.

        Call this before the run touches private data. The events of all reserved and committed
        entries of the dataset and the new one are composed by the accountant at the dataset's δ;
        if that ε exceeds the cap, :class:`BudgetExceededError` is raised and nothing is recorded.
        The check and the insert are one ``BEGIN IMMEDIATE`` transaction, so concurrent
        reservations (threads or processes) are serialised.

        Idempotent per ``run_id``: the same run id with the same event returns the existing entry
        (``Reservation.new`` is False) without charging again; with a different event, or for a
        different dataset, it raises ``ValueError``. An entry that was aborted or released is
        reserved again (with a fresh budget check).

        A dataset composed at δ ≥ 1/n (n: the records the ledger knows it by) is refused unless the
        caller passes ``allow_delta_at_least_one_over_n`` (a config's explicit, recorded opt-in).
        """
        _check_text(fingerprint, "fingerprint")
        _check_text(run_id, "run_id")
        _check_text(description, "description", allow_empty=True)
        event_json = _event_json(event)
        event = ev.event_from_json(event_json)
        with self._write() as conn:
            ds = self._dataset_row(conn, fingerprint)
            cap, delta = ds["epsilon_cap"], ds["delta"]
            row = _q(conn, "SELECT * FROM entries WHERE run_id = ?", (run_id,)).fetchone()
            if row is not None:
                if row["fingerprint"] != fingerprint:
                    raise ValueError(
                        f"run_id {run_id!r} is already in the ledger for another dataset "
                        f"(fingerprint {_short(row['fingerprint'])}); use one run id per dataset")
                if row["kind"] != "dp":
                    raise ValueError(f"run_id {run_id!r} is already recorded as a non-private use; "
                                     "use a new run id")
                if row["reserved_event"] != event_json:
                    raise ValueError(
                        f"run_id {run_id!r} already reserved a different event "
                        f"({row['reserved_event']}); a retry must reserve the same event "
                        f"(got {event_json}), a new run needs a new run id")
                if row["status"] not in ("aborted", "released"):
                    total = self._spent_in(conn, fingerprint)[1].epsilon
                    return Reservation(
                        run_id=run_id, fingerprint=fingerprint, event=event,
                        epsilon=row["epsilon_reserved"], delta=delta, epsilon_cap=cap,
                        spent_epsilon=total, remaining_epsilon=max(0.0, cap - total),
                        status=row["status"], created_at=row["created_at"], new=False)

            n = self._record_count(conn, fingerprint)
            if n is not None and delta >= 1.0 / n and not allow_delta_at_least_one_over_n:  # n is not in the message (the rule of check_delta)
                raise ValueError(
                    f"dataset {ds['name']!r} (fingerprint {_short(fingerprint)}) is composed at δ={delta:g}, which is "
                    ">= 1/n for the n records the ledger knows it by: such a δ permits releasing whole records; "
                    f"lower it (privprompt budget set-delta) before running; run {run_id!r} was not recorded")
            existing = self._counted_events(conn, fingerprint)
            floor = self._delta_floor(conn, fingerprint)  # a δ change never lowers what is spent
            alone = spend(ev.ComposedEvent((event,)), delta).epsilon
            total = max(floor, _compose(existing + [event_json], delta).epsilon)
            if not total <= cap:
                spent_eps = max(floor, _compose(existing, delta).epsilon)
                remaining = max(0.0, cap - spent_eps)
                raise BudgetExceededError(
                    f"privacy budget for dataset {ds['name']!r} (fingerprint {_short(fingerprint)}) "
                    f"exhausted: this run needs ε={_fmt(alone)}, already spent ε={_fmt(spent_eps)} "
                    f"of cap ε={_fmt(cap)} at δ={delta:g}; remaining ε={_fmt(remaining)} (cap − spent; ε composes "
                    f"sub-additively, so a run above it may still fit); composed with the {len(existing)} "
                    f"counted entries the total would be ε={_fmt(total)}; run {run_id!r} was not recorded",
                    fingerprint=fingerprint, name=ds["name"], needed=alone, spent=spent_eps,
                    total=total, cap=cap, delta=delta)
            now = _now()
            if row is None:
                _q(conn, 
                    "INSERT INTO entries (run_id, fingerprint, kind, status, reserved_event,"
                    " epsilon_reserved, description, created_at)"
                    " VALUES (?, ?, 'dp', 'reserved', ?, ?, ?, ?)",
                    (run_id, fingerprint, event_json, alone, description, now))
                created = now
                self._trail(conn, "reserve", fingerprint, run_id, epsilon=alone, spent_epsilon=total, cap=cap,
                            event=json.loads(event_json), description=description)
            else:  # re-reserving an aborted or released entry (a Prefect retry of a released run)
                _q(conn, 
                    "UPDATE entries SET status = 'reserved', epsilon_reserved = ?, description = ?,"
                    " abort_reason = NULL, aborted_at = NULL, released_at = NULL, release_reason = NULL,"
                    " created_at = ? WHERE run_id = ?",
                    (alone, description or row["description"], now, run_id))
                created = now
                self._trail(conn, "reserve", fingerprint, run_id, epsilon=alone, spent_epsilon=total, cap=cap,
                            event=json.loads(event_json), description=description or row["description"],
                            again_after=row["status"])
        return Reservation(run_id=run_id, fingerprint=fingerprint, event=event, epsilon=alone,
                           delta=delta, epsilon_cap=cap, spent_epsilon=total,
                           remaining_epsilon=max(0.0, cap - total), status="reserved",
                           created_at=created, new=True)

    def commit(self, run_id: str, event: ev.DpEvent) -> dict[str, Any]:
        """Record what a reserved run actually spent; returns its ``entries()`` row.

        The committed event replaces the reserved one in every later composition. It may be
        smaller than the reservation (early stop). If its ε (alone, at the dataset's δ) is larger
        than the reserved ε, the run broke its declared worst case: the ledger still records the
        committed event (what was spent stays spent, even past the cap) and then raises
        ``ValueError``. Committing the same event again is a no-op (a retry); a different event
        for a committed entry, or committing an aborted entry, raises ``ValueError``.
        """
        event_json = _event_json(event)
        with self._write() as conn:
            row = self._entry_row(conn, run_id)
            if row["kind"] != "dp":
                raise ValueError(f"run_id {run_id!r} is a non-private use: there is nothing to commit")
            if row["status"] == "aborted":
                raise ValueError(f"run_id {run_id!r} was aborted ({row['abort_reason']}); an aborted run "
                                 "must not have touched private data, so it cannot commit a spend")
            if row["status"] == "released":
                raise ValueError(f"run_id {run_id!r} was released ({row['release_reason']}): it read no private "
                                 "record, so it cannot commit a spend")
            ds = self._dataset_row(conn, row["fingerprint"])
            if row["status"] == "committed":
                if row["committed_event"] != event_json:
                    raise ValueError(
                        f"run_id {run_id!r} already committed a different event "
                        f"({row['committed_event']}); got {event_json}")
                over = bool(row["over_reservation"])
                alone = row["epsilon_committed"]
            else:
                alone = spend(ev.ComposedEvent((ev.event_from_json(event_json),)), ds["delta"]).epsilon
                over = alone > row["epsilon_reserved"] * (1.0 + _EPS_RTOL) + 1e-12
                _q(conn, 
                    "UPDATE entries SET status = 'committed', committed_event = ?, epsilon_committed = ?,"
                    " over_reservation = ?, committed_at = ? WHERE run_id = ?",
                    (event_json, alone, int(over), _now(), run_id))
                self._trail(conn, "commit", row["fingerprint"], run_id, epsilon=alone,
                            epsilon_reserved=row["epsilon_reserved"], over_reservation=over,
                            event=json.loads(event_json))
        if over:
            raise ValueError(
                f"run {run_id!r} committed ε={_fmt(alone)} but reserved only "
                f"ε={_fmt(row['epsilon_reserved'])} at δ={ds['delta']:g}: the reservation was not the "
                "run's worst case. The ledger records the committed event (a spent budget stays "
                "spent), which may put the dataset over its cap")
        return self._entry_dict_for(run_id)

    def abort(self, run_id: str, reason: str) -> dict[str, Any]:
        """Mark a *reserved* entry 'aborted'; it then costs nothing. Returns its ``entries()`` row.

        ONLY for runs that provably never touched private data (e.g. the config failed validation
        before any data was loaded). A run that crashed after loading data must keep its
        reservation: it counts in full. Committed entries cannot be aborted (a spent budget stays
        spent). Aborting an aborted entry again is a no-op.
        """
        _check_text(reason, "reason")
        with self._write() as conn:
            row = self._entry_row(conn, run_id)
            if row["kind"] != "dp":
                raise ValueError(f"run_id {run_id!r} is a non-private use; it cannot be aborted")
            if row["status"] == "committed":
                raise ValueError(f"run_id {run_id!r} is committed: its spend cannot be undone")
            if row["status"] == "reserved" and row["read_started_at"] is not None:
                raise ValueError(f"run_id {run_id!r} began reading private data at {row['read_started_at']}: "
                                 "its reservation stays spent")
            if row["status"] == "reserved":
                _q(conn, 
                    "UPDATE entries SET status = 'aborted', abort_reason = ?, aborted_at = ?"
                    " WHERE run_id = ?", (reason, _now(), run_id))
                self._trail(conn, "abort", row["fingerprint"], run_id, reason=reason,
                            epsilon_reserved=row["epsilon_reserved"])
        return self._entry_dict_for(run_id)

    def mark_read(self, run_id: str) -> dict[str, Any]:
        """Record that run ``run_id`` is about to read private records (call it BEFORE the first
        read). From then on its reservation can never be released: it stays spent. Marking again
        keeps the first time. Returns its ``entries()`` row."""
        with self._write() as conn:
            row = self._entry_row(conn, run_id)
            if row["kind"] != "dp" or row["status"] not in ("reserved", "committed"):
                raise ValueError(f"run_id {run_id!r} is a {row['kind']} entry with status {row['status']!r}: only a "
                                 "dp reservation is marked read")
            if row["read_started_at"] is None:
                _q(conn, "UPDATE entries SET read_started_at = ? WHERE run_id = ?", (_now(), run_id))
                self._trail(conn, "mark_read", row["fingerprint"], run_id, epsilon_reserved=row["epsilon_reserved"])
        return self._entry_dict_for(run_id)

    def release(self, run_id: str, reason: str) -> dict[str, Any]:
        """Release the reservation of a run that failed before it read any private record: the entry
        becomes 'released' (costs nothing) and keeps ``reason`` and the time in the ledger. Refused
        (``ValueError``) for an entry marked read (``mark_read``): after the first read a reservation
        stays spent. Releasing a released entry again is a no-op. Returns its ``entries()`` row."""
        _check_text(reason, "reason")
        with self._write() as conn:
            row = self._entry_row(conn, run_id)
            if row["kind"] != "dp":
                raise ValueError(f"run_id {run_id!r} is a {row['kind']} use; only a dp reservation is released")
            if row["status"] == "released":
                return self._entry_dict(row, self._dataset_row(conn, row["fingerprint"])["name"])
            if row["status"] != "reserved":
                raise ValueError(f"run_id {run_id!r} is {row['status']}: only an open reservation is released")
            if row["read_started_at"] is not None:
                raise ValueError(f"run_id {run_id!r} began reading private data at {row['read_started_at']}: "
                                 "its reservation stays spent")
            _q(conn, "UPDATE entries SET status = 'released', released_at = ?, release_reason = ? WHERE run_id = ?",
                         (_now(), reason, run_id))
            self._trail(conn, "release", row["fingerprint"], run_id, reason=reason,
                        epsilon_reserved=row["epsilon_reserved"])
        return self._entry_dict_for(run_id)

    def open_reservations(self, fingerprint: str | None = None) -> list[dict[str, Any]]:
        """Entries holding a reservation (status 'reserved'): runs in progress, or runs that
        stopped without committing (counted in full; ``read_started_at`` says whether they began
        reading private data)."""
        return [e for e in self.entries(fingerprint) if e["kind"] == "dp" and e["status"] == "reserved"]

    def counted_events(self, fingerprint: str) -> list[ev.DpEvent]:
        """The events the dataset's budget composes (committed, or reserved), oldest first."""
        with self._read() as conn:
            self._dataset_row(conn, fingerprint)
            return [ev.event_from_json(text) for text in self._counted_events(conn, fingerprint)]

    def record_nonprivate(self, fingerprint: str, run_id: str, description: str) -> dict[str, Any]:
        """Record a use of the dataset without any DP guarantee (e.g. a non-private baseline).

        It is not composed into ε (it has no finite ε), but it is listed everywhere so it is
        never silently ignored. Recording the same run id again is a no-op. Returns its row.
        """
        return self._record_use("nonprivate", fingerprint, run_id, description)

    def record_ldp(self, fingerprint: str, run_id: str, description: str, eta: float | None = None
                   ) -> dict[str, Any]:
        """Record a use under local (metric, d_X) privacy: each record was privatised on the local
        side before use, with no (ε, δ) statement about the dataset. Not composed into ε, listed
        as local-DP (not as non-private). Recording the same run id again is a no-op.

        ``eta``: this entry is one RELEASE — one independent d_X draw of (some of) the dataset's
        records at privacy parameter η. d_X privacy composes additively: a record in k releases
        is private at Σ η, so :meth:`datasets` reports ``ldp_eta_bound``, the sum over every
        release of the dataset (a bound for any one record; record it BEFORE the draw is made).
        Since recording a run id again is a no-op, every draw actually made needs its own run id
        (e.g. a fresh random suffix per draw): a draw made afresh under a reused id would be
        missing from the bound. A stored draw read back is no new release."""
        event = None
        if eta is not None:
            if not (isinstance(eta, (int, float)) and math.isfinite(eta) and eta > 0):
                raise ValueError(f"eta must be a finite number > 0, got {eta!r}")
            event = json.dumps({"mechanism": "d_X", "eta": float(eta)})
        return self._record_use("ldp", fingerprint, run_id, description, event)

    def _record_use(self, kind: str, fingerprint: str, run_id: str, description: str,
                    event: str | None = None) -> dict[str, Any]:
        _check_text(fingerprint, "fingerprint")
        _check_text(run_id, "run_id")
        _check_text(description, "description")
        with self._write() as conn:
            self._dataset_row(conn, fingerprint)
            row = _q(conn, "SELECT * FROM entries WHERE run_id = ?", (run_id,)).fetchone()
            if row is not None:
                if row["kind"] != kind or row["fingerprint"] != fingerprint:
                    raise ValueError(f"run_id {run_id!r} is already in the ledger as a "
                                     f"{row['kind']} entry for fingerprint {_short(row['fingerprint'])}")
            else:
                _q(conn, 
                    "INSERT INTO entries (run_id, fingerprint, kind, status, committed_event, description,"
                    " created_at, committed_at) VALUES (?, ?, ?, 'committed', ?, ?, ?, ?)",
                    (run_id, fingerprint, kind, event, description, _now(), _now()))
                self._trail(conn, kind, fingerprint, run_id, description=description,
                            event=json.loads(event) if event else None)
        return self._entry_dict_for(run_id)

    def require_unit(self, fingerprint: str, unit: str) -> None:
        """Raise :class:`UnitMismatchError` when ``unit`` is not the dataset's privacy unit: its cap
        and every ε charged to it are stated for that unit. A record-level run on a dataset of a
        user unit is refused, not charged with a group-privacy bound: the number of records of the
        largest unit is a private statistic, and without a bound the group-privacy ε is unbounded (a
        run that bounds it — ``data.person_field`` with ``data.max_records_per_unit`` — comes here with
        the person's field as its unit and its group-privacy event: ``privacy.group``);
        so the ledger never under-counts a person."""
        row = self.dataset(fingerprint)
        if row["unit"] != unit:
            raise UnitMismatchError(unit_mismatch_message(row["name"], fingerprint, row["unit"], unit))

    def change_unit(self, fingerprint: str, unit: str, reason: str) -> dict[str, Any]:
        """Set the privacy unit of a dataset that nothing has been charged to yet (no dp entry in
        any status but released / aborted): its cap is then stated for ``unit``. Recorded in the
        trail with ``reason``. Refused once any ε is charged: that ε is stated for the old unit."""
        _check_text(unit, "unit")
        _check_text(reason, "reason")
        with self._write() as conn:
            row = self._dataset_row(conn, fingerprint)
            charged = _q(conn, "SELECT COUNT(*) AS n FROM entries WHERE fingerprint = ? AND kind = 'dp' "
                               "AND status IN ('reserved', 'committed')", (fingerprint,)).fetchone()["n"]
            if charged:
                raise ValueError(f"dataset {row['name']!r} (fingerprint {_short(fingerprint)}) has ε charged for its "
                                 f"privacy unit {row['unit']!r}: its unit is never changed after that")
            if row["unit"] != unit:
                _q(conn, "UPDATE datasets SET unit = ?, updated_at = ? WHERE fingerprint = ?", (unit, _now(), fingerprint))
                self._trail(conn, "unit_change", fingerprint, old_unit=row["unit"], new_unit=unit, reason=reason)
        return self.dataset(fingerprint)

    def require_delta(self, fingerprint: str, delta: float) -> None:
        """Raise :class:`DeltaMismatchError` when ``delta`` is not the dataset's δ: every entry of a
        dataset is composed at one δ, and a run planned at another would be mis-accounted."""
        row = self.dataset(fingerprint)
        if not math.isclose(row["delta"], delta, rel_tol=1e-9, abs_tol=0.0):
            raise DeltaMismatchError(
                f"this run's δ={delta:g} differs from δ={row['delta']:g} at which dataset {row['name']!r} "
                f"(fingerprint {_short(fingerprint)}) composes its budget; set privacy.target_delta: "
                f"{row['delta']:g} (or register the dataset anew with another δ deliberately)")

    def preview(self, fingerprint: str, events: list[ev.DpEvent], delta: float, cap: float | None = None,
                name: str | None = None) -> dict[str, Any]:
        """A dry run: ``events`` composed with what the dataset has spent, WITHOUT writing.

        For a dataset not registered yet, nothing is spent and ``cap`` / ``name`` come from the
        arguments. Returns {name, cap, delta, spent_epsilon, planned_epsilon (each event alone),
        total_epsilon, remaining_after, fits}."""
        with self._read() as conn:
            row = _q(conn, "SELECT * FROM datasets WHERE fingerprint = ?", (fingerprint,)).fetchone()
            existing = self._counted_events(conn, fingerprint) if row is not None else []
            floor = self._delta_floor(conn, fingerprint) if row is not None else 0.0
        if row is None:
            return Ledger.preview_new(events, delta, cap, name)
        if not math.isclose(row["delta"], delta, rel_tol=1e-9, abs_tol=0.0):
            self.require_delta(fingerprint, delta)
        return _preview(existing, events, row["delta"], row["epsilon_cap"], row["name"], floor)

    @staticmethod
    def preview_new(events: list[ev.DpEvent], delta: float, cap: float | None, name: str | None = None
                    ) -> dict[str, Any]:
        """:meth:`preview` for a dataset no ledger has seen: nothing spent yet."""
        if cap is None:
            raise ValueError("a preview for an unregistered dataset needs its cap")
        return _preview([], events, check_delta(delta, "delta"), check_epsilon(cap, "cap"), name or "")

    # -- the team key, the trail, export and import --

    # The team key (the HMAC key of record digests, dataset fingerprints and keyed splits) is NEVER
    # kept in the ledger's database: with it, the 16-byte record digests stored here answer "is this
    # text in the data?" for any text. The database keeps its id only (``key_id_of``), so that a
    # machine holding the wrong key, or none, is told so. Where the key lives: tasks/state.py.

    def team_key_id(self) -> str | None:
        """The id (:func:`key_id_of`) of the key this ledger's datasets are keyed with, None when none
        is recorded."""
        with self._read() as conn:
            return self._key_id_in(conn)

    @staticmethod
    def _key_id_in(conn: sa.Connection) -> str | None:
        row = _q(conn, "SELECT value FROM ledger_meta WHERE name = ?", (TEAM_KEY_ID,)).fetchone()
        return row["value"] if row is not None else None

    def set_team_key_id(self, key_id: str, minted: bool = False) -> str:
        """Record ``key_id`` as the id of this ledger's team key, in one locked transaction; returns
        the id recorded. The same id again is a no-op. A different recorded id: ``minted`` (a key
        just created on another machine at the same moment) returns the recorded one, which the
        caller must then use; otherwise :class:`LedgerKeyError`. Minting is refused over a ledger that
        already has datasets: their fingerprints were made with another key, and a new key would give
        each a fresh cap."""
        if not isinstance(key_id, str) or len(key_id) != 16 or any(c not in "0123456789abcdef" for c in key_id):
            raise LedgerKeyError(f"a key id is 16 hex digits, got {key_id!r}")
        with self._write() as conn:
            stored = self._key_id_in(conn)
            if stored is not None:
                if stored == key_id or minted:
                    return stored
                raise LedgerKeyError(f"ledger {self.location} keeps its datasets under team key {stored}, not {key_id}: "
                                     "refusing to change it (every registered fingerprint depends on it)")
            n = _q(conn, "SELECT COUNT(*) AS n FROM datasets").fetchone()["n"]
            if minted and n:
                raise LedgerKeyError(
                    f"ledger {self.location} has {n} registered dataset(s) but no team key recorded: their fingerprints "
                    "were made with another key, and a new key would give each dataset a fresh cap; import the key they "
                    "were made with: privprompt key import KEYFILE (e.g. <state>/secrets/installation.key of the "
                    "machine whose ledger was imported)")
            _q(conn, "INSERT INTO ledger_meta (name, value) VALUES (?, ?)", (TEAM_KEY_ID, key_id))
            self._trail(conn, "team_key", None, None, how="minted" if minted else "set", key_id=key_id,
                        datasets_registered=n)
        return key_id

    def has_datasets(self) -> bool:
        """Whether any dataset is registered (its fingerprint was made with some key)."""
        with self._read() as conn:
            return _q(conn, "SELECT COUNT(*) AS n FROM datasets").fetchone()["n"] > 0

    def holds_legacy_team_key(self) -> bool:
        """Whether the database still has the ``team_key`` table of schemas 4-6 (a key to move out)."""
        with self._read() as conn:
            return sa.inspect(conn).has_table(LEGACY_TEAM_KEY_TABLE)

    def move_team_key_out(self, keep) -> bytes | None:
        """Move the team key that schemas 4-6 kept in the database out of it: ``keep(key)`` stores it
        (a key file; it must raise if it cannot) BEFORE anything is deleted, then, in the same locked
        transaction, the key's id is recorded, the row is overwritten and deleted and the table
        dropped, and a 'team_key_moved' row is appended to the trail. A SQLite file is then vacuumed
        (no free page or log keeps the key). No entry, dataset, digest or trail row is touched.
        Returns the key moved (None: the database held none; a leftover empty table is dropped)."""
        if not self.holds_legacy_team_key():
            return None
        key = None
        with self._write() as conn:
            if not sa.inspect(conn).has_table(LEGACY_TEAM_KEY_TABLE):
                return None  # another process moved it in between
            if self._store.dialect == "sqlite":
                conn.exec_driver_sql("PRAGMA secure_delete = ON")  # deleted cells are zeroed
            row = _q(conn, f"SELECT key, created_at FROM {LEGACY_TEAM_KEY_TABLE} WHERE id = 1").fetchone()
            if row is not None:
                key = bytes(row["key"])
                if len(key) != 32:
                    raise LedgerKeyError(f"ledger {self.location} holds a team key of {len(key)} bytes, not 32: "
                                         "it is not moved")
                key_id = key_id_of(key)
                stored = self._key_id_in(conn)
                if stored is not None and stored != key_id:
                    raise LedgerKeyError(f"ledger {self.location} holds a team key {key_id} in its database and records "
                                         f"another key id {stored}: it is not moved; restore the ledger from a backup")
                keep(key)  # the key is safe elsewhere before it leaves the database
                if stored is None:
                    _q(conn, "INSERT INTO ledger_meta (name, value) VALUES (?, ?)", (TEAM_KEY_ID, key_id))
                _q(conn, f"UPDATE {LEGACY_TEAM_KEY_TABLE} SET key = ? WHERE id = 1", (b"\0" * len(key),))
                _q(conn, f"DELETE FROM {LEGACY_TEAM_KEY_TABLE}")
                self._trail(conn, "team_key_moved", None, None, key_id=key_id, key_created_at=row["created_at"],
                            to="a key file outside the ledger database")
            conn.exec_driver_sql(f"DROP TABLE {LEGACY_TEAM_KEY_TABLE}")
        self._store.scrub()
        return key

    def trail(self, fingerprint: str | None = None, run_id: str | None = None) -> list[dict[str, Any]]:
        """The audit trail, oldest first (of one dataset and/or run): every change to the ledger with
        its time, action, details, machine (``host``), OS user and process id."""
        clauses, params = [], []
        if fingerprint is not None:
            clauses.append("fingerprint = ?")
            params.append(fingerprint)
        if run_id is not None:
            clauses.append("run_id = ?")
            params.append(run_id)
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        with self._read() as conn:
            rows = _q(conn, f"SELECT * FROM trail{where} ORDER BY id", tuple(params)).fetchall()
        return [{**dict(r), "detail": json.loads(r["detail"])} for r in rows]

    def export(self) -> dict[str, Any]:
        """The whole ledger as JSON-able data, from one snapshot: every row of ``datasets``,
        ``entries``, ``cap_changes`` and ``trail`` as stored (events as JSON text), each dataset's
        keyed record digests (``record_digests``: fingerprint → base64 of its sorted 16-byte
        digests end to end; keyed, never text), and a computed ``summary`` (:meth:`datasets`). The team
        key is never in the ledger, so never in an export: only its id (``team_key_id``)."""
        with self._read() as conn:
            tables = {t: [dict(r) for r in _q(conn, f"SELECT * FROM {t} ORDER BY "
                                                   f"{'fingerprint' if t == 'datasets' else 'id'}").fetchall()]
                      for t in _TABLES}
            key_id = self._key_id_in(conn)
            digests: dict[str, list[bytes]] = {}
            for r in _q(conn, "SELECT s.fingerprint AS fingerprint, r.digest AS digest FROM dataset_records r "
                              "JOIN record_sets s ON s.id = r.set_id ORDER BY s.fingerprint, r.digest"):
                digests.setdefault(r["fingerprint"], []).append(bytes(r["digest"]))
            for r in _q(conn, "SELECT fingerprint FROM record_sets"):
                digests.setdefault(r["fingerprint"], [])
        # keyed digests only (base64 of the sorted 16-byte digests end to end): as private as the ledger
        records = {fp: base64.b64encode(b"".join(ds)).decode("ascii") for fp, ds in sorted(digests.items())}
        return {"format": EXPORT_FORMAT, "schema_version": SCHEMA_VERSION, "exported_at": _now(),
                "ledger": self.location, "team_key_id": key_id,
                **tables, "record_digests": records, "summary": self.datasets()}

    def import_ledger(self, data: dict[str, Any], team_key: bytes | None = None) -> dict[str, int]:
        """Restore an :meth:`export` into this ledger, which must be empty (no dataset, entry, cap
        change or trail row): the rows keep their ids, times and statuses, so a restored ledger
        composes exactly as the exported one. The export's ``team_key_id`` is recorded as the
        ledger's; ``team_key`` (the key itself, 32 bytes): its id is recorded (never the key) and
        must agree with the export's.
        Appends one 'import' row to the trail. Returns the number of rows per table."""
        if not isinstance(data, dict) or data.get("format") != EXPORT_FORMAT:
            raise LedgerError(f"not a ledger export (its 'format' is not {EXPORT_FORMAT!r}): "
                             "make one with privprompt ledger --json")
        if not isinstance(data.get("schema_version"), int) or data["schema_version"] > SCHEMA_VERSION:
            raise LedgerError(f"ledger export of schema version {data.get('schema_version')!r}; this code reads up "
                             f"to {SCHEMA_VERSION}: upgrade privprompt")
        for t in _TABLES:
            if not isinstance(data.get(t, []), list) or not all(isinstance(r, dict) for r in data.get(t, [])):
                raise LedgerError(f"ledger export: {t!r} must be a list of rows")
        records = data.get("record_digests") or {}
        if not isinstance(records, dict) or not all(isinstance(v, str) for v in records.values()):
            raise LedgerError("ledger export: 'record_digests' must map fingerprints to base64 text")
        known = {r.get("fingerprint") for r in data.get("datasets", [])}
        decoded: dict[str, list[bytes]] = {}
        for fp, text in records.items():
            if fp not in known:
                raise LedgerError(f"ledger export: record digests of an unknown dataset {_short(str(fp))}")
            try:
                decoded[fp] = self._digest_list(base64.b64decode(text.encode("ascii"), validate=True))
            except (ValueError, UnicodeEncodeError):
                raise LedgerError(f"ledger export: the record digests of dataset {_short(fp)} are not "
                                  f"{RECORD_DIGEST_BYTES}-byte digests in base64") from None
        columns = {t.name: [c.name for c in t.columns] for t in _store_tables()}
        if team_key is not None and (not isinstance(team_key, (bytes, bytearray)) or len(team_key) != 32):
            raise LedgerKeyError("a team key is 32 bytes")
        key_id = data.get("team_key_id")
        if key_id is not None and (not isinstance(key_id, str) or len(key_id) != 16):
            raise LedgerError("ledger export: 'team_key_id' must be 16 hex digits")
        if team_key is not None:
            if key_id is not None and key_id_of(bytes(team_key)) != key_id:
                raise LedgerKeyError(f"the key given is not the one the export's datasets were keyed with "
                                     f"(key id {key_id_of(bytes(team_key))}, the export's {key_id})")
            key_id = key_id_of(bytes(team_key))
        with self._write() as conn:
            present = {t: _q(conn, f"SELECT COUNT(*) AS n FROM {t}").fetchone()["n"] for t in _TABLES}
            if any(present.values()):
                raise LedgerError(f"ledger {self.location} is not empty ("
                                 + ", ".join(f"{n} {t}" for t, n in present.items() if n)
                                 + "): import restores into an empty ledger only")
            counts = {}
            for t in _TABLES:
                rows = data.get(t, [])
                for r in rows:
                    unknown = set(r) - set(columns[t])
                    if unknown:
                        raise LedgerError(f"ledger export: unknown column(s) {sorted(unknown)} in table {t!r}")
                    names = [c for c in columns[t] if c in r]
                    _q(conn, f"INSERT INTO {t} ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})",
                       tuple(r[c] for c in names))
                counts[t] = len(rows)
            n_digests = 0
            for fp, digest_list in decoded.items():
                _q(conn, "INSERT INTO record_sets (fingerprint, created_at) VALUES (?, ?)", (fp, _now()))
                set_id = self._record_set_id(conn, fp)
                if digest_list:
                    try:  # the transaction rolls back whole
                        self._insert_digests(conn, set_id, digest_list)
                    except (sa.exc.IntegrityError, sqlite3.IntegrityError):
                        raise LedgerError(f"ledger export: a record digest of dataset {_short(fp)} is also another "
                                          "dataset's (a record belongs to one dataset)") from None
                n_digests += len(digest_list)
            if n_digests:
                counts["record_digests"] = n_digests
            if self._store.dialect == "postgresql":  # the sequences continue after the restored ids
                for t in ("entries", "cap_changes", "trail", "record_sets"):
                    _q(conn, f"SELECT setval(pg_get_serial_sequence('{t}', 'id'), COALESCE(MAX(id), 1), "
                             f"MAX(id) IS NOT NULL) FROM {t}")
            if key_id is not None:
                stored = self._key_id_in(conn)
                if stored is not None and stored != key_id:
                    raise LedgerKeyError(f"ledger {self.location} already records another team key ({stored}, "
                                         f"the import's {key_id})")
                if stored is None:
                    _q(conn, "INSERT INTO ledger_meta (name, value) VALUES (?, ?)", (TEAM_KEY_ID, key_id))
            self._trail(conn, "import", None, None, source_ledger=data.get("ledger"),
                        exported_at=data.get("exported_at"), rows=counts, team_key_id=key_id)
            if data["schema_version"] < 8:  # what the migration of a ledger of that schema does
                self._undo_unrecorded_delta_raises(conn, f"the schema-{data['schema_version']} export")
        return counts

    # -- queries --

    def spent(self, fingerprint: str) -> PrivacySpend:
        """Composed spend of all reserved and committed DP entries at the dataset's δ."""
        with self._read() as conn:
            return self._spent_in(conn, fingerprint)[1]

    def remaining(self, fingerprint: str) -> float:
        """ε_cap − spent ε, never below 0."""
        with self._read() as conn:
            ds, s = self._spent_in(conn, fingerprint)
        return max(0.0, ds["epsilon_cap"] - s.epsilon)

    @staticmethod
    def _entry_dict(row: Any, name: str) -> dict[str, Any]:
        counted = _counted_event_json(row)
        if row["kind"] != "dp":
            epsilon = None  # no DP guarantee
        elif row["status"] in ("aborted", "released"):
            epsilon = 0.0
        elif row["status"] == "committed":
            epsilon = row["epsilon_committed"]
        else:
            epsilon = row["epsilon_reserved"]
        shown = counted or row["reserved_event"]
        return {
            "run_id": row["run_id"],
            "fingerprint": row["fingerprint"],
            "dataset": name,
            "kind": row["kind"],
            "status": row["status"],
            "epsilon": epsilon,
            "epsilon_reserved": row["epsilon_reserved"],
            "epsilon_committed": row["epsilon_committed"],
            "over_reservation": bool(row["over_reservation"]),
            "event": json.loads(shown) if shown else None,
            "reserved_event": json.loads(row["reserved_event"]) if row["reserved_event"] else None,
            "committed_event": json.loads(row["committed_event"]) if row["committed_event"] else None,
            "description": row["description"],
            "abort_reason": row["abort_reason"],
            "created_at": row["created_at"],
            "committed_at": row["committed_at"],
            "aborted_at": row["aborted_at"],
            "read_started_at": row["read_started_at"],
            "released_at": row["released_at"],
            "release_reason": row["release_reason"],
        }

    def _entry_dict_for(self, run_id: str) -> dict[str, Any]:
        with self._read() as conn:
            row = self._entry_row(conn, run_id)
            name = self._dataset_row(conn, row["fingerprint"])["name"]
        return self._entry_dict(row, name)

    def entry(self, run_id: str) -> dict[str, Any]:
        """One entry, as in :meth:`entries`."""
        return self._entry_dict_for(run_id)

    def entries(self, fingerprint: str | None = None) -> list[dict[str, Any]]:
        """All entries (of one dataset, or all), oldest first.

        ``epsilon`` is what the entry costs alone at its dataset's δ: the committed ε if
        committed, the reserved ε if reserved, 0 if aborted, ``None`` for non-private uses
        (no guarantee). ``event`` is the event it is composed with (JSON dict).
        """
        with self._read() as conn:
            names = {r["fingerprint"]: r["name"] for r in _q(conn, "SELECT fingerprint, name FROM datasets")}
            if fingerprint is None:
                rows = _q(conn, "SELECT * FROM entries ORDER BY id").fetchall()
            else:
                self._dataset_row(conn, fingerprint)
                rows = _q(conn, "SELECT * FROM entries WHERE fingerprint = ? ORDER BY id",
                                    (fingerprint,)).fetchall()
        return [self._entry_dict(r, names[r["fingerprint"]]) for r in rows]

    def _dataset_dicts(self, fingerprint: str | None) -> list[dict[str, Any]]:
        with self._read() as conn:
            if fingerprint is None:
                rows = _q(conn, "SELECT * FROM datasets ORDER BY created_at, fingerprint").fetchall()
            else:
                rows = [self._dataset_row(conn, fingerprint)]
            known = {r["fingerprint"] for r in _q(conn, "SELECT fingerprint FROM record_sets")}
            out = []
            for ds in rows:
                fp = ds["fingerprint"]
                s = self._spent_in(conn, fp)[1]
                counts = {(r["kind"], r["status"]): r["n"] for r in _q(conn,
                    "SELECT kind, status, COUNT(*) AS n FROM entries WHERE fingerprint = ? GROUP BY kind, status",
                    (fp,))}
                releases = [json.loads(r["committed_event"])["eta"] for r in _q(conn, 
                    "SELECT committed_event FROM entries WHERE fingerprint = ? AND kind = 'ldp' "
                    "AND committed_event IS NOT NULL", (fp,))]
                out.append({
                    "fingerprint": fp,
                    "name": ds["name"],
                    "epsilon_cap": ds["epsilon_cap"],
                    "delta": ds["delta"],
                    "unit": ds["unit"],  # the privacy unit the cap and every charge are stated for
                    "spent_epsilon": s.epsilon,
                    "remaining_epsilon": max(0.0, ds["epsilon_cap"] - s.epsilon),
                    "reserved_runs": counts.get(("dp", "reserved"), 0),
                    "committed_runs": counts.get(("dp", "committed"), 0),
                    "aborted_runs": counts.get(("dp", "aborted"), 0),
                    "released_runs": counts.get(("dp", "released"), 0),
                    "nonprivate_uses": counts.get(("nonprivate", "committed"), 0),
                    "ldp_uses": counts.get(("ldp", "committed"), 0) - len(releases),
                    "ldp_releases": len(releases),
                    "ldp_eta_bound": float(sum(releases)) if releases else None,
                    "records_known": fp in known,  # its keyed record digests are kept (schema 5)
                    "created_at": ds["created_at"],
                    "updated_at": ds["updated_at"],
                })
        return out

    def dataset(self, fingerprint: str) -> dict[str, Any]:
        """One dataset, as in :meth:`datasets`."""
        return self._dataset_dicts(fingerprint)[0]

    def datasets(self) -> list[dict[str, Any]]:
        """Every registered dataset with its cap, δ, composed spent ε, remaining ε and run counts
        (``nonprivate_uses``: uses without any DP guarantee; ``ldp_uses``: runs on locally
        privatised inputs, ``ldp_releases`` the d_X draws they released and ``ldp_eta_bound`` the
        composed η of a record in all of them, None when none was recorded)."""
        return self._dataset_dicts(None)

    def summary_table(self, largest: dict[str, str] | None = None) -> str:
        """Plain-text summary (for ``privprompt ledger``): one line per dataset, what its columns
        mean, then every non-private use, which carries no DP guarantee and is not part of the ε
        column. ``largest``: fingerprint → a line saying the largest target ε of a config that
        still fits (computed by the caller, which knows the config)."""
        header = ("dataset", "fingerprint", "delta", "eps_cap", "eps_spent", "eps_left",
                  "reserved", "committed", "released", "aborted", "local-DP", "non-private")
        datasets = self.datasets()
        rows = [(d["name"], _short(d["fingerprint"]), f"{d['delta']:g}", _fmt(d["epsilon_cap"]),
                 _fmt(d["spent_epsilon"]), _fmt(d["remaining_epsilon"]), str(d["reserved_runs"]),
                 str(d["committed_runs"]), str(d["released_runs"]), str(d["aborted_runs"]), str(d["ldp_uses"]),
                 str(d["nonprivate_uses"]))
                for d in datasets]
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

        def line(cells):
            return "  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

        out = [f"privacy ledger {self.location}", line(header), line(["-" * w for w in widths])]
        out += [line(r) for r in rows] if rows else ["(no datasets registered)"]
        if rows:
            out += ["",
                    "eps_spent: the composed ε (accountant, at the dataset's δ) of every committed and reserved DP run;",
                    "  eps_left = eps_cap − eps_spent is no bound on one run's ε: ε composes sub-additively",
                    "  (privprompt plan CONFIG / privprompt ledger --config CONFIG: the largest target_epsilon that fits).",
                    "Counts of DP runs: reserved = holding a reservation (running, or stopped after reading private",
                    "  data: counted in full; privprompt budget reservations), committed = finished (their actual ε",
                    "  counts), released = failed before reading any private record (cost nothing), aborted = cancelled",
                    "  before any private read (cost nothing). local-DP / non-private: uses without an (ε, δ) claim."]
        for d in datasets:
            if not d["records_known"]:
                out.append(f"{d['name']} ({_short(d['fingerprint'])}): its records are not known yet (registered before the "
                           "ledger kept record digests, or without them): its next run on the same files keeps them; "
                           "until then a copy of its records in another export is not recognised")
        for d in datasets:
            if largest and d["fingerprint"] in largest:
                out.append(f"{d['name']} ({_short(d['fingerprint'])}): {largest[d['fingerprint']]}")
        entries = self.entries()
        ldp = [e for e in entries if e["kind"] == "ldp"]
        nonprivate = [e for e in entries if e["kind"] == "nonprivate"]
        out.append("")
        for d in datasets:
            if d["ldp_releases"]:
                out.append(f"local-DP releases of {d['name']} ({_short(d['fingerprint'])}): {d['ldp_releases']} d_X "
                           f"draws; a record in all of them is private at η ≤ {d['ldp_eta_bound']:g} (η adds up)")
        if ldp:
            out.append(f"local-DP uses ({len(ldp)}; inputs privatised locally (d_X), no (ε, δ) claim):")
            for e in ldp:
                out.append(f"  {e['dataset']} ({_short(e['fingerprint'])})  run {e['run_id']}  "
                           f"{e['created_at']}  {e['description']}")
        if nonprivate:
            out.append(f"non-private uses ({len(nonprivate)}; no DP guarantee, not composed into eps):")
            for e in nonprivate:
                out.append(f"  {e['dataset']} ({_short(e['fingerprint'])})  run {e['run_id']}  "
                           f"{e['created_at']}  {e['description']}")
        else:
            out.append("non-private uses: none")
        return "\n".join(out) + "\n"
