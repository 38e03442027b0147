"""The ledger's tables and the migration of older schemas, in place.

Schema versions: 2 added the 'ldp' kind of use; 3 'released' entries, read marks and reasons of cap
changes; 4 the append-only audit trail (``trail``), the team key (``team_key``) and ``ledger_meta``;
5 the keyed record digests of each dataset (``record_sets``: one row per dataset whose records are
known; ``dataset_records``: one row per keyed record digest, 16 bytes, unique across the ledger);
6 each dataset's privacy unit; 7 no team key in the database (only its id in ``ledger_meta``; the
key of a version 4-6 ledger is moved to a key file and its table dropped on first use); 8 no δ raise
outside the recorded raise step (a dataset whose δ was raised by the ``set-delta`` of schemas ≤ 6 is
put back to its smallest earlier δ on migration: the row changes are the ledger's,
:meth:`privacy.ledger.Ledger._undo_unrecorded_delta_raises`; no table changes).
Datasets of a version-4 ledger keep their keys and get their digests at the next run on their
source (matched by the old file-bytes key). SQLite files of versions 1-4 are migrated in place
(version in ``PRAGMA user_version`` and ``ledger_meta``); a PostgreSQL ledger keeps its version in
``ledger_meta`` and is migrated the same way (version 5 only adds tables).
"""

from __future__ import annotations

import sqlalchemy as sa

from .errors import LedgerError

SCHEMA_VERSION = 8

metadata = sa.MetaData()

datasets_table = sa.Table(
    "datasets", metadata,
    sa.Column("fingerprint", sa.Text, primary_key=True),
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("epsilon_cap", sa.Double, nullable=False),
    sa.Column("delta", sa.Double, nullable=False),
    sa.Column("created_at", sa.Text, nullable=False),
    sa.Column("updated_at", sa.Text, nullable=False),
    # the privacy unit its cap and every ε charged to it are stated for (schema 6): 'record', or the
    # field naming a person (a user unit); runs of another unit are refused (privacy/ledger.py)
    sa.Column("unit", sa.Text, nullable=False, server_default="record"),
    sa.CheckConstraint("epsilon_cap > 0"),
    sa.CheckConstraint("delta > 0 AND delta < 1"),
)

entries_table = sa.Table(
    "entries", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("run_id", sa.Text, nullable=False, unique=True),
    sa.Column("fingerprint", sa.Text, sa.ForeignKey("datasets.fingerprint"), nullable=False),
    sa.Column("kind", sa.Text, nullable=False),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("reserved_event", sa.Text),
    sa.Column("committed_event", sa.Text),
    sa.Column("epsilon_reserved", sa.Double),
    sa.Column("epsilon_committed", sa.Double),
    sa.Column("over_reservation", sa.Integer, nullable=False, server_default="0"),
    sa.Column("description", sa.Text, nullable=False, server_default=""),
    sa.Column("abort_reason", sa.Text),
    sa.Column("created_at", sa.Text, nullable=False),
    sa.Column("committed_at", sa.Text),
    sa.Column("aborted_at", sa.Text),
    sa.Column("read_started_at", sa.Text),
    sa.Column("released_at", sa.Text),
    sa.Column("release_reason", sa.Text),
    sa.CheckConstraint("kind IN ('dp', 'nonprivate', 'ldp')"),
    sa.CheckConstraint("status IN ('reserved', 'committed', 'aborted', 'released')"),
    sa.Index("entries_by_dataset", "fingerprint"),
    sqlite_autoincrement=True,
)

cap_changes_table = sa.Table(
    "cap_changes", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("fingerprint", sa.Text, sa.ForeignKey("datasets.fingerprint"), nullable=False),
    sa.Column("old_name", sa.Text, nullable=False),
    sa.Column("old_cap", sa.Double, nullable=False),
    sa.Column("old_delta", sa.Double, nullable=False),
    sa.Column("new_name", sa.Text, nullable=False),
    sa.Column("new_cap", sa.Double, nullable=False),
    sa.Column("new_delta", sa.Double, nullable=False),
    sa.Column("spent_epsilon_at_change", sa.Double, nullable=False),
    sa.Column("changed_at", sa.Text, nullable=False),
    sa.Column("reason", sa.Text),
    sqlite_autoincrement=True,
)

trail_table = sa.Table(  # append-only: a trigger refuses UPDATE and DELETE
    "trail", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("at", sa.Text, nullable=False),
    sa.Column("action", sa.Text, nullable=False),
    sa.Column("fingerprint", sa.Text),
    sa.Column("run_id", sa.Text),
    sa.Column("detail", sa.Text, nullable=False, server_default="{}"),
    sa.Column("host", sa.Text, nullable=False),
    sa.Column("os_user", sa.Text, nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    sqlite_autoincrement=True,
)

# Schemas 4-6 kept the team key itself in a table ``team_key`` (one row) beside the keyed record
# digests: whoever could read the database could test any text for membership. Schema 7 creates no
# such table; an old one is emptied and dropped by ``Ledger.move_team_key_out`` on first use through
# a state folder, which first hands the key to a key file (tasks/state.py). The database keeps only
# the key's id (ledger_meta 'team_key_id': an HMAC of a constant under the key, which tells keys
# apart and computes no digest).
LEGACY_TEAM_KEY_TABLE = "team_key"
TEAM_KEY_ID = "team_key_id"  # the ledger_meta row of the team key's id

record_sets_table = sa.Table(  # a dataset whose records the ledger knows (schema 5)
    "record_sets", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("fingerprint", sa.Text, sa.ForeignKey("datasets.fingerprint"), nullable=False, unique=True),
    sa.Column("created_at", sa.Text, nullable=False),
    sqlite_autoincrement=True,
)

RECORD_DIGEST_BYTES = 16

records_table = sa.Table(  # keyed digests of every record of every dataset: never text, never unkeyed
    "dataset_records", metadata,
    # the primary key: one dataset per record, ledger-wide (a record never gets two caps)
    sa.Column("digest", sa.LargeBinary(RECORD_DIGEST_BYTES), primary_key=True),
    sa.Column("set_id", sa.Integer, sa.ForeignKey("record_sets.id"), nullable=False),
    sqlite_with_rowid=False,  # one B-tree keyed by the digest: about 20 bytes a record on disk
)

meta_table = sa.Table(
    "ledger_meta", metadata,
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("value", sa.Text, nullable=False),
)

_SQLITE_TRIGGERS = [
    "CREATE TRIGGER IF NOT EXISTS trail_no_update BEFORE UPDATE ON trail "
    "BEGIN SELECT RAISE(ABORT, 'the ledger trail is append-only'); END",
    "CREATE TRIGGER IF NOT EXISTS trail_no_delete BEFORE DELETE ON trail "
    "BEGIN SELECT RAISE(ABORT, 'the ledger trail is append-only'); END",
]
_PG_TRIGGERS = [
    "CREATE OR REPLACE FUNCTION privprompt_trail_append_only() RETURNS trigger LANGUAGE plpgsql AS "
    "$$ BEGIN RAISE EXCEPTION 'the ledger trail is append-only'; END $$",
    "DROP TRIGGER IF EXISTS trail_append_only ON trail",
    "CREATE TRIGGER trail_append_only BEFORE UPDATE OR DELETE ON trail "
    "FOR EACH ROW EXECUTE FUNCTION privprompt_trail_append_only()",
]

_V2_COLUMNS = ("id, run_id, fingerprint, kind, status, reserved_event, committed_event, epsilon_reserved, "
               "epsilon_committed, over_reservation, description, abort_reason, created_at, committed_at, aborted_at")


def stored_version(conn: sa.Connection, dialect: str) -> int:
    """The schema version the database says it has (0: a new, empty database)."""
    if dialect == "sqlite":
        return conn.exec_driver_sql("PRAGMA user_version").scalar()
    return meta_version(conn)


def meta_version(conn: sa.Connection) -> int:
    if not sa.inspect(conn).has_table("ledger_meta"):
        return 0
    value = conn.execute(sa.text("SELECT value FROM ledger_meta WHERE name = 'schema_version'")).scalar()
    return int(value) if value is not None else 0


def migrate(conn: sa.Connection, dialect: str, where: str, migrate_rows=None) -> None:
    """Create the tables, or bring an older schema to :data:`SCHEMA_VERSION`, inside the write
    transaction ``conn``. ``where``: the ledger, for the message refusing a newer schema.
    ``migrate_rows(conn, version)``: the row changes a newer schema implies (the ledger's logic),
    called after the tables are current and before the new version is stored."""
    version = stored_version(conn, dialect)
    if version > SCHEMA_VERSION:
        raise LedgerError(f"ledger {where} has schema version {version}, newer than this "
                          f"code ({SCHEMA_VERSION}); upgrade privprompt")
    _create_tables(conn, dialect, version)
    if version < SCHEMA_VERSION:
        for statement in _SQLITE_TRIGGERS if dialect == "sqlite" else _PG_TRIGGERS:
            conn.exec_driver_sql(statement)
        if migrate_rows is not None:
            migrate_rows(conn, version)
        _store_version(conn, dialect)


def _create_tables(conn: sa.Connection, dialect: str, version: int) -> None:
    """The tables of the current schema: new ones created, old ones widened (their rows kept)."""
    if dialect == "sqlite" and version in (1, 2):
        # widen the CHECKs (SQLite cannot alter a constraint): copy the rows
        conn.exec_driver_sql("ALTER TABLE entries RENAME TO entries_old")
        conn.exec_driver_sql("DROP INDEX IF EXISTS entries_by_dataset")
    metadata.create_all(conn)
    if dialect == "sqlite" and version in (1, 2):
        conn.exec_driver_sql(f"INSERT INTO entries ({_V2_COLUMNS}) SELECT {_V2_COLUMNS} FROM entries_old")
        conn.exec_driver_sql("DROP TABLE entries_old")
    if dialect == "sqlite" and version in (1, 2, 3):
        columns = {r[1] for r in conn.exec_driver_sql("PRAGMA table_info(cap_changes)")}
        if "reason" not in columns:
            conn.exec_driver_sql("ALTER TABLE cap_changes ADD COLUMN reason TEXT")
    if 0 < version < 6:  # schema 6: each dataset's privacy unit (every existing one is 'record')
        if "unit" not in {c["name"] for c in sa.inspect(conn).get_columns("datasets")}:
            conn.exec_driver_sql("ALTER TABLE datasets ADD COLUMN unit TEXT NOT NULL DEFAULT 'record'")


def _store_version(conn: sa.Connection, dialect: str) -> None:
    conn.execute(sa.text("DELETE FROM ledger_meta WHERE name = 'schema_version'"))
    conn.execute(sa.text("INSERT INTO ledger_meta (name, value) VALUES ('schema_version', :v)"),
                 {"v": str(SCHEMA_VERSION)})
    if dialect == "sqlite":
        conn.exec_driver_sql(f"PRAGMA user_version = {SCHEMA_VERSION}")


def store_tables() -> tuple[sa.Table, ...]:
    """The tables an export carries row by row, in the order an import restores them."""
    return (datasets_table, entries_table, cap_changes_table, trail_table)
