"""Where a privacy ledger lives: a database reached by a SQLAlchemy URL.

* ``sqlite:////abs/path/ledger.sqlite`` (or a plain file path): the embedded ledger of one machine
  (the default, ``<state folder>/ledger.sqlite``). WAL mode, a busy timeout, and every write in a
  ``BEGIN IMMEDIATE`` transaction: the database's write lock serialises reservations across the
  processes of the machine (and machines sharing a file system with working SQLite locks).
* ``postgresql://user[:password]@host[:port]/database``: a team's shared ledger. Every write runs
  in one transaction that first takes a transaction-scoped advisory lock
  (``pg_advisory_xact_lock``) on the ledger: writes are serialised by the database server,
  exactly like SQLite's write lock, whichever machine they come from. Reads run at REPEATABLE
  READ (one snapshot per read).

One code path (SQLAlchemy Core, ``text`` SQL that both dialects accept); only the locking
statement and the append-only trigger of the audit trail differ per dialect.

Schema versions: 2 added the 'ldp' kind of use; 3 'released' entries, read marks and reasons of cap
changes; 4 the append-only audit trail (``trail``), the team key (``team_key``) and ``ledger_meta``;
5 the keyed record digests of each dataset (``record_sets``: one row per dataset whose records are
known; ``dataset_records``: one row per keyed record digest, 16 bytes, unique across the ledger);
6 each dataset's privacy unit; 7 no team key in the database (only its id in ``ledger_meta``; the
key of a version 4-6 ledger is moved to a key file and its table dropped on first use); 8 no δ raise
outside the recorded raise step (a dataset whose δ was raised by the ``set-delta`` of schemas ≤ 6 is
put back to its smallest earlier δ on migration: ``privacy.ledger.Ledger``, no table changes).
Datasets of a version-4 ledger keep their keys and get their digests at the next run on their
source (matched by the old file-bytes key). SQLite files of versions 1-4 are migrated in place
(version in ``PRAGMA user_version`` and ``ledger_meta``); a PostgreSQL ledger keeps its version in
``ledger_meta`` and is migrated the same way (version 5 only adds tables).

Depends on SQLAlchemy (and a PostgreSQL driver, psycopg2 or psycopg, for a PostgreSQL ledger) only.
"""

from __future__ import annotations

import os
import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import sqlalchemy as sa
from sqlalchemy import event as sa_event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import NullPool

SCHEMA_VERSION = 8
DEFAULT_BUSY_TIMEOUT_S = 120.0
# pg_advisory_xact_lock key of the ledger's write lock (any fixed 64-bit number; "privledg")
PG_LOCK_KEY = 0x7072_6976_6C65_6467


class LedgerError(ValueError):
    """A ledger that cannot be opened or reached (bad URL, missing driver, database down)."""


class LedgerURLError(LedgerError):
    """The ledger URL is malformed, of an unknown scheme, or needs a driver that is not installed."""


class LedgerUnavailableError(LedgerError):
    """The ledger's database could not be reached or answered with an error."""


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

_SCHEMES = "sqlite:////absolute/path/ledger.sqlite or postgresql://user[:password]@host[:port]/database"


def mask_url(url: str | URL) -> str:
    """The URL with its password replaced by ``***`` (safe to print and log)."""
    try:
        return (url if isinstance(url, URL) else make_url(str(url))).render_as_string(hide_password=True)
    except (sa_exc.ArgumentError, ValueError):
        return "<unparseable ledger URL>"


def is_url(target) -> bool:
    return isinstance(target, (str, URL)) and "://" in str(target)


def sqlite_url(path: str | os.PathLike) -> str:
    """The URL of the SQLite ledger file ``path`` (made absolute)."""
    return f"sqlite:///{Path(path).expanduser().resolve()}"


def _pg_driver() -> str:
    for module, driver in (("psycopg2", "psycopg2"), ("psycopg", "psycopg")):
        try:
            __import__(module)
            return driver
        except ImportError:
            continue
    raise LedgerURLError("a PostgreSQL ledger needs a database driver: pip install psycopg2-binary "
                         "(scripts/team_servers.sh installs it into the venv)")


def resolve(target) -> tuple[URL, Path | None]:
    """(SQLAlchemy URL with its driver, SQLite file path or None) of a ledger path or URL."""
    if isinstance(target, os.PathLike) or (isinstance(target, str) and not is_url(target)):
        if not str(target):
            raise ValueError(f"path must be a file path, got {target!r}")
        if str(target) == ":memory:":
            raise ValueError("path must be a file: an in-memory ledger would not persist, got ':memory:'")
        path = Path(target).expanduser().resolve()
        return URL.create("sqlite", database=str(path)), path
    if not isinstance(target, (str, URL)):
        raise ValueError(f"path must be a file path or a ledger URL, got {target!r}")
    try:
        url = make_url(str(target)) if isinstance(target, str) else target
    except (sa_exc.ArgumentError, ValueError) as exc:
        raise LedgerURLError(f"ledger URL {mask_url(target)!r} is malformed ({exc}); use {_SCHEMES}") from None
    backend, _, driver = url.drivername.partition("+")
    if backend == "sqlite":
        if driver not in ("", "pysqlite"):
            raise LedgerURLError(f"ledger URL {mask_url(url)!r}: use sqlite:////absolute/path/ledger.sqlite")
        database = url.database or ""
        if not database or database == ":memory:" or database.startswith("file:"):
            raise LedgerURLError(f"ledger URL {mask_url(url)!r} names no file: an in-memory ledger would not "
                                 "persist; use sqlite:////absolute/path/ledger.sqlite")
        if not os.path.isabs(database):
            raise LedgerURLError(f"ledger URL {mask_url(url)!r} has a relative path, which would name another "
                                 "ledger from every working folder: use sqlite:////absolute/path/ledger.sqlite "
                                 "(four slashes)")
        path = Path(database).resolve()
        return url.set(drivername="sqlite", database=str(path)), path
    if backend == "postgresql":
        if not url.database:  # what the URL says is checked before what this machine has installed
            raise LedgerURLError(f"ledger URL {mask_url(url)!r} names no database: {_SCHEMES}")
        if "+" not in url.drivername:
            url = url.set(drivername=f"postgresql+{_pg_driver()}")
        else:
            try:
                url.get_dialect().import_dbapi()
            except ImportError:
                package = {"psycopg2": "psycopg2-binary", "psycopg": "psycopg[binary]"}.get(driver, driver)
                raise LedgerURLError(f"ledger URL {mask_url(url)!r} needs the {driver} driver: pip install "
                                     f"{package} (or use postgresql:// with psycopg2-binary)") from None
            except sa_exc.NoSuchModuleError:
                raise LedgerURLError(f"ledger URL {mask_url(url)!r}: SQLAlchemy knows no PostgreSQL driver "
                                     f"{driver!r}; use postgresql:// (psycopg2)") from None
        return url, None
    raise LedgerURLError(f"unknown ledger URL scheme {url.drivername!r} in {mask_url(url)!r}: use {_SCHEMES}")


def _first_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    text = " ".join(str(orig).split())
    return text[:300] or type(orig).__name__


def _owner_only_folders(folder: Path) -> None:
    """``mkdir -p folder``, each folder it makes mode 0700 whatever the umask."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
            os.chmod(d, 0o700)
        except FileExistsError:
            pass


def _owner_only_sqlite(path: Path) -> None:
    """A SQLite ledger file is readable by its owner only (0600, whatever the umask): it holds the
    datasets' record digests. Made empty at 0600 before SQLite first opens it (an empty file is an
    empty database); an existing one and its journals (``-wal``, ``-shm``, ``-journal``) lose any
    permission of the group and others. SQLite gives the journals it creates the database's mode."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.chmod(path, 0o600)
    except FileExistsError:
        pass
    except OSError:  # a folder it cannot write: SQLite's own error says so, in the ledger's terms
        return
    for p in (path, *(path.with_name(path.name + s) for s in ("-wal", "-shm", "-journal"))):
        try:
            mode = os.stat(p).st_mode & 0o7777
            if mode & 0o077:
                os.chmod(p, mode & ~0o077)
        except (FileNotFoundError, PermissionError):  # no such journal; or another user's file: SQLite says so
            pass


class Store:
    """A SQLAlchemy engine on one ledger database with serialised write transactions.

    No connection pool: each transaction opens and closes its own connection, so the object
    survives ``fork``/``spawn`` and no idle connection is held to the team's server."""

    def __init__(self, target, busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S):
        if not isinstance(busy_timeout_s, (int, float)) or isinstance(busy_timeout_s, bool) \
                or not busy_timeout_s > 0:
            raise ValueError(f"busy_timeout_s must be a number > 0, got {busy_timeout_s!r}")
        self.url, self.path = resolve(target)
        self.busy_timeout_s = float(busy_timeout_s)
        self.dialect = self.url.get_backend_name()
        self.masked_url = (mask_url(target) if not isinstance(target, os.PathLike) and "://" in str(target)
                           else mask_url(self.url))
        self._engine = None
        if self.path is not None:
            _owner_only_folders(self.path.parent)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_engine"] = None  # an engine is per process
        return state

    @property
    def engine(self) -> sa.Engine:
        if self._engine is None:
            self._engine = self._make_engine()
        return self._engine

    def _make_engine(self) -> sa.Engine:
        if self.dialect == "sqlite":
            _owner_only_sqlite(self.path)
            engine = sa.create_engine(self.url, poolclass=NullPool,
                                      connect_args={"timeout": self.busy_timeout_s, "isolation_level": None})
            busy_ms = int(self.busy_timeout_s * 1000)

            @sa_event.listens_for(engine, "connect")
            def _on_connect(dbapi_conn, _record):
                dbapi_conn.isolation_level = None  # transactions are begun by the "begin" hook below
                cur = dbapi_conn.cursor()
                cur.execute(f"PRAGMA busy_timeout = {busy_ms}")
                cur.execute("PRAGMA foreign_keys = ON")
                cur.execute("PRAGMA synchronous = FULL")  # a committed reservation survives power loss
                cur.close()

            @sa_event.listens_for(engine, "begin")
            def _on_begin(conn):
                mode = conn.get_execution_options().get("privprompt_begin", "DEFERRED")
                conn.exec_driver_sql(f"BEGIN {mode}")

            return engine
        return sa.create_engine(self.url, poolclass=NullPool, connect_args={"connect_timeout": 10})

    def _unavailable(self, exc: BaseException) -> LedgerUnavailableError:
        return LedgerUnavailableError(f"ledger {self.masked_url} could not be used: {_first_line(exc)}")

    @contextmanager
    def write(self) -> Iterator[sa.Connection]:
        """A transaction holding the ledger's write lock from its first statement: everything read
        inside it is current until it commits, across processes and machines."""
        try:
            with self.engine.connect() as conn:
                if self.dialect == "sqlite":
                    conn.execution_options(privprompt_begin="IMMEDIATE")
                with conn.begin():
                    if self.dialect == "postgresql":
                        conn.exec_driver_sql(f"SET LOCAL lock_timeout = {int(self.busy_timeout_s * 1000)}")
                        conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": PG_LOCK_KEY})
                    yield conn
        except (sa_exc.OperationalError, sa_exc.InterfaceError) as exc:
            raise self._unavailable(exc) from exc

    @contextmanager
    def read(self) -> Iterator[sa.Connection]:
        """A read transaction: one consistent snapshot for all its queries."""
        try:
            with self.engine.connect() as conn:
                if self.dialect == "postgresql":
                    conn.execution_options(isolation_level="REPEATABLE READ")
                trans = conn.begin()
                try:
                    yield conn
                finally:
                    trans.rollback()
        except (sa_exc.OperationalError, sa_exc.InterfaceError) as exc:
            raise self._unavailable(exc) from exc

    # -- schema --

    def init_schema(self, migrate_rows=None) -> None:
        """Create the tables, or migrate an older schema in place, in one write transaction.
        ``migrate_rows(conn, version)``: called in that transaction after the tables are current and
        before the new version is stored, when the stored version is older (the row changes a new
        schema implies, which need the ledger's logic)."""
        if self.dialect == "sqlite":
            self._set_wal()
        if self._current_version() == SCHEMA_VERSION:
            return  # nothing to create or migrate: no write lock taken
        with self.write() as conn:
            if self.dialect == "sqlite":
                version = conn.exec_driver_sql("PRAGMA user_version").scalar()
            else:
                version = self._meta_version(conn)
            if version > SCHEMA_VERSION:
                raise LedgerError(f"ledger {self.masked_url} has schema version {version}, newer than this "
                                  f"code ({SCHEMA_VERSION}); upgrade privprompt")
            if self.dialect == "sqlite" and version in (1, 2):
                # widen the CHECKs (SQLite cannot alter a constraint): copy the rows
                conn.exec_driver_sql("ALTER TABLE entries RENAME TO entries_old")
                conn.exec_driver_sql("DROP INDEX IF EXISTS entries_by_dataset")
            metadata.create_all(conn)
            if self.dialect == "sqlite" and version in (1, 2):
                conn.exec_driver_sql(f"INSERT INTO entries ({_V2_COLUMNS}) SELECT {_V2_COLUMNS} FROM entries_old")
                conn.exec_driver_sql("DROP TABLE entries_old")
            if self.dialect == "sqlite" and version in (1, 2, 3):
                columns = {r[1] for r in conn.exec_driver_sql("PRAGMA table_info(cap_changes)")}
                if "reason" not in columns:
                    conn.exec_driver_sql("ALTER TABLE cap_changes ADD COLUMN reason TEXT")
            if 0 < version < 6:  # schema 6: each dataset's privacy unit (every existing one is 'record')
                if "unit" not in {c["name"] for c in sa.inspect(conn).get_columns("datasets")}:
                    conn.exec_driver_sql("ALTER TABLE datasets ADD COLUMN unit TEXT NOT NULL DEFAULT 'record'")
            for statement in (_SQLITE_TRIGGERS if self.dialect == "sqlite" else _PG_TRIGGERS) \
                    if version < SCHEMA_VERSION else []:
                conn.exec_driver_sql(statement)
            if version < SCHEMA_VERSION and migrate_rows is not None:
                migrate_rows(conn, version)
            if version < SCHEMA_VERSION:
                conn.execute(sa.text("DELETE FROM ledger_meta WHERE name = 'schema_version'"))
                conn.execute(sa.text("INSERT INTO ledger_meta (name, value) VALUES ('schema_version', :v)"),
                             {"v": str(SCHEMA_VERSION)})
                if self.dialect == "sqlite":
                    conn.exec_driver_sql(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def scrub(self) -> None:
        """After key material was deleted: rewrite a SQLite file (VACUUM) so that no free page keeps
        it, and empty its write-ahead log. (PostgreSQL: a dropped table's file is removed at commit;
        its WAL segments and backups are the server's.)"""
        if self.dialect != "sqlite":
            return
        raw = self.engine.raw_connection()  # outside any transaction: VACUUM cannot run inside one
        try:
            conn = raw.driver_connection
            conn.execute("VACUUM")
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.OperationalError as exc:
            raise self._unavailable(exc) from exc
        finally:
            raw.close()

    def _current_version(self) -> int:
        with self.read() as conn:
            if self.dialect == "sqlite":
                return conn.exec_driver_sql("PRAGMA user_version").scalar()
            return self._meta_version(conn)

    @staticmethod
    def _meta_version(conn: sa.Connection) -> int:
        if not sa.inspect(conn).has_table("ledger_meta"):
            return 0
        value = conn.execute(sa.text("SELECT value FROM ledger_meta WHERE name = 'schema_version'")).scalar()
        return int(value) if value is not None else 0

    def _set_wal(self) -> None:
        """Switch to WAL. Switching is not covered by the busy handler when several processes
        create the same new ledger at once, so retry 'database is locked' until the timeout."""
        deadline = time.monotonic() + self.busy_timeout_s
        pause = 0.005
        while True:
            try:
                raw = self.engine.raw_connection()  # outside any transaction (autobegin would open one)
                try:
                    mode = raw.driver_connection.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                finally:
                    raw.close()
                if str(mode).lower() != "wal":
                    raise LedgerError(f"could not switch ledger {self.path} to WAL mode (got {mode!r})")
                return
            except (sa_exc.OperationalError, sqlite3.OperationalError) as exc:
                if ("locked" not in str(exc) and "busy" not in str(exc)) or time.monotonic() > deadline:
                    raise self._unavailable(exc) from exc
                time.sleep(pause)
                pause = min(pause * 2, 0.2)
