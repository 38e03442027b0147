"""The privacy budget ledger: every dataset's cap (ε_cap, δ) and every run charged to it, in a SQLite
file or a team's PostgreSQL (the one part of ``privacy/`` that uses SQLAlchemy; the math modules of
``privacy/`` stay pure). The public API is here; :mod:`.ledger` says how a run goes through it.

Modules: :mod:`.store` (where a ledger lives: URLs, engines, locked writes), :mod:`.schema` (tables
and migrations, schemas 1-8), :mod:`.errors`, :mod:`.common` (shared helpers), and the parts of the
:class:`Ledger` class: :mod:`.base`, :mod:`.datasets`, :mod:`.records`, :mod:`.operations`,
:mod:`.keys`, :mod:`.transfer`, :mod:`.reports`. Nothing here imports ``tasks/`` or ``flows/``.
"""

from .common import EXPORT_FORMAT
from .errors import (BudgetExceededError, DeltaMismatchError, LedgerError, LedgerKeyError, LedgerUnavailableError,
                     LedgerURLError, ReadClaimedError, RecordOverlapError, UnitMismatchError, UnknownDatasetError, UnknownRunError,
                     unit_mismatch_message)
from .keys import key_id_of
from .ledger import Ledger
from .operations import Reservation
from .schema import RECORD_DIGEST_BYTES, SCHEMA_VERSION
from .store import DEFAULT_BUSY_TIMEOUT_S, mask_url, resolve, sqlite_url

__all__ = [
    "DEFAULT_BUSY_TIMEOUT_S",
    "EXPORT_FORMAT",
    "RECORD_DIGEST_BYTES",
    "SCHEMA_VERSION",
    "BudgetExceededError",
    "DeltaMismatchError",
    "Ledger",
    "LedgerError",
    "LedgerKeyError",
    "LedgerURLError",
    "LedgerUnavailableError",
    "ReadClaimedError",
    "RecordOverlapError",
    "Reservation",
    "UnitMismatchError",
    "UnknownDatasetError",
    "UnknownRunError",
    "key_id_of",
    "mask_url",
    "resolve",
    "sqlite_url",
    "unit_mismatch_message",
]
