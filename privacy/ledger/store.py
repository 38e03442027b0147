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
statement and the append-only trigger of the audit trail differ per dialect (:mod:`.schema`: the
tables and the migrations of older schemas).

Depends on SQLAlchemy (and a PostgreSQL driver, psycopg2 or psycopg, for a PostgreSQL ledger) only.
"""

from __future__ import annotations

import os
import sqlite3
import time
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import sqlalchemy as sa
from sqlalchemy import event as sa_event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import NullPool, QueuePool

from . import schema
from .errors import LedgerError, LedgerUnavailableError, LedgerURLError

DEFAULT_BUSY_TIMEOUT_S = 120.0
# pg_advisory_xact_lock key of the ledger's write lock (any fixed 64-bit number; "privledg")
PG_LOCK_KEY = 0x7072_6976_6C65_6467

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




# SQLite stores with a pooled connection in this process: closed before any fork (os.fork, and
# multiprocessing's fork), so no open connection crosses into a child — SQLite's in-process lock
# state would come with it, and the child's own connection would then write without the file's
# locks (SQLite: "do not open a database before fork and use it in the child")
_POOLED: "weakref.WeakSet[Store]" = weakref.WeakSet()


def _close_before_fork() -> None:
    for store in list(_POOLED):
        if store._engine is not None and store._engine_pid == os.getpid():
            store._engine.dispose()  # closes the idle connections; the next use opens one again


os.register_at_fork(before=_close_before_fork)


class Store:
    """A SQLAlchemy engine on one ledger database with serialised write transactions.

    A PostgreSQL ledger has no connection pool: each transaction opens and closes its own
    connection, so no idle connection is held to the team's server. A SQLite ledger keeps one idle
    connection per process (opening one, and closing the last one, which checkpoints the journal,
    cost more than a reservation's own work); it is closed before a fork, the engine is made
    afresh in a forked child, and a pickled store carries none, so the object survives
    ``fork``/``spawn``."""

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
        self._engine_pid = None
        if self.path is not None:
            _owner_only_folders(self.path.parent)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_engine"] = None  # an engine is per process
        return state

    @property
    def engine(self) -> sa.Engine:
        if self._engine is None or self._engine_pid != os.getpid():
            if self._engine is not None:  # inherited across fork: the parent's connections stay the parent's
                self._engine.dispose(close=False)
            self._engine, self._engine_pid = self._make_engine(), os.getpid()
            if self.dialect == "sqlite":
                _POOLED.add(self)
        return self._engine

    def _make_engine(self) -> sa.Engine:
        if self.dialect == "sqlite":
            _owner_only_sqlite(self.path)
            engine = sa.create_engine(self.url, poolclass=QueuePool, pool_size=1, max_overflow=-1,
                                      connect_args={"timeout": self.busy_timeout_s, "isolation_level": None,
                                                    "check_same_thread": False})
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
        """Create the tables, or migrate an older schema in place, in one write transaction
        (:func:`.schema.migrate`). ``migrate_rows(conn, version)``: called in that transaction after
        the tables are current and before the new version is stored, when the stored version is
        older (the row changes a new schema implies, which need the ledger's logic)."""
        if self.dialect == "sqlite":
            self._set_wal()
        if self._current_version() == schema.SCHEMA_VERSION:
            return  # nothing to create or migrate: no write lock taken
        with self.write() as conn:
            schema.migrate(conn, self.dialect, self.masked_url, migrate_rows)

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
            return schema.stored_version(conn, self.dialect)

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

