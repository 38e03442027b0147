"""The ledger's errors: every refusal is one line naming the problem."""

from __future__ import annotations

from .common import _short


class LedgerError(ValueError):
    """A ledger that cannot be opened or reached (bad URL, missing driver, database down)."""


class LedgerURLError(LedgerError):
    """The ledger URL is malformed, of an unknown scheme, or needs a driver that is not installed."""


class LedgerUnavailableError(LedgerError):
    """The ledger's database could not be reached or answered with an error."""


class BudgetExceededError(ValueError):
    """A reservation would take the dataset's composed ε over its cap; nothing was recorded."""

    def __init__(self, message: str, *, fingerprint: str, name: str, needed: float, spent: float,
                 total: float, cap: float, delta: float):
        super().__init__(message)
        self.fingerprint = fingerprint
        self.name = name
        self.needed = needed        # ε of the refused run alone
        self.spent = spent          # composed ε already spent (reserved + committed)
        self.total = total          # composed ε if the run had been admitted
        self.cap = cap
        self.delta = delta
        self.remaining = max(0.0, cap - spent)
        self.largest_fitting_epsilon: float | None = None  # set by callers that know the run's config

    def with_hint(self, hint: str, largest_fitting_epsilon: float | None = None) -> "BudgetExceededError":
        """The same refusal with ``hint`` appended to its (one-line) message."""
        err = BudgetExceededError(f"{self.args[0]}; {hint}", fingerprint=self.fingerprint, name=self.name,
                                  needed=self.needed, spent=self.spent, total=self.total, cap=self.cap,
                                  delta=self.delta)
        err.largest_fitting_epsilon = largest_fitting_epsilon
        return err

    def __reduce__(self):  # picklable across Prefect / Dask boundaries with its numbers
        return (_rebuild_budget_error, (self.args[0], self.fingerprint, self.name, self.needed, self.spent,
                                        self.total, self.cap, self.delta, self.largest_fitting_epsilon))


def _rebuild_budget_error(message, fingerprint, name, needed, spent, total, cap, delta, largest):
    err = BudgetExceededError(message, fingerprint=fingerprint, name=name, needed=needed, spent=spent,
                              total=total, cap=cap, delta=delta)
    err.largest_fitting_epsilon = largest
    return err


class _LookupValueError(KeyError, ValueError):
    """A KeyError (missing key) that is also a ValueError (bad argument), with a readable str."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class LedgerKeyError(LedgerError):
    """The shared ledger's team key is missing where it must not be minted, or differs."""


class RecordOverlapError(LedgerError):
    """A data source shares records with more than one registered dataset: no one budget covers
    a run on it. Nothing was recorded."""


class ReadClaimedError(ValueError):
    """A run's first private read was already claimed (``Ledger.claim_read``) by another attempt of
    the same run: this attempt must not read or run the mechanism again under the one reservation."""


class DeltaMismatchError(ValueError):
    """A run's δ differs from the δ its dataset is composed at."""


class UnitMismatchError(ValueError):
    """A run's privacy unit differs from the unit its dataset's cap and charges are stated for."""


def unit_mismatch_message(name: str, fingerprint: str, registered: str, unit: str) -> str:
    """One line: why a run of privacy unit ``unit`` is refused on a dataset registered with ``registered``."""
    where = f"dataset {name!r} (fingerprint {_short(fingerprint)})"
    if registered != "record" and unit == "record":
        return (f"{where} is registered with privacy unit {registered!r}: its cap and every ε charged to it are per "
                f"person, and a record-level run's ε is per record — a person with k records could lose up to k·ε "
                f"(group privacy), which the ledger would under-count; without a bound on each person's records it "
                f"cannot be charged; refused: set data.privacy_unit: {registered} (user-level DP), or keep the run "
                f"record-level and have it charged the group-privacy bound per person by setting data.person_field: "
                f"{registered} and data.max_records_per_unit: K (at most K records of each person are kept)")
    if registered == "record":
        return (f"{where} is registered with privacy unit 'record': its cap and charges are per record, and a run "
                f"with data.privacy_unit: {unit} states its ε per person — the two do not compose into one budget; "
                f"refused: set data.privacy_unit: record, or, while nothing is charged to the dataset, "
                f"`privprompt budget set-unit {_short(fingerprint)} {unit} --reason TEXT`")
    return (f"{where} is registered with privacy unit {registered!r}, this run's is {unit!r}: people identified by "
            f"another field do not compose into one budget; refused: set data.privacy_unit: {registered}")


class UnknownDatasetError(_LookupValueError):
    """No dataset with this fingerprint is registered."""


class UnknownRunError(_LookupValueError):
    """No ledger entry with this run id."""
