"""A persistent privacy budget ledger on SQLite.

Every private training partition is identified by a *fingerprint* (e.g. the sha256 of its
records) and gets a cap (ε_cap, δ) when it is first registered. Every run that touches the
partition goes through the ledger:

1. ``reserve(fingerprint, run_id, event)`` **before** the run touches private data, with the
   run's declared worst-case event (e.g. the DP-SGD event of all planned steps). The ledger
   composes the events of *all* counted entries of the dataset plus the new one with the
   accountant (``spend(ComposedEvent(...), δ)``: composition of the stored events, never a sum
   of ε's) and refuses with :class:`BudgetExceededError` if the composed ε exceeds the cap.
   Reservation is atomic across processes: the check and the insert run in one
   ``BEGIN IMMEDIATE`` transaction, so concurrent reservations are serialised and can never
   overspend together.
2. ``commit(run_id, event)`` after the run, with the event it actually spent (it may be smaller,
   e.g. after early stopping). From then on the committed event is the one composed.

A spent budget stays spent:

* A run that crashes after it began reading private data keeps its reservation, and a
  reservation (status ``'reserved'``) counts in full: the run may have touched the data before
  it died. The lifecycle calls ``mark_read(run_id)`` BEFORE its first private read; from then
  on the entry can never be released.
* ``release(run_id, reason)`` is for a run that failed before that mark (a model that does not
  load, a config mistake found late): no private record was read, so the reservation costs
  nothing. The entry stays in the ledger with status ``'released'``, its reason and time (the
  audit trail); the ledger refuses it for an entry marked read.
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

Every ε the ledger reports comes from ``spend(ComposedEvent(events), δ)``, also for a single
entry. A ``ParallelEvent`` (disjoint data, e.g. DP-OPT's generation vs. selection) is therefore
always nested inside a composition, where the accountant bounds it less tightly than at the top
level (PLD composes the parts sequentially, RDP takes the pointwise maximum of their curves):
the ledger may count such a run slightly above the run's own report, never below it.

Events are stored as JSON (``event_to_dict``). The database uses WAL mode and a busy timeout, so
several processes (or machines sharing a local file system that supports SQLite locking) can use
one ledger file.

Pure stdlib ``sqlite3`` plus the accountant: no torch, Prefect or MLflow here.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from . import events as ev
from .accountant import PrivacySpend, spend
from .validation import check_delta, check_epsilon

__all__ = [
    "BudgetExceededError",
    "DeltaMismatchError",
    "Ledger",
    "Reservation",
    "UnknownDatasetError",
    "UnknownRunError",
]

SCHEMA_VERSION = 3  # 2: the 'ldp' kind of use; 3: 'released' entries, read marks, reasons of cap changes
DEFAULT_BUSY_TIMEOUT_S = 120.0
# Relative slack when comparing a committed ε with the reserved one (the accountant is
# deterministic; this only absorbs float noise).
_EPS_RTOL = 1e-9

_SCHEMA = """
CREATE TABLE IF NOT EXISTS datasets (
    fingerprint  TEXT PRIMARY KEY,
    name         TEXT NOT NULL,
    epsilon_cap  REAL NOT NULL CHECK (epsilon_cap > 0),
    delta        REAL NOT NULL CHECK (delta > 0 AND delta < 1),
    created_at   TEXT NOT NULL,
    updated_at   TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS entries (
    id                 INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id             TEXT NOT NULL UNIQUE,
    fingerprint        TEXT NOT NULL REFERENCES datasets(fingerprint),
    kind               TEXT NOT NULL CHECK (kind IN ('dp', 'nonprivate', 'ldp')),
    status             TEXT NOT NULL CHECK (status IN ('reserved', 'committed', 'aborted', 'released')),
    reserved_event     TEXT,
    committed_event    TEXT,
    epsilon_reserved   REAL,
    epsilon_committed  REAL,
    over_reservation   INTEGER NOT NULL DEFAULT 0,
    description        TEXT NOT NULL DEFAULT '',
    abort_reason       TEXT,
    created_at         TEXT NOT NULL,
    committed_at       TEXT,
    aborted_at         TEXT,
    read_started_at    TEXT,
    released_at        TEXT,
    release_reason     TEXT
);
CREATE INDEX IF NOT EXISTS entries_by_dataset ON entries(fingerprint);
CREATE TABLE IF NOT EXISTS cap_changes (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    fingerprint  TEXT NOT NULL REFERENCES datasets(fingerprint),
    old_name     TEXT NOT NULL,
    old_cap      REAL NOT NULL,
    old_delta    REAL NOT NULL,
    new_name     TEXT NOT NULL,
    new_cap      REAL NOT NULL,
    new_delta    REAL NOT NULL,
    spent_epsilon_at_change REAL NOT NULL,
    changed_at   TEXT NOT NULL,
    reason       TEXT
);
"""


_V2_COLUMNS = ("id, run_id, fingerprint, kind, status, reserved_event, committed_event, epsilon_reserved, "
               "epsilon_committed, over_reservation, description, abort_reason, created_at, committed_at, aborted_at")


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


class DeltaMismatchError(ValueError):
    """A run's δ differs from the δ its dataset is composed at."""


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

def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


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


def _counted_event_json(row: sqlite3.Row) -> str | None:
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


def _preview(existing: list[str], events: list[ev.DpEvent], delta: float, cap: float, name: str) -> dict:
    planned = [_event_json(e) for e in events]
    spent_eps = _compose(existing, delta).epsilon
    total = _compose(existing + planned, delta).epsilon
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
    """Persistent privacy budget ledger in one SQLite file (created with its directory).

    Each operation opens its own short-lived connection, so a ``Ledger`` object can be created in
    one process and used after ``fork``/``spawn``, and several processes can share the file.
    """

    def __init__(self, path: str | os.PathLike, busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S):
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ValueError(f"path must be a file path, got {path!r}")
        if str(path) == ":memory:":
            raise ValueError("path must be a file: an in-memory ledger would not persist, got ':memory:'")
        if not isinstance(busy_timeout_s, (int, float)) or isinstance(busy_timeout_s, bool) \
                or not busy_timeout_s > 0:
            raise ValueError(f"busy_timeout_s must be a number > 0, got {busy_timeout_s!r}")
        self.path = Path(path).expanduser().resolve()
        self.busy_timeout_s = float(busy_timeout_s)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._init_db()

    def __repr__(self) -> str:
        return f"Ledger({str(self.path)!r})"

    # -- connection handling --

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(str(self.path), timeout=self.busy_timeout_s, isolation_level=None)
        conn.row_factory = sqlite3.Row
        conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute("PRAGMA synchronous = FULL")  # a committed reservation survives power loss
        return conn

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """A write transaction that takes the database's write lock up front (BEGIN IMMEDIATE):
        everything read inside it is current until it commits, across processes."""
        conn = self._connect()
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
        finally:
            conn.close()

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """A read transaction: one consistent snapshot for all its queries."""
        conn = self._connect()
        try:
            conn.execute("BEGIN")
            try:
                yield conn
            finally:
                conn.execute("ROLLBACK")
        finally:
            conn.close()

    def _set_wal(self, conn: sqlite3.Connection) -> str:
        """Switch to WAL. Switching is not covered by the busy handler when several processes
        create the same new ledger at once, so retry 'database is locked' until the timeout."""
        deadline = time.monotonic() + self.busy_timeout_s
        pause = 0.005
        while True:
            try:
                return conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) and "busy" not in str(exc):
                    raise
                if time.monotonic() > deadline:
                    raise
                time.sleep(pause)
                pause = min(pause * 2, 0.2)

    def _init_db(self) -> None:
        conn = self._connect()
        try:
            mode = self._set_wal(conn)
            if str(mode).lower() != "wal":
                raise RuntimeError(f"could not switch ledger {self.path} to WAL mode (got {mode!r})")
            conn.execute("BEGIN IMMEDIATE")
            try:
                version = conn.execute("PRAGMA user_version").fetchone()[0]
                if version > SCHEMA_VERSION:
                    raise RuntimeError(
                        f"ledger {self.path} has schema version {version}, newer than this code "
                        f"({SCHEMA_VERSION}); upgrade privprompt")
                if version in (1, 2):  # widen the CHECKs (SQLite cannot alter a constraint): copy the rows
                    conn.execute("ALTER TABLE entries RENAME TO entries_old")
                    conn.execute("DROP INDEX IF EXISTS entries_by_dataset")
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        conn.execute(statement)
                if version in (1, 2):
                    conn.execute(f"INSERT INTO entries ({_V2_COLUMNS}) SELECT {_V2_COLUMNS} FROM entries_old")
                    conn.execute("DROP TABLE entries_old")
                    columns = {r[1] for r in conn.execute("PRAGMA table_info(cap_changes)")}
                    if "reason" not in columns:
                        conn.execute("ALTER TABLE cap_changes ADD COLUMN reason TEXT")
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
        finally:
            conn.close()

    # -- internal queries --

    @staticmethod
    def _dataset_row(conn: sqlite3.Connection, fingerprint: str) -> sqlite3.Row:
        _check_text(fingerprint, "fingerprint")
        row = conn.execute("SELECT * FROM datasets WHERE fingerprint = ?", (fingerprint,)).fetchone()
        if row is None:
            raise UnknownDatasetError(
                f"unknown dataset fingerprint {fingerprint!r}: register it first with "
                "Ledger.register_dataset(fingerprint, name, epsilon_cap, delta)")
        return row

    @staticmethod
    def _entry_row(conn: sqlite3.Connection, run_id: str) -> sqlite3.Row:
        _check_text(run_id, "run_id")
        row = conn.execute("SELECT * FROM entries WHERE run_id = ?", (run_id,)).fetchone()
        if row is None:
            raise UnknownRunError(f"no ledger entry for run_id {run_id!r}")
        return row

    @staticmethod
    def _counted_events(conn: sqlite3.Connection, fingerprint: str, exclude_run_id: str | None = None
                        ) -> list[str]:
        rows = conn.execute(
            "SELECT * FROM entries WHERE fingerprint = ? AND kind = 'dp' AND status NOT IN ('aborted', 'released') "
            "ORDER BY id", (fingerprint,)).fetchall()
        return [_counted_event_json(r) for r in rows if r["run_id"] != exclude_run_id]

    def _spent_in(self, conn: sqlite3.Connection, fingerprint: str) -> tuple[sqlite3.Row, PrivacySpend]:
        ds = self._dataset_row(conn, fingerprint)
        return ds, _compose(self._counted_events(conn, fingerprint), ds["delta"])

    # -- datasets --

    def register_dataset(self, fingerprint: str, name: str, epsilon_cap: float, delta: float,
                         allow_cap_change: bool = False) -> dict[str, Any]:
        """Register a dataset with its budget cap (ε_cap, δ); returns its ``datasets()`` row.

        Re-registering with the same name, cap and δ is a no-op. Different values raise
        ``ValueError`` unless ``allow_cap_change=True``, which applies them and records the change
        (old and new values, the ε spent at the time) in the ``cap_changes`` table. Caps should
        only ever be *lowered*: raising a cap after runs have spent against it is a policy
        decision, which is why every change is kept in the record. Lowering a cap below what is
        already spent is allowed; the dataset then has no budget left. Changing δ changes the δ
        at which every past entry is composed.
        """
        _check_text(fingerprint, "fingerprint")
        _check_text(name, "name")
        epsilon_cap = check_epsilon(epsilon_cap, "epsilon_cap")
        delta = check_delta(delta, "delta")
        if not isinstance(allow_cap_change, bool):
            raise ValueError(f"allow_cap_change must be a bool, got {allow_cap_change!r}")
        with self._write() as conn:
            row = conn.execute("SELECT * FROM datasets WHERE fingerprint = ?", (fingerprint,)).fetchone()
            now = _now()
            if row is None:
                conn.execute(
                    "INSERT INTO datasets (fingerprint, name, epsilon_cap, delta, created_at, updated_at)"
                    " VALUES (?, ?, ?, ?, ?, ?)", (fingerprint, name, epsilon_cap, delta, now, now))
            else:
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
                    self._change(conn, row, name, epsilon_cap, delta, None)
        return self.dataset(fingerprint)

    def _change(self, conn: sqlite3.Connection, row: sqlite3.Row, name: str, epsilon_cap: float, delta: float,
                reason: str | None) -> None:
        """Apply a change of a dataset's name / cap / δ and record it (old and new values, the ε
        spent at the time, the reason) in ``cap_changes``. A new δ re-states every entry's ε at it."""
        fingerprint, now = row["fingerprint"], _now()
        spent_eps = _compose(self._counted_events(conn, fingerprint), row["delta"]).epsilon
        conn.execute(
            "INSERT INTO cap_changes (fingerprint, old_name, old_cap, old_delta, new_name,"
            " new_cap, new_delta, spent_epsilon_at_change, changed_at, reason)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (fingerprint, row["name"], row["epsilon_cap"], row["delta"], name, epsilon_cap,
             delta, spent_eps, now, reason))
        conn.execute(
            "UPDATE datasets SET name = ?, epsilon_cap = ?, delta = ?, updated_at = ?"
            " WHERE fingerprint = ?", (name, epsilon_cap, delta, now, fingerprint))
        if not math.isclose(row["delta"], delta, rel_tol=1e-12, abs_tol=0.0):
            for entry in conn.execute("SELECT * FROM entries WHERE fingerprint = ? AND kind = 'dp'",
                                      (fingerprint,)).fetchall():
                update = {}
                for column, event_column in (("epsilon_reserved", "reserved_event"),
                                             ("epsilon_committed", "committed_event")):
                    if entry[event_column]:
                        update[column] = _compose([entry[event_column]], delta).epsilon
                if update:
                    conn.execute(f"UPDATE entries SET {', '.join(f'{k} = ?' for k in update)} WHERE id = ?",
                                 (*update.values(), entry["id"]))

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

    def change_delta(self, fingerprint: str, delta: float, reason: str) -> dict[str, Any]:
        """Register the dataset anew at another δ, deliberately: every past entry is composed at the
        new δ from then on (its ε re-stated), and the change is recorded with ``reason`` and the ε
        spent at the old δ. Refused while a reservation is open (its run was planned at the old δ).
        The cap stays; a dataset whose composed spend at the new δ exceeds it has no budget left."""
        _check_text(reason, "reason")
        delta = check_delta(delta, "delta")
        with self._write() as conn:
            row = self._dataset_row(conn, fingerprint)
            open_runs = [r["run_id"] for r in conn.execute(
                "SELECT run_id FROM entries WHERE fingerprint = ? AND kind = 'dp' AND status = 'reserved'",
                (fingerprint,))]
            if open_runs:
                raise ValueError(f"dataset {row['name']!r} has {len(open_runs)} open reservation(s) ({', '.join(open_runs)}) "
                                 f"planned at δ={row['delta']:g}: change δ when none is open")
            self._change(conn, row, row["name"], row["epsilon_cap"], delta, reason)
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
                                      f"ledger {self.path} (datasets: {known}); give a longer fingerprint prefix")
        return found[0]

    def cap_changes(self, fingerprint: str | None = None) -> list[dict[str, Any]]:
        """Every recorded cap change (``register_dataset(..., allow_cap_change=True)``), oldest first."""
        with self._read() as conn:
            if fingerprint is None:
                rows = conn.execute("SELECT * FROM cap_changes ORDER BY id").fetchall()
            else:
                self._dataset_row(conn, fingerprint)
                rows = conn.execute("SELECT * FROM cap_changes WHERE fingerprint = ? ORDER BY id",
                                    (fingerprint,)).fetchall()
        return [{k: r[k] for k in r.keys() if k != "id"} for r in rows]

    # -- reserving, committing, aborting --

    def reserve(self, fingerprint: str, run_id: str, event: ev.DpEvent, description: str = ""
                ) -> Reservation:
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
        """
        _check_text(fingerprint, "fingerprint")
        _check_text(run_id, "run_id")
        _check_text(description, "description", allow_empty=True)
        event_json = _event_json(event)
        event = ev.event_from_json(event_json)
        with self._write() as conn:
            ds = self._dataset_row(conn, fingerprint)
            cap, delta = ds["epsilon_cap"], ds["delta"]
            row = conn.execute("SELECT * FROM entries WHERE run_id = ?", (run_id,)).fetchone()
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
                    total = _compose(self._counted_events(conn, fingerprint), delta).epsilon
                    return Reservation(
                        run_id=run_id, fingerprint=fingerprint, event=event,
                        epsilon=row["epsilon_reserved"], delta=delta, epsilon_cap=cap,
                        spent_epsilon=total, remaining_epsilon=max(0.0, cap - total),
                        status=row["status"], created_at=row["created_at"], new=False)

            existing = self._counted_events(conn, fingerprint)
            alone = spend(ev.ComposedEvent((event,)), delta).epsilon
            total = _compose(existing + [event_json], delta).epsilon
            if not total <= cap:
                spent_eps = _compose(existing, delta).epsilon
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
                conn.execute(
                    "INSERT INTO entries (run_id, fingerprint, kind, status, reserved_event,"
                    " epsilon_reserved, description, created_at)"
                    " VALUES (?, ?, 'dp', 'reserved', ?, ?, ?, ?)",
                    (run_id, fingerprint, event_json, alone, description, now))
                created = now
            else:  # re-reserving an aborted or released entry (a Prefect retry of a released run)
                conn.execute(
                    "UPDATE entries SET status = 'reserved', epsilon_reserved = ?, description = ?,"
                    " abort_reason = NULL, aborted_at = NULL, released_at = NULL, release_reason = NULL,"
                    " created_at = ? WHERE run_id = ?",
                    (alone, description or row["description"], now, run_id))
                created = now
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
                conn.execute(
                    "UPDATE entries SET status = 'committed', committed_event = ?, epsilon_committed = ?,"
                    " over_reservation = ?, committed_at = ? WHERE run_id = ?",
                    (event_json, alone, int(over), _now(), run_id))
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
                conn.execute(
                    "UPDATE entries SET status = 'aborted', abort_reason = ?, aborted_at = ?"
                    " WHERE run_id = ?", (reason, _now(), run_id))
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
                conn.execute("UPDATE entries SET read_started_at = ? WHERE run_id = ?", (_now(), run_id))
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
            conn.execute("UPDATE entries SET status = 'released', released_at = ?, release_reason = ? WHERE run_id = ?",
                         (_now(), reason, run_id))
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
            row = conn.execute("SELECT * FROM entries WHERE run_id = ?", (run_id,)).fetchone()
            if row is not None:
                if row["kind"] != kind or row["fingerprint"] != fingerprint:
                    raise ValueError(f"run_id {run_id!r} is already in the ledger as a "
                                     f"{row['kind']} entry for fingerprint {_short(row['fingerprint'])}")
            else:
                conn.execute(
                    "INSERT INTO entries (run_id, fingerprint, kind, status, committed_event, description,"
                    " created_at, committed_at) VALUES (?, ?, ?, 'committed', ?, ?, ?, ?)",
                    (run_id, fingerprint, kind, event, description, _now(), _now()))
        return self._entry_dict_for(run_id)

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
            row = conn.execute("SELECT * FROM datasets WHERE fingerprint = ?", (fingerprint,)).fetchone()
            existing = self._counted_events(conn, fingerprint) if row is not None else []
        if row is None:
            return Ledger.preview_new(events, delta, cap, name)
        if not math.isclose(row["delta"], delta, rel_tol=1e-9, abs_tol=0.0):
            self.require_delta(fingerprint, delta)
        return _preview(existing, events, row["delta"], row["epsilon_cap"], row["name"])

    @staticmethod
    def preview_new(events: list[ev.DpEvent], delta: float, cap: float | None, name: str | None = None
                    ) -> dict[str, Any]:
        """:meth:`preview` for a dataset no ledger has seen: nothing spent yet."""
        if cap is None:
            raise ValueError("a preview for an unregistered dataset needs its cap")
        return _preview([], events, check_delta(delta, "delta"), check_epsilon(cap, "cap"), name or "")

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
    def _entry_dict(row: sqlite3.Row, name: str) -> dict[str, Any]:
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
            names = {r["fingerprint"]: r["name"] for r in conn.execute("SELECT fingerprint, name FROM datasets")}
            if fingerprint is None:
                rows = conn.execute("SELECT * FROM entries ORDER BY id").fetchall()
            else:
                self._dataset_row(conn, fingerprint)
                rows = conn.execute("SELECT * FROM entries WHERE fingerprint = ? ORDER BY id",
                                    (fingerprint,)).fetchall()
        return [self._entry_dict(r, names[r["fingerprint"]]) for r in rows]

    def _dataset_dicts(self, fingerprint: str | None) -> list[dict[str, Any]]:
        with self._read() as conn:
            if fingerprint is None:
                rows = conn.execute("SELECT * FROM datasets ORDER BY created_at, fingerprint").fetchall()
            else:
                rows = [self._dataset_row(conn, fingerprint)]
            out = []
            for ds in rows:
                fp = ds["fingerprint"]
                s = _compose(self._counted_events(conn, fp), ds["delta"])
                counts = {(k, st): n for k, st, n in conn.execute(
                    "SELECT kind, status, COUNT(*) FROM entries WHERE fingerprint = ? GROUP BY kind, status",
                    (fp,))}
                releases = [json.loads(r["committed_event"])["eta"] for r in conn.execute(
                    "SELECT committed_event FROM entries WHERE fingerprint = ? AND kind = 'ldp' "
                    "AND committed_event IS NOT NULL", (fp,))]
                out.append({
                    "fingerprint": fp,
                    "name": ds["name"],
                    "epsilon_cap": ds["epsilon_cap"],
                    "delta": ds["delta"],
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

        out = [f"privacy ledger {self.path}", line(header), line(["-" * w for w in widths])]
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
