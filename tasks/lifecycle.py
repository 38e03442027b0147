"""The one privacy lifecycle every method runs through:

    plan (pure) → register dataset / check δ → reserve the plan's worst case (dp) or record the use
    (ldp / none) → read private rows → train → commit what was spent (≤ the reservation) →
    post-process (public data only) → publish.

Everything that needs no private data is checked first (:func:`preflight`: the config's models
and tokenizers, label words and templates on them, endpoints), by ``privprompt plan`` and by a
run alike, so a config mistake fails before any budget is reserved. A run that fails after its
reservation but before its first private read releases the reservation (recorded as such); from
the first read on (``Ledger.mark_read``), the reservation stays spent. A run killed outright
(SIGKILL, out of memory) releases nothing: its reservation stays counted (``read_started_at`` says
whether it had begun reading) until an operator releases it (``privprompt budget release``), which
the ledger refuses once the run was marked read (tests/test_crash_stages.py).

Publish rule, in this one place: the output of a ``dp`` run goes to ``outputs/`` and MLflow;
every other output stays under ``private/``. Exact statistics of private data (training losses)
are written under ``private/`` only. A crash after the reservation keeps it spent.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from privacy import accountant as acct
from privacy import events as ev
from privacy.ledger import BudgetExceededError, DeltaMismatchError, Ledger, UnknownRunError

from . import plots, randomness, selection
from .data import Partition, SourceRecords, read_partition_split, read_partition_units
from .errors import ConfigError, PrivPromptError
from .methods import MethodContext, PrivateRows, get_method
from .methods.base import Trained
from .prompts import load_prompt_file, save_prompt_file
from .state import make_private_dir, open_private, private_file


# The publish rule: outputs of a formal guarantee — central DP, or local d_X privacy (the model
# only ever saw privatized inputs) — go to outputs/ and MLflow; everything else stays in private/.
PUBLISHED = ("dp", "ldp")


def resolve_delta(cfg, n_train: int, method_name: str | None = None) -> float:
    """δ of a run, under one policy for every method (whatever its ``default_delta`` returns):

    * no ``privacy.target_delta``: the published (or given) method's default, capped at
      1/(10·n_train);
    * a configured δ ≥ 1/n_train — which (ε, δ)-DP lets a mechanism spend on publishing whole
      records — is refused with a :class:`ConfigError`, unless the config opts in with
      ``privacy.allow_delta_at_least_one_over_n: true`` (then it is warned about, and the run
      record says so: :func:`delta_opt_in`)."""
    import numbers

    from privacy.validation import check_delta

    if isinstance(n_train, bool) or not isinstance(n_train, numbers.Integral) or n_train < 1:
        raise ConfigError(f"a run's δ needs the number of training records n_train >= 1, got {n_train!r}")
    n_train = int(n_train)
    if cfg.privacy.target_delta:
        allow = cfg.privacy.allow_delta_at_least_one_over_n
        try:
            return check_delta(cfg.privacy.target_delta, "privacy.target_delta", n=n_train,
                               allow_at_least_one_over_n=allow)
        except ValueError as exc:
            raise ConfigError(
                f"{exc}; or, to accept it knowingly, set "
                "privacy.allow_delta_at_least_one_over_n: true (the run record then carries "
                "privacy.delta_opt_in=true)") from None
    name = method_name or cfg.method
    # rounded down to 1, 2 or 5 × 10^k: n here is a released size, and a partition drawn anew (its
    # file touched) must keep its dataset's δ, not move it by a record's worth of noise
    default = _round_down_125(min(float(get_method(name).default_delta(n_train)), 0.1 / n_train))
    try:
        return check_delta(default, f"{name}.default_delta", n=n_train, allow_at_least_one_over_n=False)
    except ValueError as exc:
        raise ConfigError(f"method {name!r}: {exc}") from None


def _round_down_125(x: float) -> float:
    """The largest 1, 2 or 5 × 10^k not above ``x`` (> 0)."""
    import math

    k = math.floor(math.log10(x))
    for m in (5, 2, 1):
        if m * 10.0 ** k <= x * (1 + 1e-12):
            return float(f"{m}e{k}")
    return float(f"5e{k - 1}")


def delta_opt_in(cfg, n_train: int, delta: float) -> bool:
    """True when this run's δ is ≥ 1/n_train under ``privacy.allow_delta_at_least_one_over_n``
    (the run record tags it ``privacy.delta_opt_in``)."""
    return bool(cfg.privacy.allow_delta_at_least_one_over_n and n_train >= 1 and delta >= 1.0 / n_train)


def check_dataset_terms(ledger: Ledger | None, key: str, name: str, cap: float, delta: float,
                        unit: str = "record") -> dict | None:
    """The rules a run's config must meet against the ledger's record of its dataset, checked
    without writing (``privprompt plan`` and a run apply the same ones): a privacy unit other than
    the dataset's is refused (its cap and charges are stated per that unit: ``Ledger.require_unit``;
    a plain record-level run on a dataset of people is refused; one that bounds each person's
    records — ``data.person_field`` with ``data.max_records_per_unit`` — comes here with the person's
    field as its ``unit`` and is charged the group-privacy bound: :func:`charged_event`); a δ other
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
        raise ConfigError(
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


# ---- a method's plan, with the released sizes ------------------------------------------------

def with_size_release(event, sizes):
    """A dp run's event: the release of its partition's sizes (:class:`tasks.data.ReleasedSizes`)
    composed with the method's mechanism. Into each branch of a parallel composition (disjoint
    parts of the data, e.g. DP-OPT's generation and selection rows): a record lies in one branch,
    and the sizes release is about it too, so its loss is the release's plus its branch's."""
    size_event = sizes.event
    if isinstance(event, ev.ParallelEvent):
        return ev.ParallelEvent(tuple(ev.ComposedEvent((size_event, e)) for e in event.events))
    return ev.ComposedEvent((size_event, event))


def _with_target(cfg, target_epsilon: float):
    return cfg.model_copy(update={"privacy": cfg.privacy.model_copy(update={"target_epsilon": float(target_epsilon)})})


SIZES_DELTA_SHARE = 0.1  # of a dp run's δ, for the release of its partition's sizes


def charged_event(cfg, name: str, event):
    """The event the ledger charges for a dp run's ``event`` (the sizes release included): the
    event itself, or — for a record-level run on a dataset of people (``data.person_field`` with
    ``data.max_records_per_unit`` = k: whole people split, at most k records of each kept) — its
    group-privacy event for k records (:func:`privacy.group.group_event`), so that the ledger,
    whose dataset is stated per person, never under-counts a person. The sizes release is covered
    by the same rule: its record counts are moved by at most k by one person (whole people per
    split, at most k records each, canaries are no one's), so its Gaussian(σ) becomes σ/k. An
    event without a proven
    group rule (argmax / limited-domain votes, private selection) is a :class:`ConfigError` naming
    the method, raised before anything is reserved or read."""
    k = cfg.data.group_size
    if not k or event is None:
        return event
    from privacy.group import GroupPrivacyError, group_event

    try:
        return group_event(event, k)
    except GroupPrivacyError as exc:
        raise ConfigError(f"{name}: {exc}; refused for this record-level run on a dataset of people "
                          f"(data.person_field: {cfg.data.person_field})") from None


def sized_plan(cfg, name: str, sizes, delta: float):
    """Method ``name``'s plan on the released sizes, and the config the method runs with.

    The method plans with ``n_train`` = the released size ñ (q = B/ñ, steps, DP-OPT's rate). For a
    dp plan the sizes release S (``sizes.event``, a Gaussian count) is part of the run's
    mechanism, and the method's parameters are chosen from its output — an adaptive composition.
    Its guarantee is by basic composition, which holds for adaptively chosen mechanisms as long as
    their (ε, δ) are fixed beforehand [DR14, Thm. 3.16; Dwork, Rothblum & Vadhan 2010]: S is
    (ε_S, δ/10)-DP (``privacy.size_epsilon``: a function of σ and δ only), and the method is
    calibrated, whatever ñ is, to (ε' = target − ε_S, 9δ/10) (``privacy.method_epsilon``), so the
    run is (target, δ)-DP. The returned plan's event is S composed with the method's realised
    event (:func:`with_size_release`): what the ledger composes, and the run's ``privacy.epsilon``
    (the accountant's composition of the two realised events, at most the basic bound). The
    returned config carries ε' (what the method's ``train`` sees).

    For a record-level run on a dataset of people (``data.group_size`` = k), the plan's ``event``
    is the per-person charge (:func:`charged_event`) and ``record_event`` the per-record event
    above, which the target calibrates (:func:`planned_epsilon` checks it)."""
    from dataclasses import replace

    method = get_method(name)
    if not selection.applies(cfg, name):  # a selection is dp (its config check): no single-run plan needed
        plan = method.plan(cfg, sizes.n_train, delta)
        if plan.guarantee != "dp":
            return plan, cfg
    target = float(cfg.privacy.target_epsilon)
    delta_sizes = delta * SIZES_DELTA_SHARE
    eps_sizes = acct.spend(sizes.event, delta_sizes).epsilon
    share = target - eps_sizes
    if not share > target * 1e-3:
        raise ConfigError(f"{name}: privacy.target_epsilon = {target:g} leaves nothing for the method once the split "
                          f"sizes are released (ε = {eps_sizes:.4f} at data.size_noise_sigma = {sizes.sigma:g} records); "
                          "raise the target or data.size_noise_sigma")
    run_cfg = _with_target(cfg, share)
    if selection.applies(cfg, name):  # the published method's settings selected: one mechanism, one event
        try:
            plan = selection.plan_selection(method, run_cfg, sizes.n_train, delta - delta_sizes)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    else:
        plan = method.plan(run_cfg, sizes.n_train, delta - delta_sizes)
    method_eps = acct.spend(plan.event, delta - delta_sizes).epsilon
    if not eps_sizes + method_eps <= target * (1 + 1e-6):
        raise ConfigError(f"{name}: its plan would spend ε = {method_eps:.4f} at δ = {delta - delta_sizes:g} above its "
                          f"share {share:.4f} of privacy.target_epsilon = {target:g} (a calibration that misses its "
                          "target); nothing reserved")
    params = {**plan.params, "privacy.size_epsilon": eps_sizes, "privacy.method_epsilon": share}
    event = with_size_release(plan.event, sizes)
    if cfg.data.group_size:  # charged per person: the group event; the per-record one is what the target calibrates
        params["privacy.group_size"] = cfg.data.group_size
        return replace(plan, event=charged_event(cfg, name, event), record_event=event, delta=delta,
                       params=params), run_cfg
    return replace(plan, event=event, delta=delta, params=params), run_cfg


# ---- what fits -------------------------------------------------------------------------------

def planned_epsilon(cfg, name: str, plan, delta: float) -> float:
    """ε of a dp plan's worst case (its event, by the accountant), refused with a
    :class:`ConfigError` when above ``privacy.target_epsilon``: a method's calibration (σ, number of
    queries) must meet the target, and one that does not — a bug, or a stale or tampered accounting
    cache (privacy/calibration_cache.py) — is stopped before anything is reserved. ``plan`` and a
    run check it alike. For a record-level run charged per person it checks the per-record event
    (``plan.record_event``: what the target is for); the ledger charges ``plan.event``."""
    epsilon = acct.spend(plan.record_event if plan.record_event is not None else plan.event, delta).epsilon
    target = float(cfg.privacy.target_epsilon)
    if not epsilon <= target * (1 + 1e-6):
        raise ConfigError(f"{name}: its plan would spend ε = {epsilon:.4f} at δ = {delta:g}, above "
                          f"privacy.target_epsilon = {target:g} (a calibration that misses its target; if the "
                          "state folder's cache/accounting.json was edited or copied from elsewhere, remove it); "
                          "nothing reserved")
    return epsilon


def planned_events(cfg, sizes, delta: float, target_epsilon: float | None = None) -> list:
    """The worst-case events of every dp run of ``cfg`` (baselines and the published method) on
    the released ``sizes``, at ``target_epsilon`` instead of the config's when given."""
    if target_epsilon is not None:
        cfg = _with_target(cfg, target_epsilon)
    events = []
    for name in cfg.run_methods:
        plan, _ = sized_plan(cfg, name, sizes, delta)
        if plan.event is not None:
            events.append(plan.event)
    return events


def _shown_digits(x: float) -> int:
    """Decimals that show ``x`` with 4 significant digits (never fewer than 0)."""
    import math

    return max(3 - math.floor(math.log10(x)), 0)


def largest_fitting_target_epsilon(cfg, sizes, delta: float, existing: list, cap: float) -> float | None:
    """The largest ``privacy.target_epsilon`` at which a run of ``cfg`` still fits the dataset's
    budget: its planned events composed with ``existing`` (the ledger's counted events) by the
    accountant, ≤ ``cap``. None when no run of ``cfg`` fits, or when it plans no dp event (then the
    budget does not limit it).

    The answer is the number a user types: rounded DOWN to 4 significant digits and checked to
    fit as rounded. (Rounding down alone is not enough: calibration meets each target only to a
    tolerance, so the composed ε is not monotone in the target at that scale, and 2.422 could
    compose to 3.0003 where 2.4226 composed to ≤ 3.)"""
    import math

    planned = planned_events(cfg, sizes, delta)
    if not planned:
        return None
    if not existing and len(planned) == 1 and not cfg.data.group_size:
        # nothing spent and one dp run: every method calibrates its worst case to ε ≤ its target,
        # so a run at target = cap fits, and no larger target is meaningful (exact, no search); not
        # so for a record-level run charged per person (its charge is above its per-record target)
        return float(cap)

    def fits(x: float) -> bool:
        try:
            events = planned_events(cfg, sizes, delta, x)
        except ValueError:
            return False
        return acct.spend(ev.ComposedEvent(tuple(existing + events)), delta).epsilon <= cap

    found = acct.largest_fitting_epsilon(lambda x: planned_events(cfg, sizes, delta, x), existing, delta, cap)
    if found is None:
        return None
    digits = _shown_digits(found)
    step = 10.0 ** -digits
    shown = math.floor(found / step) * step
    for _ in range(10):  # a step or two down at most, in practice
        if shown <= 0:
            break
        if fits(round(shown, digits)):
            return round(shown, digits)
        shown -= step
    return found  # fits (the search checked it), unrounded


def fitting_hint(largest: float | None) -> str:
    if largest is None:
        return "no target_epsilon fits: the dataset's budget is spent for this config"
    return f"the largest target_epsilon that still fits: ≈ {largest:.{_shown_digits(largest)}f}"


# ---- checks that need no private data ------------------------------------------------------

def check_endpoint(endpoint, timeout_s: float = 10.0) -> None:
    """The endpoint answers HTTP at all (GET <base_url>/models; nothing is sent)."""
    import urllib.error
    import urllib.request

    from models.prompts.endpoint import EndpointError

    url = endpoint.base_url.rstrip("/") + "/models"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="GET"), timeout=timeout_s):
            return
    except urllib.error.HTTPError:
        return  # it answered (401, 404, …): reachable
    except (urllib.error.URLError, TimeoutError, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        raise EndpointError(f"models.endpoints[{endpoint.alias}]: {endpoint.base_url} is unreachable "
                            f"({type(err).__name__}: {reason})") from None


def preflight(cfg, prepared: dict[str, dict] | None = None) -> None:
    """Every check of ``cfg`` that needs no private data, raising a one-line user error: each run
    method's own (:meth:`Method.preflight`: models, tokenizers, label words / descriptions,
    templates), the evaluation models', and the endpoints' reachability. ``prepared``: method →
    what its ``prepare`` returned (None in ``privprompt plan``). A run calls it before it reserves
    any budget; ``privprompt plan`` calls the same function."""
    from .methods.base import Method, check_classifier
    from .stages import evaluation_models

    methods = [get_method(name) for name in cfg.run_methods]
    for name, method in zip(cfg.run_methods, methods):
        method.preflight(cfg, None if prepared is None else prepared.get(name))
    if any(type(m).evaluate_published is Method.evaluate_published for m in methods):
        for role, model_name in evaluation_models(cfg).items():
            check_classifier(cfg, model_name, f"models.{role}" if role == "local" else "models.target")
    for model_name in cfg.models.evaluate_on:
        check_classifier(cfg, model_name, "models.evaluate_on")
    for endpoint in cfg.models.endpoints:
        check_endpoint(endpoint)


# ---- what a failed run used ----------------------------------------------------------------

def budget_statement(entry: dict) -> str:
    """One clause saying what a dp ledger entry of a run used."""
    eps = entry["epsilon_reserved"]
    dataset = f"dataset {entry['dataset']!r}"
    if entry["status"] == "released":
        return f"no ε used on {dataset}: its reservation of ε={eps:.4f} was released (no private record was read)"
    if entry["status"] == "aborted":
        return f"no ε used on {dataset}: its reservation of ε={eps:.4f} was aborted"
    if entry["status"] == "committed":
        return f"ε={entry['epsilon']:.4f} used on {dataset} (committed)"
    return (f"ε={eps:.4f} used on {dataset}: the reservation stays spent (the run had begun reading private data)")


def read_private_rows(part: Partition, validation: bool = False) -> PrivateRows:
    texts, labels = read_partition_split(part.train_path)
    rows = PrivateRows(texts, labels, units=read_partition_units(part.train_path))
    if validation:
        rows.validation = PrivateRows(*read_partition_split(part.holdout_path),
                                      units=read_partition_units(part.holdout_path))
    return rows


def _write_private_history(directory: Path, name: str, history: list[dict]) -> str | None:
    """Exact private statistics (per-step losses) stay local: a JSON file and a curve under private/."""
    if not history:
        return None
    path = directory / f"{name}_history.json"
    with open_private(path, "w") as handle:  # 0600: per-step losses, batch sizes, clip rates
        handle.write(json.dumps(history))
    fig = plots.training_curve(history, f"{name}: batch loss (PRIVATE: exact statistic of private data)")
    curve = directory / f"{name}_training_curve.png"
    with open_private(curve, "wb") as handle:
        fig.savefig(handle, format="png", dpi=120, bbox_inches="tight")
    plots.close(fig)
    return str(path)


class ReleaseError(PrivPromptError):
    """A retried run whose DP output cannot be republished as it was: refused, because making a
    second DP output under the run's one charge would spend privacy the ledger never counted."""


def release_dir(private_run_dir: Path) -> Path:
    """Where a dp run stores its DP output and its release manifest before the commit (private
    side: the manifest carries the training's audit statistics; the published copies are made
    from it)."""
    return Path(private_run_dir) / "releases"


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def store_release(private_run_dir: Path, name: str, run_key: str, trained: Trained) -> bool:
    """Store the DP output of run ``run_key`` (method ``name``) and everything republishing it
    needs (event, steps, metrics, audit statistics, the output file's SHA-256) BEFORE the commit.

    The first attempt of a run to store wins: the manifest is written whole under an
    attempt-unique name and then hard-linked into place, which fails when it is already there. So
    when two attempts of one run are alive at once (a worker declared lost that is still running,
    and its retry), exactly one DP output is ever stored, and the other attempt's output is
    removed. Returns True when this attempt's output is the run's, False when another attempt
    stored first (republish that one: :func:`stored_release`)."""
    import os
    import secrets

    directory = make_private_dir(release_dir(private_run_dir))
    attempt = secrets.token_hex(8)  # the output file of each attempt has its own name: none overwrites another's
    prompt_path = prompt_file = digest = None
    if trained.prompt is not None:
        prompt_path = save_prompt_file(directory, f"{name}_dp_output.{attempt}", trained.prompt,
                                       {"method": name, "run_key": run_key})
        prompt_file, digest = private_file(prompt_path).name, _sha256(prompt_path)
    manifest = {"run_key": run_key, "method": name, "event": ev.event_to_json(trained.event),
                "prompt_file": prompt_file, "sha256": digest, "steps": int(trained.steps),
                "metrics": {k: float(v) for k, v in trained.metrics.items()},
                "audit_metrics": {k: float(v) for k, v in trained.audit_metrics.items()}}
    if trained.record_event is not None:  # a record-level run charged per person: its per-record event
        manifest["record_event"] = ev.event_to_json(trained.record_event)
    target = directory / f"{name}.json"
    tmp = directory / f"{name}.json.{attempt}.tmp"
    with open_private(tmp, "w") as handle:
        handle.write(json.dumps(manifest, indent=1, sort_keys=True))
        handle.flush()
        os.fsync(handle.fileno())
    try:
        os.link(tmp, target)  # atomic, and refused when another attempt's manifest is there
        return True
    except FileExistsError:
        if prompt_path is not None:
            prompt_path.unlink(missing_ok=True)  # this attempt's output is never released
        return False
    finally:
        tmp.unlink(missing_ok=True)


def stored_release(ledger: Ledger, run_key: str, private_run_dir: Path, name: str) -> Trained | None:
    """The DP output run ``run_key`` already made, as a :class:`Trained` to republish; None when
    it has made none that was stored (train then). Raises :class:`ReleaseError` when the ledger
    has committed the run's spend but its stored output is missing or changed, or when a stored
    output does not match the ledger: never a second DP output under one charge."""
    try:
        entry = ledger.entry(run_key)
    except UnknownRunError:
        entry = None
    committed = entry is not None and entry["kind"] == "dp" and entry["status"] == "committed"
    directory = release_dir(private_run_dir)
    manifest_path = directory / f"{name}.json"
    fresh_run = "start a new flow run (a new run id and a new charge) to train again"
    if not manifest_path.is_file():
        if committed:
            raise ReleaseError(
                f"run {run_key!r} already committed ε={entry['epsilon']:.4g} for its DP output, but the stored "
                f"output is missing ({manifest_path} does not exist): refusing to train again under the same "
                f"charge; restore the run's private state folder, or {fresh_run}")
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
        event = ev.event_from_json(manifest["event"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ReleaseError(f"run {run_key!r}: the stored release manifest {manifest_path} is unreadable ({exc}); "
                           f"refusing to train again under the same charge: {fresh_run}") from None
    problem = None
    if manifest.get("run_key") != run_key or manifest.get("method") != name:
        problem = f"it belongs to run {manifest.get('run_key')!r} of method {manifest.get('method')!r}"
    elif entry is None or entry["kind"] != "dp":
        problem = "the ledger holds no dp reservation for this run"
    elif committed and entry["committed_event"] != json.loads(manifest["event"]):
        problem = "its event differs from the one the ledger committed"
    elif manifest.get("prompt_file"):
        path = directory / manifest["prompt_file"]
        if not path.is_file():
            problem = f"its output file {path} is missing"
        elif _sha256(path) != manifest.get("sha256"):
            problem = f"its output file {path} was changed after it was stored"
    if problem:
        raise ReleaseError(f"run {run_key!r} stored a DP output ({manifest_path}) that cannot be republished: "
                           f"{problem}; refusing to make a second DP output under the same charge: {fresh_run}")
    prompt = load_prompt_file(str(directory / manifest["prompt_file"])) if manifest.get("prompt_file") else None
    record_event = ev.event_from_json(manifest["record_event"]) if manifest.get("record_event") else None
    return Trained(prompt, event, int(manifest.get("steps", 0)), dict(manifest.get("metrics", {})),
                   [], dict(manifest.get("audit_metrics", {})), record_event=record_event)


# TEST-ONLY (tests/test_crash_stages.py kills a run with SIGKILL at each stage of the lifecycle):
# PRIVPROMPT_TEST_PAUSE_AT="<stage>:<marker file>" makes the run write its pid to the marker file
# at that stage point and sleep there, so that the test can kill it at a known point. Unset (always,
# outside that test) it does nothing. The stages: reserved (after the reservation, before the first
# private read), training (after mark_read and the private read, before training), committed (after
# the ledger's commit, before post-processing and publishing), publishing (the prompt written to
# outputs/, not yet logged to MLflow).
TEST_PAUSE_ENV = "PRIVPROMPT_TEST_PAUSE_AT"
TEST_PAUSE_STAGES = ("reserved", "training", "committed", "publishing")


def _test_pause(stage: str) -> None:
    spec = os.environ.get(TEST_PAUSE_ENV)
    if not spec or spec.partition(":")[0] != stage:
        return
    Path(spec.partition(":")[2]).write_text(str(os.getpid()))
    time.sleep(300)  # the test kills the process here; bounded, so a forgotten run still ends


@dataclass(frozen=True)
class RunOutcome:
    """What one method's pass through the lifecycle produced: paths and numbers, no tensor (a
    Prefect task result: plain fields, so it pickles into result storage).

    ``guarantee``: the plan's (``dp`` | ``ldp`` | ``none``); ``prompt_path``: the output after
    post-processing (``outputs/`` when ``published``, else ``private/``; None when the method
    makes no prompt); ``source_prompt_path``: the prompt as trained (the same file without
    post-processing); ``spend`` / ``event``: the committed (ε, δ) and event (dp only);
    ``compute``: seconds of model work per stage (``train``, ``post_process``);
    ``train_metrics``: the training's metrics as logged on its child run (audit statistics
    included), ``audit_metrics``: those of them that are audit statistics of private data;
    ``republished``: a retry that republished the stored DP output; ``reserved_new``: whether
    this call made the run's reservation (None: no reservation)."""

    method: str
    guarantee: str
    private: bool
    params: dict = field(default_factory=dict)
    steps: int = 0
    compute: dict = field(default_factory=dict)
    prompt_path: str | None = None
    source_prompt_path: str | None = None
    spend: dict | None = None
    event: dict | None = None
    republished: bool = False
    reserved_new: bool | None = None
    train_metrics: dict = field(default_factory=dict)
    audit_metrics: dict = field(default_factory=dict)
    published: bool = False

    @property
    def epsilon(self) -> float | None:
        """The committed ε (None: no dp spend)."""
        return (self.spend or {}).get("epsilon")


def run_method(ctx, name: str, prepared: dict, progress=None) -> RunOutcome:
    """Run method ``name`` through the lifecycle inside flow run ``ctx``; returns a :class:`RunOutcome`.

    Retries (a Prefect task or flow retry calls this again with the same flow run id, so the same
    ``run_key``) never make a second DP output under the run's one charge:

    * the DP output (with its event, counts and audit statistics) is stored under the run's
      private folder (:func:`store_release`) BEFORE ``ledger.commit``; every later step —
      commit, post-processing (public data only), publishing — starts from that stored output;
    * a retry of a run whose stored output exists (committed, or crashed between storing and
      committing) reads no private row and does not train: it commits the stored event (a no-op
      when committed) and republishes the stored output (:func:`stored_release`);
    * a retry of a committed run whose stored output is missing or changed is refused
      (:class:`ReleaseError`), never trained again;
    * a retry after a crash between the reservation and the first private read (nothing read,
      nothing shown) runs under the same reservation (``reserve`` is idempotent: no second charge);
    * a retry after a crash between the first private read and the storing is refused
      (:class:`ReleaseError`): the lost attempt ran part of the mechanism and may have shown some
      of its outputs on the way (DP-OPT's per-query progress), which its reservation — the declared
      worst case, kept spent — covers; running the mechanism again would need a second charge.
      Such a run fails; a new ``privprompt run`` is a new run with its own reservation.
    """
    method = get_method(name)
    cfg, part, paths = ctx.cfg, ctx.part, ctx.paths
    sizes = part.sizes  # released: what the run publishes and plans with (never the exact sizes)
    delta = resolve_delta(cfg, sizes.n_for_delta)  # the run's δ (its published method's): one δ per run
    opt_in = delta_opt_in(cfg, sizes.n_for_delta, delta)
    plan, method_cfg = sized_plan(cfg, name, sizes, delta)
    run_key = f"{ctx.flow_run_id}:{name}"
    ledger = paths.open_ledger()  # the state folder's file, or the team's ledger by URL
    charged = ensure_dataset(ledger, part, cfg.privacy.dataset_epsilon_cap, delta)["fingerprint"]
    if charged != part.dataset_key:  # the flow tagged and planned the run against another dataset
        from privacy.ledger import LedgerError

        raise LedgerError(f"data source {part.dataset!r} is now charged to dataset fingerprint {charged[:12]}, not "
                          f"{part.dataset_key[:12]} that this run started with (another run registered a source "
                          "sharing its records meanwhile); nothing was reserved: run it again")
    method.preflight(cfg, prepared)  # before the reservation (the flow ran all of them already: cached)
    if opt_in:  # the run record says that this run's δ is ≥ 1/n by the config's explicit opt-in
        ctx.parent.set_tags({"privacy.delta_opt_in": "true"})
    child = ctx.parent.child(name, {"method": name, "stage": "train", "privacy.guarantee": plan.guarantee,
                                    **({"privacy.delta_opt_in": "true"} if opt_in else {})})
    reservation = stored = None
    read_begun = False
    try:
        if plan.reads_private:
            # before any private row is read: reserve the worst case, or record the use as what it is
            if plan.guarantee == "dp":
                planned_epsilon(cfg, name, plan, delta)
                stored = stored_release(ledger, run_key, ctx.private_run_dir, name)
                note = f" (δ={delta:g} ≥ 1/n by privacy.allow_delta_at_least_one_over_n)" if opt_in else ""
                if cfg.data.group_size:
                    note += (f" (record-level, charged per {cfg.data.person_field} by group privacy for "
                             f"≤ {cfg.data.group_size} records)")
                try:
                    reservation = ledger.reserve(part.dataset_key, run_key, plan.event,
                                                 description=f"{name} flow run {ctx.flow_run_id}{note}",
                                                 allow_delta_at_least_one_over_n=opt_in)
                except BudgetExceededError as exc:  # say what does fit, for this config
                    # spent above the cap (a lowered cap, or ε held from before a δ change): nothing fits
                    largest = None if exc.spent > exc.cap else largest_fitting_target_epsilon(
                        cfg, sizes, delta, ledger.counted_events(part.dataset_key), exc.cap)
                    raise exc.with_hint(fitting_hint(largest), largest) from None
            elif plan.guarantee == "ldp":
                ledger.record_ldp(part.dataset_key, run_key, f"{name}: local d_X privacy, no (ε, δ) claim")
            else:
                ledger.record_nonprivate(part.dataset_key, run_key, f"{name}: {plan.note or 'no formal guarantee'}")
        mctx = MethodContext(method_cfg, paths, prepared, randomness.for_config(cfg), cfg.seed,
                             ctx.output_dir if plan.guarantee in PUBLISHED else ctx.private_run_dir, part.dataset_key)
        if stored is not None:  # a retry: the stored DP output, no private read, no training
            trained, train_s = stored, 0.0
        else:
            if reservation is not None:
                _test_pause("reserved")
                if ledger.entry(run_key).get("read_started_at") is not None:
                    # an earlier attempt of this run read private rows and was lost before it stored
                    # its output; it may have shown some of its mechanism's outputs on the way
                    # (progress of DP-OPT's queries), which the reservation covers. A second run of
                    # the mechanism would need a second charge: refused, the reservation stays spent
                    raise ReleaseError(
                        f"run {run_key}: an earlier attempt began reading private data and was lost before it "
                        "stored its DP output; its reservation stays spent and this attempt does not run the "
                        "mechanism again under it (a new `privprompt run` is a new charge)")
                ledger.mark_read(run_key)  # from here on the reservation stays spent, whatever happens
            read_begun = plan.reads_private
            selects = selection.applies(cfg, name)
            rows = (read_private_rows(part, method.uses_validation or selects) if plan.reads_private
                    else PrivateRows([], []))
            if reservation is not None:
                _test_pause("training")
            started = time.perf_counter()
            if selects:  # K trials of candidates, noisy holdout scores, the best one: the plan's one mechanism
                trained = selection.train_selection(method, mctx, plan, rows,
                                                    ctx.private_run_dir / "selection.log", announce=_announce)
            else:
                trained = method.train(mctx, plan, rows, progress=progress(name) if progress else None)
            train_s = time.perf_counter() - started
            del rows
            if plan.guarantee == "dp":
                if trained.event is None:
                    raise RuntimeError(f"{name}: a dp plan's training returned no privacy event")
                trained.event = with_size_release(trained.event, sizes)  # the run's mechanism: sizes + method
                if cfg.data.group_size:  # charged per person (group privacy); the per-record event kept beside it
                    trained.record_event, trained.event = trained.event, charged_event(cfg, name, trained.event)
                if not store_release(ctx.private_run_dir, name, run_key, trained):  # a retry republishes it
                    # another attempt of this run, alive at the same time, stored its DP output first:
                    # that one is the run's output; this attempt's is dropped, never published
                    trained = stored = stored_release(ledger, run_key, ctx.private_run_dir, name)
        info: dict = {"method": name, "guarantee": plan.guarantee, "private": plan.guarantee == "dp",
                      "params": plan.params, "steps": trained.steps, "compute": {"train": train_s},
                      "prompt_path": None, "source_prompt_path": None, "spend": None, "event": None,
                      "republished": stored is not None}
        metrics = dict(trained.metrics)
        if plan.guarantee == "dp":
            if trained.event is None:
                raise RuntimeError(f"{name}: a dp plan's training returned no privacy event")
            ledger.commit(run_key, trained.event)  # refuses (after recording it) a spend above the reservation
            _test_pause("committed")
            spend = acct.spend(trained.event, delta)
            info.update({"spend": spend.to_dict(), "event": ev.event_to_dict(trained.event),
                         "reserved_new": reservation.new if reservation is not None else None})
            metrics.update({"privacy.epsilon": spend.epsilon, "privacy.delta": delta,
                            "privacy.epsilon_rdp": spend.epsilon_rdp})
            if trained.record_event is not None:  # privacy.epsilon is per person; the mechanism's per-record ε beside it
                per_record = acct.spend(trained.record_event, delta).epsilon
                info["spend"]["epsilon_per_record"] = per_record
                metrics["privacy.epsilon_per_record"] = per_record
        _write_private_history(ctx.private_run_dir, name, trained.history)
        if trained.audit_metrics:
            ledger.record_nonprivate(part.dataset_key, f"{run_key}:audit-statistics",
                                     f"{name}: audit statistics computed on private data (not DP): "
                                     + ", ".join(sorted(trained.audit_metrics)))
            metrics.update(trained.audit_metrics)
            info["audit_metrics"] = trained.audit_metrics
        info["train_metrics"] = dict(metrics)
        winner = None
        if selection.applies(cfg, name):  # the published candidate, by name, on the run record
            won = selection.winner_of(plan, trained.metrics)
            winner = "none" if won is None else (selection.NO_PROMPT if won[2] else won[0])
            chosen = {"selection.winner": winner}
            best = selection.best_trial_name(plan, trained.metrics)
            if best is not None:  # no prompt published instead of the best trial (released numbers only)
                chosen["selection.best_trial"] = best
            ctx.parent.log_params(chosen)
            if not selection.every_candidate(cfg.selection):  # the opt-in check_selection_config asked for
                ctx.parent.set_tags({"selection.timing_channel": "the run's duration grows with the secret number of "
                                     "trials K and shows in MLflow's and Prefect's timestamps; its ε assumes K "
                                     "secret (selection.accept_timing_channel: true)"})
            info["params"] = {**plan.params, **chosen}
        child.log_params({**info["params"], **({"privacy.delta_opt_in": "true"} if opt_in else {})})
        child.log_metrics(metrics)
        if trained.prompt is not None:
            published = plan.guarantee in PUBLISHED  # the publish rule
            directory = ctx.output_dir if published else ctx.private_run_dir
            meta = {"method": name, "privacy.guarantee": plan.guarantee, "model": method.published_model(cfg, prepared)}
            if info["spend"] is not None:
                meta.update({"privacy.epsilon": f"{info['spend']['epsilon']:.6f}", "privacy.delta": f"{delta:.3g}",
                             "dataset.fingerprint": part.published_key})
            meta.update({k: str(v) for k, v in plan.params.items()})
            post_mctx, post_plan = mctx, plan
            if selection.applies(cfg, name):  # the winner's own settings post-process its output
                meta["selection.winner"] = winner
                post_mctx, post_plan = selection.winner_context(method, mctx, plan, trained.metrics)
            started = time.perf_counter()
            post = method.post_process(post_mctx, post_plan, trained.prompt,
                                       progress=progress(f"{name}:post") if progress else None)
            if post.prompt is not trained.prompt:
                info["compute"]["post_process"] = time.perf_counter() - started
                info["source_prompt_path"] = str(save_prompt_file(directory, f"{name}_source", trained.prompt, {
                    **meta, "model": method.source_model(cfg, prepared), "stage": "train"}))
            info["prompt_path"] = str(save_prompt_file(directory, name, post.prompt, meta))
            if info["source_prompt_path"] is None:
                info["source_prompt_path"] = info["prompt_path"]
            if published:
                _test_pause("publishing")
                child.log_file(info["prompt_path"], "prompt")
                from .publish import publish_usable  # PEFT adapter + registered model version

                publish_usable(ctx, child, name, plan.guarantee, info["prompt_path"], info["spend"])
            if post.child:
                log_post_child(ctx, post.child, plan.guarantee)
        child.end()
        info["published"] = plan.guarantee in PUBLISHED and info["prompt_path"] is not None
        return RunOutcome(**info)
    except BaseException as exc:
        child.end(ok=False)
        if reservation is not None:
            if not read_begun and stored is None:
                try:  # no private record was read: the reservation costs nothing (recorded as released)
                    ledger.release(run_key, f"{type(exc).__name__} before any private record was read")
                except ValueError:
                    pass  # an earlier attempt of this run began reading: it stays spent
            try:
                exc.add_note(f"budget: {budget_statement(ledger.entry(run_key))}")
            except Exception:  # noqa: BLE001 - the statement must never hide the error itself
                pass
        raise


def _announce(line: str) -> None:
    """A public progress line of the selection (start and end only: tasks/selection.py)."""
    try:
        from prefect import get_run_logger

        get_run_logger().info(line)
    except Exception:  # noqa: BLE001 - outside a flow (tests, audit shadows): nowhere to say it
        pass


def log_post_child(ctx, spec: dict, guarantee: str) -> None:
    run = ctx.parent.child(spec["name"], {**spec.get("tags", {}), "privacy.guarantee": guarantee})
    run.log_params(spec.get("params", {}))
    run.log_metrics(spec.get("metrics", {}))
    for metric, points in spec.get("series", {}).items():
        for step, value in points:
            run.log_metrics({metric: value}, step=step)
    run.end()


def shadow_prompt(config: dict, method_name: str, prepared: dict, state_dir: str, rows: PrivateRows,
                  shadow_seed: int):
    """An audit shadow: the audited method's own ``train`` + ``post_process`` on ``rows`` (pool
    rows), no ledger, no tracking (shadows are private working data). Returns (prompt, steps)."""
    from .config import parse_config
    from .state import state_paths

    cfg = parse_config(config)  # its seed stays: models and splits are the audited run's
    method = get_method(method_name)
    index = rows.unit_index()
    n = len(rows) if index is None else index[1]  # privacy units: rows, or the pool's units (user unit)
    plan = method.plan(cfg, n, resolve_delta(cfg, n, method_name))
    mctx = MethodContext(cfg, state_paths(state_dir), prepared, randomness.for_shadow(cfg, shadow_seed), shadow_seed)
    trained = method.train(mctx, plan, rows)
    post = method.post_process(mctx, plan, trained.prompt)
    return post.prompt, trained.steps + post.steps
