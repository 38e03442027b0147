"""A persistent privacy budget ledger in a database: the embedded SQLite file of one machine, or a
team's PostgreSQL, reached by URL (:mod:`privacy.ledger.store`).

Every private training partition is identified by a *fingerprint* (e.g. the keyed hash of its
records) and gets a cap (ε_cap, δ) when it is first registered. Every run that touches the
partition goes through the ledger:

1. ``reserve(fingerprint, run_id, event)`` **before** the run touches private data, with the
   run's declared worst-case event (e.g. the DP-SGD event of all planned steps). The ledger
   composes the events of *all* counted entries of the dataset plus the new one with the
   accountant (``spend(ComposedEvent(...), δ)``: composition of the stored events, never a sum
   of ε's) and refuses with :class:`BudgetExceededError` if the composed ε exceeds the cap.
   Reservation is atomic across processes and machines: the check and the insert run in one
   transaction holding the ledger's write lock (SQLite: ``BEGIN IMMEDIATE``; PostgreSQL:
   ``pg_advisory_xact_lock``), so concurrent reservations are serialised by the database and
   can never overspend together.
2. ``commit(run_id, event)`` after the run, with the event it actually spent (it may be smaller,
   e.g. after early stopping). From then on the committed event is the one composed.

A spent budget stays spent:

* A run that crashes after it began reading private data keeps its reservation, and a
  reservation (status ``'reserved'``) counts in full: the run may have touched the data before
  it died. The lifecycle calls ``mark_read(run_id)`` BEFORE its first private read; from then
  on the entry can never be released.
* ``release(run_id, reason)`` is for a run that failed before that mark (a model that does not
  load, a config mistake found late): no private record was read, so the reservation costs
  nothing. The entry stays in the ledger with status ``'released'``, its reason and time; the
  ledger refuses it for an entry marked read.
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

Every change (register, cap or δ change, reserve, commit, abort, release, mark_read, a
non-private or local-DP use, the team key, an import) appends a row to the append-only
``trail`` (time, action, dataset, run, details, machine, OS user, process) in the same
transaction as the change; a refused reservation changes nothing and appends nothing.
``export()`` returns the whole ledger as JSON-able data and ``import_ledger`` restores it into
an empty ledger.

The key of the keyed record digests, fingerprints and splits is never kept in the ledger's
database (schemas ≥ 7): with the key, the record digests stored here would answer "is this text in
the data?" for any text, to anyone who can read the database or a backup of it. The database
records only the key's id (:func:`key_id_of`: an HMAC of a constant under it, from which no digest
can be computed), so that a machine holding no key, or another one, is refused with a clear line.
The key lives in a file of each machine's state folder, which the team shares
(``privprompt key export`` / ``privprompt key import``: tasks/state.py); a ledger of schemas 4-6
that still holds it has it moved out on first use (:meth:`Ledger.move_team_key_out`).

A larger δ lets the same runs cost less ε under the same cap, so raising it is a budget raise: only
the explicit step of a cap raise does it, and the trail marks it (``delta_raised``). The
``set-delta`` of schemas ≤ 6 raised δ freely; on migration to schema 8 (and on importing an older
export) a dataset with a δ raise that no such mark records is put back to its smallest δ before that
raise (:meth:`Ledger._undo_unrecorded_delta_raises`), and a reservation on a dataset whose stored δ
is ≥ 1/n for the n records the ledger knows it by is refused.

Datasets are known by their records (schema 5). With :meth:`register_source` a run's data source
comes with its *keyed record digests* (16 bytes each: an HMAC, under the installation's or team's
key, of each normalised record; never text, never an unkeyed hash) and its own key; the ledger
keeps every registered dataset's digests (``dataset_records``: the digest is the primary key, so a
record belongs to at most one dataset ledger-wide) and charges the source to the ONE registered
dataset it shares a key or any record with, adding the source's other records to that dataset.
A source that shares records with two or more registered datasets is refused
(:class:`RecordOverlapError`): each record's budget lives in one dataset, and a run on that
source would draw on several at once. A source that shares nothing is registered as a new dataset.
So the record sets of the registered datasets stay disjoint, every source is charged to the
dataset holding all of its records, and a record never gets a second cap. :meth:`match_source`
answers the same question without writing (plans).

Every ε the ledger reports comes from ``spend(ComposedEvent(events), δ)``. A composition of one
entry is accounted as that entry (``accountant.spend`` unwraps it), so a single run is charged
exactly its own report. With several entries a ``ParallelEvent`` (disjoint data, e.g. DP-OPT's
generation vs. selection, or a private selection's trainings vs. its holdout scores) is nested
inside the composition, where the accountant bounds it less tightly than at the top level (PLD
composes the parts sequentially, RDP takes the pointwise maximum of their curves): the ledger may
count such runs slightly above their own reports, never below them.

Events are stored as JSON (``event_to_dict``). SQLAlchemy plus the accountant: no torch, Prefect
or MLflow here.

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

    Each operation opens its own short-lived connection, so a ``Ledger`` object can be created in
    one process and used after ``fork``/``spawn``, and several processes (and, on PostgreSQL,
    machines) can share one ledger.
    """

    def __init__(self, path, busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S):
        self._store = Store(path, busy_timeout_s)
        self.path = self._store.path       # the SQLite file; None for a PostgreSQL ledger
        self.url = self._store.masked_url  # where the ledger lives, password masked
        self.busy_timeout_s = self._store.busy_timeout_s
        self._store.init_schema(self._migrate_rows)

    def __repr__(self) -> str:
        return f"Ledger({str(self.path) if self.path is not None else self.url!r})"
