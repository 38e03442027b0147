"""The team key's id. The team key (the HMAC key of record digests, dataset fingerprints and keyed
splits) is NEVER kept in the ledger's database (schemas ≥ 7): with it, the 16-byte record digests
stored here answer "is this text in the data?" for any text. The database keeps its id only
(:func:`key_id_of`), so that a machine holding the wrong key, or none, is told so; a ledger of
schemas 4-6 that still holds the key has it moved out on first use (:meth:`KeysMixin.move_team_key_out`).
Where the key lives: tasks/state.py."""

from __future__ import annotations

import hashlib
import hmac

import sqlalchemy as sa

from .base import LedgerBase
from .common import _q
from .errors import LedgerKeyError
from .schema import LEGACY_TEAM_KEY_TABLE, TEAM_KEY_ID


def key_id_of(key: bytes) -> str:
    """The id of a 32-byte key: 16 hex digits of an HMAC of a constant under it. It tells keys apart
    (the ledger records the id of the key its datasets are keyed with) and reveals nothing of the key:
    no record digest can be computed from it."""
    if not isinstance(key, (bytes, bytearray)) or len(key) != 32:
        raise LedgerKeyError("a team key is 32 bytes")
    return hmac.new(bytes(key), b"privprompt/key-id", hashlib.sha256).hexdigest()[:16]


class KeysMixin(LedgerBase):
    """The id of the team key the ledger's datasets are keyed with, and the move of a key kept in
    the database by schemas 4-6 out of it."""

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

