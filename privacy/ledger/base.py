"""What every part of the :class:`~privacy.ledger.Ledger` stands on: its store (reads and locked
writes), the audit trail, and the queries the budget checks share (a dataset's row, an entry's row,
the events a dataset composes, the floor a δ change leaves, the number of records it is known by)."""

from __future__ import annotations

import json
import os
from typing import Any

import sqlalchemy as sa

from ..accountant import PrivacySpend
from .common import _check_text, _compose, _held, _host, _now, _os_user, _q
from .errors import UnknownDatasetError, UnknownRunError
from .store import Store


class LedgerBase:
    """The store and the shared queries; the operations live in the mixins :class:`~privacy.ledger.Ledger`
    is made of (datasets, records, operations, keys, transfer, reports)."""

    _store: Store
    path = None  # the SQLite file; None for a PostgreSQL ledger
    url = ""     # where the ledger lives, password masked

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
        """The event texts the dataset's budget composes, oldest first: each dp entry's committed
        event, or its reserved one while it is reserved (aborted and released entries cost nothing,
        as in :func:`.common._counted_event_json`). Only those two columns are read: every
        reservation reads the whole history."""
        rows = conn.execute(sa.text(
            "SELECT run_id, CASE WHEN status = 'committed' THEN committed_event ELSE reserved_event END "
            "FROM entries WHERE fingerprint = :f AND kind = 'dp' AND status IN ('reserved', 'committed') "
            "ORDER BY id"), {"f": fingerprint}).all()
        return [text for run_id, text in rows if run_id != exclude_run_id]

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

