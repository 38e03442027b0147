"""A persistent privacy budget ledger in a database: the embedded SQLite file of one machine, or a
team's PostgreSQL, reached by URL (:mod:`privacy.ledger.store`).

Each dataset (known by its keyed record digests; a record belongs to one dataset ledger-wide) has
a cap (ε_cap, δ). A run ``reserve``s its worst-case event before it touches private data — the
composition of every counted entry with the accountant, never a sum of ε's, checked and inserted
under the database's write lock — ``mark_read``s before its first private read and ``commit``s
what it spent. A reservation counts in full until then; one marked read is never released;
``release`` / ``abort`` only before any read. Reserving again under a run id with the same event
returns the reservation (retries never charge twice). Every change appends to the ``trail`` in the
same transaction; the key of the record digests is never stored here, only its id. The full
semantics (non-private uses, δ raises, datasets known by their records, how entries compose):
docs/privacy-claims.md, "The ledger".

The class is assembled from the parts of this package: :mod:`.base` (store, trail, shared queries),
:mod:`.datasets` (caps, δ and units), :mod:`.records` (datasets known by their keyed record digests),
:mod:`.operations` (reserve, commit, abort, release, previews), :mod:`.keys` (the team key's id),
:mod:`.transfer` (export and import) and :mod:`.reports` (entries, datasets, the summary table).
"""

from __future__ import annotations

from .base import LedgerBase
from .datasets import DatasetsMixin
from .keys import KeysMixin
from .operations import OperationsMixin
from .records import RecordsMixin
from .reports import ReportsMixin
from .store import DEFAULT_BUSY_TIMEOUT_S, Store
from .transfer import TransferMixin


class Ledger(OperationsMixin, DatasetsMixin, RecordsMixin, KeysMixin, TransferMixin, ReportsMixin, LedgerBase):
    """Persistent privacy budget ledger: a SQLite file (created with its directory) given by path
    or ``sqlite:////abs/path`` URL, or a team's PostgreSQL given by ``postgresql://`` URL.

    On PostgreSQL each operation opens its own short-lived connection; a SQLite ledger keeps one idle
    connection per process, closed before any fork. A ``Ledger`` object can be created in one process
    and used after ``fork``/``spawn``, and several processes (and, on PostgreSQL, machines) can share
    one ledger.
    """

    def __init__(self, path, busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S):
        self._store = Store(path, busy_timeout_s)
        self.path = self._store.path       # the SQLite file; None for a PostgreSQL ledger
        self.url = self._store.masked_url  # where the ledger lives, password masked
        self.busy_timeout_s = self._store.busy_timeout_s
        self._store.init_schema(self._migrate_rows)

    def __repr__(self) -> str:
        return f"Ledger({str(self.path) if self.path is not None else self.url!r})"
