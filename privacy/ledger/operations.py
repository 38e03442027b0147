"""A run's way through the ledger: reserve its declared worst case before it touches private data
(composed with every counted entry, refused over the cap, atomically under the write lock), mark it
read before the first private read, then commit what it spent — or release / abort a run that read
nothing. Non-private and local-DP uses are recorded, never composed. Previews compose without writing."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from .. import events as ev
from ..accountant import spend
from ..validation import check_delta, check_epsilon
from .base import LedgerBase
from .common import _EPS_RTOL, _bound, _check_text, _compose, _counted, _event_json, _fmt, _now, _preview, _q, _short
from .errors import BudgetExceededError, ReadClaimedError


@dataclass(frozen=True)
class Reservation:
    """The answer of :meth:`Ledger.reserve`.

    ``spent_epsilon`` / ``remaining_epsilon`` describe the dataset *including* this reservation,
    at the time of the call. A reservation admitted on the RDP bound (:meth:`OperationsMixin._fits`)
    composes them from the entries it was checked against when they are first read, outside the
    ledger's lock. ``new`` is False when an existing reservation was returned (idempotent retry)
    instead of a new one being made.
    """

    run_id: str
    fingerprint: str
    event: ev.DpEvent
    epsilon: float            # ε of this run alone at the dataset's δ
    delta: float
    epsilon_cap: float
    status: str
    created_at: str
    new: bool = True
    # the composed ε when it is known, else (the counted event texts, this one last; the δ floor)
    composed: float | tuple[tuple[str, ...], float] = field(default=0.0, repr=False, compare=False)

    @functools.cached_property
    def spent_epsilon(self) -> float:
        """Composed ε of all counted entries, this one included, at the dataset's δ."""
        if isinstance(self.composed, tuple):
            texts, floor = self.composed
            return max(floor, _compose(list(texts), self.delta).epsilon)
        return float(self.composed)

    @property
    def remaining_epsilon(self) -> float:
        return max(0.0, self.epsilon_cap - self.spent_epsilon)


class OperationsMixin(LedgerBase):
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
        with self._read() as conn:
            known = _q(conn, "SELECT delta FROM datasets WHERE fingerprint = ?", (fingerprint,)).fetchone()
        if known is not None:  # the run's ε alone, before the write lock (remembered, asked again under it)
            spend(ev.ComposedEvent((event,)), known["delta"])
        with self._write() as conn:
            ds = self._dataset_row(conn, fingerprint)
            row = _q(conn, "SELECT * FROM entries WHERE run_id = ?", (run_id,)).fetchone()
            if row is not None:
                again = self._retried_reservation(conn, row, ds, run_id, event, event_json)
                if again is not None:
                    return again
            self._refuse_delta_at_least_one_over_n(conn, ds, run_id, allow_delta_at_least_one_over_n)
            alone, total, stated = self._fits(conn, ds, run_id, event, event_json)
            created = self._write_reservation(conn, row, ds, run_id, event_json, alone, stated,
                                              isinstance(total, tuple), description)
        return Reservation(run_id=run_id, fingerprint=fingerprint, event=event, epsilon=alone,
                           delta=ds["delta"], epsilon_cap=ds["epsilon_cap"], status="reserved",
                           created_at=created, new=True, composed=total)

    def _retried_reservation(self, conn: sa.Connection, row: Any, ds: Any, run_id: str, event: ev.DpEvent,
                             event_json: str) -> Reservation | None:
        """The existing reservation of ``run_id`` (a retry: same dataset, same event), None when its
        entry was aborted or released (it is reserved again); anything else under that id is refused."""
        fingerprint, cap = ds["fingerprint"], ds["epsilon_cap"]
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
        if row["status"] in ("aborted", "released"):
            return None
        total = self._spent_in(conn, fingerprint)[1].epsilon
        return Reservation(
            run_id=run_id, fingerprint=fingerprint, event=event,
            epsilon=row["epsilon_reserved"], delta=ds["delta"], epsilon_cap=cap,
            status=row["status"], created_at=row["created_at"], new=False, composed=total)

    def _refuse_delta_at_least_one_over_n(self, conn: sa.Connection, ds: Any, run_id: str, allowed: bool) -> None:
        n = self._record_count(conn, ds["fingerprint"])
        if n is not None and ds["delta"] >= 1.0 / n and not allowed:  # n is not in the message (the rule of check_delta)
            raise ValueError(
                f"dataset {ds['name']!r} (fingerprint {_short(ds['fingerprint'])}) is composed at δ={ds['delta']:g}, "
                "which is >= 1/n for the n records the ledger knows it by: such a δ permits releasing whole records; "
                f"lower it (privprompt budget set-delta) before running; run {run_id!r} was not recorded")

    def _fits(self, conn: sa.Connection, ds: Any, run_id: str, event: ev.DpEvent, event_json: str
              ) -> tuple[float, float | tuple[tuple[str, ...], float], float]:
        """(ε of the run alone, the composed ε with it, what the trail states of it) at the dataset's
        δ; :class:`BudgetExceededError` over the cap. A composition whose RDP bound (``common._bound``) is within the cap is admitted
        on it: the exact ε (PLD, never above the bound) could only be lower, so the decision is the
        same, and the write lock is not held for a PLD composition of the whole history. Its
        composed ε is then returned as what it is composed from, for :class:`Reservation`, and the
        trail states the bound."""
        fingerprint, cap, delta = ds["fingerprint"], ds["epsilon_cap"], ds["delta"]
        existing = self._counted_events(conn, fingerprint)
        floor = self._delta_floor(conn, fingerprint)  # a δ change never lowers what is spent
        alone = spend(ev.ComposedEvent((event,)), delta).epsilon
        bound = _bound(existing + [event_json], delta)
        if bound is not None and max(floor, bound) <= cap:
            return alone, (tuple(existing) + (event_json,), floor), max(floor, bound)
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
        return alone, total, total

    def _write_reservation(self, conn: sa.Connection, row: Any, ds: Any, run_id: str, event_json: str,
                           alone: float, stated: float, bounded: bool, description: str) -> str:
        """Insert the entry (or reserve an aborted / released one again) and its trail row; its time.
        The trail states the composed ε, or, for a reservation admitted on the RDP bound, that bound
        (``spent_epsilon_at_most``)."""
        fingerprint, cap, now = ds["fingerprint"], ds["epsilon_cap"], _now()
        spent = {"spent_epsilon_at_most" if bounded else "spent_epsilon": stated}
        if row is None:
            _q(conn,
                "INSERT INTO entries (run_id, fingerprint, kind, status, reserved_event,"
                " epsilon_reserved, description, created_at)"
                " VALUES (?, ?, 'dp', 'reserved', ?, ?, ?, ?)",
                (run_id, fingerprint, event_json, alone, description, now))
            self._trail(conn, "reserve", fingerprint, run_id, epsilon=alone, **spent, cap=cap,
                        event=json.loads(event_json), description=description)
        else:  # re-reserving an aborted or released entry (a Prefect retry of a released run)
            _q(conn,
                "UPDATE entries SET status = 'reserved', epsilon_reserved = ?, description = ?,"
                " abort_reason = NULL, aborted_at = NULL, released_at = NULL, release_reason = NULL,"
                " created_at = ? WHERE run_id = ?",
                (alone, description or row["description"], now, run_id))
            self._trail(conn, "reserve", fingerprint, run_id, epsilon=alone, **spent, cap=cap,
                        event=json.loads(event_json), description=description or row["description"],
                        again_after=row["status"])
        return now

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
            committed = self._entry_dict(self._entry_row(conn, run_id), ds["name"])
        if over:
            raise ValueError(
                f"run {run_id!r} committed ε={_fmt(alone)} but reserved only "
                f"ε={_fmt(row['epsilon_reserved'])} at δ={ds['delta']:g}: the reservation was not the "
                "run's worst case. The ledger records the committed event (a spent budget stays "
                "spent), which may put the dataset over its cap")
        return committed

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
        return self._mark_read(run_id, exclusive=False)

    def claim_read(self, run_id: str) -> dict[str, Any]:
        """:meth:`mark_read` for the one attempt of a run that may read: the check and the mark are
        one write transaction (SQLite's ``BEGIN IMMEDIATE``, PostgreSQL's advisory lock), so of two
        attempts of one run racing here exactly one gets the claim; the other (and any attempt after
        a read was marked) gets :class:`ReadClaimedError` and must not read. Returns the entry."""
        return self._mark_read(run_id, exclusive=True)

    def _mark_read(self, run_id: str, exclusive: bool) -> dict[str, Any]:
        with self._write() as conn:
            row = self._entry_row(conn, run_id)
            if row["kind"] != "dp" or row["status"] not in ("reserved", "committed"):
                raise ValueError(f"run_id {run_id!r} is a {row['kind']} entry with status {row['status']!r}: only a "
                                 "dp reservation is marked read")
            if row["read_started_at"] is None:
                _q(conn, "UPDATE entries SET read_started_at = ? WHERE run_id = ?", (_now(), run_id))
                self._trail(conn, "mark_read", row["fingerprint"], run_id, epsilon_reserved=row["epsilon_reserved"])
            elif exclusive:
                raise ReadClaimedError(
                    f"run {run_id}: an attempt of this run began reading private data at {row['read_started_at']} "
                    "(lost, or still running); its reservation stays spent and this attempt does not run the "
                    "mechanism again under it (a new `privprompt run` is a new charge)")
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
            return [_counted(text) for text in self._counted_events(conn, fingerprint)]

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
            return self.preview_new(events, delta, cap, name)
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

