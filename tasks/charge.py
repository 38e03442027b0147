"""Which ledger dataset a run's private source is charged to, and on what terms: a source is known by
its keyed record digests and charged to the one registered dataset holding any of its records
(``Ledger.register_source``); a run's unit, δ and cap are checked against that dataset's before
anything is reserved, and its budget composed with what the dataset has spent (a dry run). Which
dataset that is depends on the records, so the lines that say it reach the operator only."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from privacy import accountant as acct
from privacy import events as ev
from privacy.ledger import BudgetExceededError, DeltaMismatchError, Ledger

from .data import Partition, SourceRecords
from .errors import ConfigError, PrivPromptError
from .run_plan import fitting_hint, largest_fitting_target_epsilon


def check_dataset_terms(ledger: Ledger | None, key: str, name: str, cap: float, delta: float,
                        unit: str = "record") -> dict | None:
    """The rules a run's config must meet against the ledger's record of its dataset, checked
    without writing (``privprompt plan`` and a run apply the same ones): a privacy unit other than
    the dataset's is refused (its cap and charges are stated per that unit: ``Ledger.require_unit``;
    a plain record-level run on a dataset of people is refused; one that bounds each person's
    records — ``data.person_field`` with ``data.max_records_per_unit`` — comes here with the person's
    field as its ``unit`` and is charged the group-privacy bound: ``privacy.plan.group_charge``); a δ other
    than the dataset's is refused (its ε would compose at another δ); a cap above the stored one is
    refused (raising a budget is a deliberate act). Returns the stored row (None: not registered
    yet)."""
    from privacy.ledger import UnknownDatasetError

    if ledger is None:
        return None
    try:
        row = ledger.dataset(key)
    except UnknownDatasetError:
        return None
    ledger.require_unit(key, unit)
    try:
        ledger.require_delta(key, delta)
    except DeltaMismatchError as exc:
        raise DeltaMismatchError(f"{exc}: a smaller δ with privprompt budget set-delta {key[:12]} DELTA --reason TEXT "
                                 "(a larger δ raises the dataset's budget, a policy step like a cap raise)") from None
    if cap > row["epsilon_cap"] + 1e-12:
        raise CapAboveStoredError(
            f"privacy.dataset_epsilon_cap={cap:g} is above the cap ε={row['epsilon_cap']:g} already set for "
            f"dataset {name!r} (fingerprint {key[:12]}); caps are only lowered from a run (set "
            f"privacy.dataset_epsilon_cap: {row['epsilon_cap']:g} or lower)")
    return row


def _records_of(part) -> "SourceRecords | None":
    """The source's keyed record digests kept with a partition (None: a partition object without
    them, which is then known by its key alone)."""
    path = getattr(part, "records_path", None)
    if not path or not getattr(part, "source_key", "") or not Path(path).is_file():
        return None
    return part.source_records()


def source_dataset(ledger: Ledger | None, records, name: str) -> dict | None:
    """The registered dataset a private source is charged to, WITHOUT writing (``privprompt plan``
    and the flow, before any run registers or reserves): its ledger row with ``how`` ('key': the
    source is that dataset's record set; 'records': it shares records with it; 'legacy': it is
    the dataset a ledger before schema 5 registered by its files' bytes); None: a new dataset.
    Raises ``RecordOverlapError`` (one line, naming the datasets) when the source shares records
    with two or more registered datasets. The rule (``Ledger.register_source``): a source is
    charged to the one registered dataset holding any of its records, and that dataset takes in
    its other records; so no record is ever in two datasets and never gets a second cap."""
    if ledger is None:
        return None
    return ledger.match_source(records.key, records.digests, records.legacy_key or None, name)


def charged_note(match: dict | None, name: str) -> str | None:
    """One line saying that a source is charged to another registered dataset (None: it is its own)."""
    if match is None or match["how"] == "key":
        return None
    why = ("shares records with" if match["how"] == "records" else
           "is (by its files, registered before the ledger kept records)")
    return (f"data source {name!r} {why} registered dataset {match['name']!r} (fingerprint "
            f"{match['fingerprint'][:12]}): its runs are charged against that dataset's budget (cap "
            f"ε={match['epsilon_cap']:g} at δ={match['delta']:g})")


def resolve_partition(ledger: Ledger | None, part: dict) -> tuple[dict, str | None]:
    """``part`` (a partition's dict) with ``dataset_key`` set to the key of the ledger dataset its
    source is charged to (:func:`source_dataset`, without writing), and the note saying so."""
    records = _records_of(Partition(**part))
    if records is None:
        return part, None
    match = source_dataset(ledger, records, part["dataset"])
    return {**part, "dataset_key": match["fingerprint"] if match else records.key}, charged_note(match, part["dataset"])


class CapAboveStoredError(ConfigError):
    """A config's cap above the one stored for its ledger dataset."""


class ChargedRefusal(PrivPromptError):
    """A ledger refusal whose reason names the registered dataset a source is charged to, or says
    that its records lie in several: said on the operator's terminal, while what Prefect and MLflow
    record of it names neither."""


@contextmanager
def refusals_to_operator(paths, charged_elsewhere: bool):
    """Ledger refusals raised inside pass with their full line to :func:`tasks.state.operator_note`
    and come out as one :class:`ChargedRefusal` line that names no dataset, when the reason depends
    on which dataset the source's records lie in (``charged_elsewhere``, or records in several
    datasets: ``RecordOverlapError``)."""
    from privacy.ledger import RecordOverlapError, UnitMismatchError

    from .state import operator_note

    try:
        yield
    except (RecordOverlapError, DeltaMismatchError, UnitMismatchError, BudgetExceededError,
            CapAboveStoredError) as exc:
        if not (charged_elsewhere or isinstance(exc, RecordOverlapError)):
            raise
        operator_note(paths, str(exc))
        raise ChargedRefusal("the ledger refused this run for the dataset its source is charged to (its δ, unit, "
                             "cap or records): the reason is on the operator's terminal and in the state folder's "
                             "private/operator.log; nothing reserved, no ε used") from None


def ensure_dataset(ledger: Ledger, part: Partition, cap: float, delta: float) -> dict:
    """Charge the private source of ``part`` to its ledger dataset, under :func:`check_dataset_terms`
    (checked first, against the dataset it will be charged to: a refusal writes nothing). A source
    is known by its keyed record digests: it is registered as a new dataset when it shares no
    record with a registered one, charged to the one registered dataset sharing its records
    otherwise (that dataset keeps its cap, δ and name, and takes in the source's other records),
    and refused when it shares records with several (``Ledger.register_source``). A lower cap in
    the config lowers the stored one (recorded). Returns the dataset's row (``how``: how the
    source was matched)."""
    records = _records_of(part)
    unit = getattr(part, "ledger_unit", "record")  # a record-level run on a dataset of people: the person's field
    if records is None:  # a partition without record digests: known by its key alone
        key = part.dataset_key
        row = check_dataset_terms(ledger, key, part.dataset, cap, delta, unit)
        if row is None:
            return ledger.register_dataset(key, part.dataset, cap, delta, unit=unit)
        if cap < row["epsilon_cap"]:
            return ledger.register_dataset(key, row["name"], cap, row["delta"], allow_cap_change=True, unit=unit)
        return row
    match = source_dataset(ledger, records, part.dataset)
    expected = match["fingerprint"] if match else records.key
    if match is not None:
        check_dataset_terms(ledger, expected, match["name"], cap, delta, unit)
    row = ledger.register_source(records.key, part.dataset, cap, delta, records.digests, records.legacy_key or None,
                                 unit=unit)
    how = row["how"]
    if row["fingerprint"] != expected:  # another run registered an overlapping source in between
        check_dataset_terms(ledger, row["fingerprint"], row["name"], cap, delta, unit)
    if cap < row["epsilon_cap"]:
        row = ledger.register_dataset(row["fingerprint"], row["name"], cap, row["delta"], allow_cap_change=True,
                                      unit=unit)
    return {**row, "how": how}


def charge_run_dataset(ctx, ledger: Ledger, delta: float) -> None:
    """:func:`ensure_dataset` for flow run ``ctx``, refused when its source is now charged to
    another dataset than the one the flow tagged and planned the run against (another run
    registered a source sharing its records meanwhile): said in full to the operator only."""
    part = ctx.part
    charged = ensure_dataset(ledger, part, ctx.cfg.privacy.dataset_epsilon_cap, delta)["fingerprint"]
    if charged == part.dataset_key:
        return
    from privacy.ledger import LedgerError

    from .state import operator_note

    operator_note(ctx.paths, f"data source {part.dataset!r} is now charged to dataset fingerprint {charged[:12]}, "
                             f"not {part.dataset_key[:12]} that run {ctx.flow_run_id} started with")
    raise LedgerError(f"data source {part.dataset!r} is now charged to another dataset than the one this run "
                      "started with (another run registered a source sharing its records meanwhile; the "
                      "operator's terminal says which); nothing was reserved: run it again")


def check_budget(ctx, plans: dict, delta: float) -> None:
    """Before any baseline, evaluation or training of a flow run: the dataset's terms (unit, δ, cap:
    :func:`check_dataset_terms`) and every DP event the run will reserve (``plans``: each run
    method's :class:`RunPlan`) composed with what the dataset has spent, against its cap — a dry
    run (``Ledger.preview``), writing nothing. Over the cap: :class:`BudgetExceededError` with what
    fits, as a reservation's refusal says it; a retry's methods already reserved are not counted twice."""
    cfg, part = ctx.cfg, ctx.part
    ledger = ctx.paths.open_ledger()
    key, cap = part.dataset_key, cfg.privacy.dataset_epsilon_cap
    row = check_dataset_terms(ledger, key, part.dataset, cap, delta, getattr(part, "ledger_unit", "record"))
    held = ({e["run_id"] for e in ledger.entries(key) if e["status"] in ("reserved", "committed")}
            if row is not None else set())
    events = [p.event for name, p in plans.items() if p.guarantee == "dp" and p.reads_private
              and p.event is not None and f"{ctx.flow_run_id}:{name}" not in held]
    if not events:
        return
    preview = ledger.preview(key, events, delta, cap=cap, name=part.dataset)
    cap = min(cap, preview["cap"])
    if preview["total_epsilon"] <= cap:
        return
    spent, needed = preview["spent_epsilon"], acct.spend(ev.ComposedEvent(tuple(events)), delta).epsilon
    largest = None if spent > cap else largest_fitting_target_epsilon(
        cfg, part.sizes, delta, ledger.counted_events(key) if row is not None else [], cap)
    raise BudgetExceededError(
        f"privacy budget for dataset {preview['name']!r} (fingerprint {key[:12]}…) exhausted: this run needs "
        f"ε={needed:.4f}, already spent ε={spent:.4f} of cap ε={cap:.4f} at δ={delta:g}; remaining "
        f"ε={max(0.0, cap - spent):.4f} (cap − spent; ε composes sub-additively); composed the total would be "
        f"ε={preview['total_epsilon']:.4f}; refused before any baseline, evaluation or training",
        fingerprint=key, name=preview["name"], needed=needed, spent=spent, total=preview["total_epsilon"],
        cap=cap, delta=delta).with_hint(fitting_hint(largest), largest)


def budget_statement(entry: dict, named: bool = True) -> str:
    """One clause saying what a dp ledger entry of a run used. ``named=False``: the dataset is not
    named (what Prefect records of a failed run: which dataset a source is charged to depends on its
    records; the operator's terminal gets the named one)."""
    eps = entry["epsilon_reserved"]
    dataset = f"dataset {entry['dataset']!r}" if named else "the dataset this run is charged to"
    if entry["status"] == "released":
        return f"no ε used on {dataset}: its reservation of ε={eps:.4f} was released (no private record was read)"
    if entry["status"] == "aborted":
        return f"no ε used on {dataset}: its reservation of ε={eps:.4f} was aborted"
    if entry["status"] == "committed":
        return f"ε={entry['epsilon']:.4f} used on {dataset} (committed)"
    return (f"ε={eps:.4f} used on {dataset}: the reservation stays spent (the run had begun reading private data)")
