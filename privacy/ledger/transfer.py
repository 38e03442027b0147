"""Export and import: the whole ledger as JSON-able data (every row as stored, each dataset's keyed
record digests in base64, the team key's id — never the key), and its restoration into an empty
ledger, rows keeping their ids, times and statuses, so the restored ledger composes exactly as the
exported one."""

from __future__ import annotations

import base64
import sqlite3
from typing import Any

import sqlalchemy as sa

from .base import LedgerBase
from .common import _TABLES, EXPORT_FORMAT, _now, _q, _short
from .errors import LedgerError, LedgerKeyError
from .keys import key_id_of
from .schema import RECORD_DIGEST_BYTES, SCHEMA_VERSION, TEAM_KEY_ID, store_tables


class TransferMixin(LedgerBase):
    """:meth:`export` and :meth:`import_ledger`."""

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
        decoded = self._checked_export(data)
        key_id = self._import_key_id(data, team_key)
        with self._write() as conn:
            present = {t: _q(conn, f"SELECT COUNT(*) AS n FROM {t}").fetchone()["n"] for t in _TABLES}
            if any(present.values()):
                raise LedgerError(f"ledger {self.location} is not empty ("
                                  + ", ".join(f"{n} {t}" for t, n in present.items() if n)
                                  + "): import restores into an empty ledger only")
            counts = self._restore_rows(conn, data)
            n_digests = self._restore_digests(conn, decoded)
            if n_digests:
                counts["record_digests"] = n_digests
            if self._store.dialect == "postgresql":  # the sequences continue after the restored ids
                for t in ("entries", "cap_changes", "trail", "record_sets"):
                    _q(conn, f"SELECT setval(pg_get_serial_sequence('{t}', 'id'), COALESCE(MAX(id), 1), "
                             f"MAX(id) IS NOT NULL) FROM {t}")
            if key_id is not None:
                self._record_imported_key_id(conn, key_id)
            self._trail(conn, "import", None, None, source_ledger=data.get("ledger"),
                        exported_at=data.get("exported_at"), rows=counts, team_key_id=key_id)
            if data["schema_version"] < 8:  # what the migration of a ledger of that schema does
                self._undo_unrecorded_delta_raises(conn, f"the schema-{data['schema_version']} export")
        return counts

    def _checked_export(self, data: Any) -> dict[str, list[bytes]]:
        """Refuse what is not an export this code reads; fingerprint → its decoded record digests."""
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
        return decoded

    @staticmethod
    def _import_key_id(data: dict[str, Any], team_key: bytes | None) -> str | None:
        """The team key id the import records: the export's, checked against ``team_key`` when given."""
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
        return key_id

    @staticmethod
    def _restore_rows(conn: sa.Connection, data: dict[str, Any]) -> dict[str, int]:
        """Insert the export's rows of each table as they were stored; the number per table."""
        columns = {t.name: [c.name for c in t.columns] for t in store_tables()}
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
        return counts

    def _restore_digests(self, conn: sa.Connection, decoded: dict[str, list[bytes]]) -> int:
        """Each dataset's record set and digests; how many digests were restored."""
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
        return n_digests

    def _record_imported_key_id(self, conn: sa.Connection, key_id: str) -> None:
        stored = self._key_id_in(conn)
        if stored is not None and stored != key_id:
            raise LedgerKeyError(f"ledger {self.location} already records another team key ({stored}, "
                                 f"the import's {key_id})")
        if stored is None:
            _q(conn, "INSERT INTO ledger_meta (name, value) VALUES (?, ?)", (TEAM_KEY_ID, key_id))
