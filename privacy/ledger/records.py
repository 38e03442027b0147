"""Datasets known by their records (schema 5): a run's data source comes with its keyed record digests
(16-byte HMACs under the installation's or team's key; never text, never an unkeyed hash); the ledger
keeps every registered dataset's digests (a digest belongs to at most one dataset, ledger-wide) and
charges a source to the ONE dataset it shares its key or any record with — or registers it as a new
dataset; a source sharing records with two or more is refused (:class:`RecordOverlapError`)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from ..validation import check_delta, check_epsilon
from .base import LedgerBase
from .common import _check_text, _now, _q, _short
from .errors import RecordOverlapError, UnitMismatchError, unit_mismatch_message
from .schema import RECORD_DIGEST_BYTES, records_table


class RecordsMixin(LedgerBase):
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
                self._add_records(conn, fp, how, key, name, digest_list, owners.get(fp, set()), now)
        return {**self.dataset(fp), "how": how}

    def _add_records(self, conn: sa.Connection, fp: str, how: str, key: str, name: str, digest_list: list[bytes],
                     held: set[bytes], now: str) -> None:
        """Add the source's records that dataset ``fp`` does not hold yet (``held``) to its record set."""
        set_id = self._record_set_id(conn, fp)
        if set_id is None:
            _q(conn, "INSERT INTO record_sets (fingerprint, created_at) VALUES (?, ?)", (fp, now))
            set_id = self._record_set_id(conn, fp)
        missing = [d for d in digest_list if d not in held]  # sorted: appends to the B-tree
        self._insert_digests(conn, set_id, missing)
        if how != "new" and missing:
            # no count of the records added: with the source's size it would tell whoever
            # wrote the source how many of its rows the dataset held (the refusals give none)
            self._trail(conn, "records", fp, source_key=key, source_name=name, matched_by=how)

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

