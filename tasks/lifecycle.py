"""The one privacy lifecycle every method runs through:

    plan (pure, once: ``tasks.run_plan.plan_for``) → register dataset / check δ → reserve the
    plan's worst case (dp) or record the use (ldp / none) → read private rows → train → store the
    DP output → commit what was spent (≤ the reservation) → post-process (public data only) →
    publish.

:func:`run_method` is that door, one small function a step (:func:`open_door`, :func:`reserve`,
:func:`train`, :func:`store`, :func:`commit`, :func:`publish`); what it records on MLflow is in
``tasks/recording.py``, the usable forms of a published output in ``tasks/publish.py``. A
selection of a method's settings is a method too (``tasks.selected.Selected``): the door never
asks whether a run selects.

Everything that needs no private data is checked first (:func:`preflight`: the config's models
and tokenizers, label words and templates on them, endpoints), by ``privprompt plan`` and by a
run alike, so a config mistake fails before any budget is reserved. A run that fails after its
reservation but before its first private read releases the reservation (recorded as such); from
the first read on (``Ledger.mark_read``), the reservation stays spent. A run killed outright
(SIGKILL, out of memory) releases nothing: its reservation stays counted (``read_started_at`` says
whether it had begun reading) until an operator releases it (``privprompt budget release``), which
the ledger refuses once the run was marked read (tests/claims/test_crash_stages.py).

Publish rule, in this one place: the output of a ``dp`` run goes to ``outputs/`` and MLflow;
every other output stays under ``private/``. Exact statistics of private data (training losses)
are written under ``private/`` only. A crash after the reservation keeps it spent.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from privacy import accountant as acct
from privacy import events as ev
from privacy.ledger import BudgetExceededError, DeltaMismatchError, Ledger, ReadClaimedError, UnknownRunError
from privacy.plan import RunPlan, thawed

from . import plots, randomness, recording
from .data import Partition, SourceRecords, read_partition_split, read_partition_units
from .errors import ConfigError, PrivPromptError
from .methods import MethodContext, PrivateRows, get_method
from .methods.base import Trained
from .prompts import load_prompt_file, save_prompt_file
from .recording import log_post_child  # noqa: F401 - where callers found it
from .run_plan import (SIZES_DELTA_SHARE, fitting_hint, largest_fitting_target_epsilon,  # noqa: F401
                       plan_for, planned_epsilon, planned_events, resolve_delta, runner, shadow_plan,
                       with_size_release)
from .selected import Choice, method_for
from .state import make_private_dir, open_private, private_file


# The publish rule: outputs of a formal guarantee — central DP, or local d_X privacy (the model
# only ever saw privatized inputs) — go to outputs/ and MLflow; everything else stays in private/.
PUBLISHED = ("dp", "ldp")


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
    except (RecordOverlapError, DeltaMismatchError, UnitMismatchError, BudgetExceededError, ConfigError) as exc:
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


def check_placements(cfg) -> None:
    """``models.placement`` and each ``models.placement_for`` entry can apply on this machine's device
    (8-/4-bit and device_map need CUDA; 8-/4-bit need bitsandbytes): refused in one line before any model
    is loaded or any budget reserved."""
    from models.backbones import ModelLoadError
    from models.device import default_device
    from models.placement import PlacementError, check_placement

    device = default_device()
    blocks = [("models.placement", cfg.models.placement),
              *((f"models.placement_for[{name!r}]", block) for name, block in cfg.models.placement_for.items())]
    for where, block in blocks:
        try:
            check_placement(block.placement(), device)
        except PlacementError as e:
            raise ModelLoadError(f"{where}: {e}") from None


def preflight(cfg, prepared: dict[str, dict] | None = None) -> None:
    """Every check of ``cfg`` that needs no private data, raising a one-line user error: each run
    method's own (:meth:`Method.preflight`: models, tokenizers, label words / descriptions,
    templates), the evaluation models', and the endpoints' reachability. ``prepared``: method →
    what its ``prepare`` returned (None in ``privprompt plan``). A run calls it before it reserves
    any budget; ``privprompt plan`` calls the same function."""
    from .methods.base import Method, check_classifier
    from .stages import evaluation_models

    check_placements(cfg)
    methods = [get_method(name) for name in cfg.run_methods]
    for name in cfg.run_methods:  # a selected method checks every candidate's settings too
        method_for(cfg, name).preflight(cfg, None if prepared is None else prepared.get(name))
    published = get_method(cfg.method)  # its soft prompt's or prefix's positions, on every model that scores it
    positions = (getattr(published.settings(cfg), "n_tokens", 0) or 0) if published.prompt_kind in ("soft", "prefix") else 0
    if any(type(m).evaluate_published is Method.evaluate_published for m in methods):
        for role, model_name in evaluation_models(cfg).items():
            check_classifier(cfg, model_name, f"models.{role}" if role == "local" else "models.target", positions)
    for model_name in cfg.models.evaluate_on:
        check_classifier(cfg, model_name, "models.evaluate_on", positions)
    for endpoint in cfg.models.endpoints:
        check_endpoint(endpoint)


# ---- what a failed run used ----------------------------------------------------------------

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


# TEST-ONLY (tests/claims/test_crash_stages.py kills a run with SIGKILL at each stage of the lifecycle):
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
    registered_model: str | None = None  # models:/NAME/VERSION of the published output, when registered

    @property
    def epsilon(self) -> float | None:
        """The committed ε (None: no dp spend)."""
        return (self.spend or {}).get("epsilon")


@dataclass
class Door:
    """One method's pass through the lifecycle: what each step of the door reads and leaves."""

    ctx: Any
    name: str
    method: Any
    plan: RunPlan
    prepared: dict
    run_key: str
    ledger: Ledger
    child: Any
    opt_in: bool
    mctx: MethodContext | None = None
    reservation: Any = None
    stored: Trained | None = None
    read_begun: bool = False

    @property
    def dp(self) -> bool:
        return self.plan.guarantee == "dp"


def run_method(ctx, name: str, prepared: dict, progress=None, plan: RunPlan | None = None) -> RunOutcome:
    """Run method ``name`` through the lifecycle inside flow run ``ctx`` under its ``plan`` (the
    flow's, computed once by :func:`tasks.run_plan.plan_for`; None: planned here by that function),
    through the door: :func:`open_door` → :func:`reserve` → :func:`train` (and :func:`store`) →
    :func:`commit` → :func:`publish`. Returns a :class:`RunOutcome`.

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
    door = open_door(ctx, name, prepared, plan)
    try:
        reserve(door)
        trained, train_s = train(door, progress)
        info, metrics = commit(door, trained, train_s)
        return publish(door, trained, info, metrics, progress)
    except BaseException as exc:
        door.child.end(ok=False)
        _release_unread(door, exc)
        raise


def open_door(ctx, name: str, prepared: dict, plan: RunPlan | None = None) -> Door:
    """The run's dataset registered (checked against the ledger's terms), the method's checks that
    need no private data, the training's child run: before anything is reserved."""
    cfg, part = ctx.cfg, ctx.part
    if plan is None:  # released sizes: what the run publishes and plans with (never the exact sizes)
        plan = plan_for(cfg, name, part.sizes)
    elif plan.method != name:  # a plan handed in is this method's, or nothing runs (review F2)
        raise ValueError(f"run of method {name!r} was handed the plan of {plan.method!r}; nothing was reserved")
    method = runner(cfg, name)
    opt_in = delta_opt_in(cfg, part.sizes.n_for_delta, plan.delta)
    ledger = ctx.paths.open_ledger()  # the state folder's file, or the team's ledger by URL
    charged = ensure_dataset(ledger, part, cfg.privacy.dataset_epsilon_cap, plan.delta)["fingerprint"]
    if charged != part.dataset_key:  # the flow tagged and planned the run against another dataset
        from privacy.ledger import LedgerError

        raise LedgerError(f"data source {part.dataset!r} is now charged to dataset fingerprint {charged[:12]}, not "
                          f"{part.dataset_key[:12]} that this run started with (another run registered a source "
                          "sharing its records meanwhile); nothing was reserved: run it again")
    method.preflight(cfg, prepared)  # before the reservation (the flow ran all of them already: cached)
    child = recording.open_training(ctx, name, plan.guarantee, opt_in)
    return Door(ctx, name, method, plan, prepared, f"{ctx.flow_run_id}:{name}", ledger, child, opt_in)


def reserve(door: Door) -> None:
    """Before any private row is read: reserve the plan's worst case (dp), or record the use as
    what it is (ldp, none); a retry whose output is stored finds it here."""
    ctx, plan, name, ledger = door.ctx, door.plan, door.name, door.ledger
    if not plan.reads_private:
        return
    part = ctx.part
    if plan.guarantee == "ldp":
        ledger.record_ldp(part.dataset_key, door.run_key, f"{name}: local d_X privacy, no (ε, δ) claim")
        return
    if plan.guarantee != "dp":
        ledger.record_nonprivate(part.dataset_key, door.run_key, f"{name}: {plan.note or 'no formal guarantee'}")
        return
    cfg, delta = ctx.cfg, plan.delta
    planned_epsilon(cfg, name, plan, delta)
    door.stored = stored_release(ledger, door.run_key, ctx.private_run_dir, name)
    note = f" (δ={delta:g} ≥ 1/n by privacy.allow_delta_at_least_one_over_n)" if door.opt_in else ""
    if cfg.data.group_size:
        note += (f" (record-level, charged per {cfg.data.person_field} by group privacy for "
                 f"≤ {cfg.data.group_size} records, {plan.params.get('privacy.group_accounting', 'group event')})")
    try:
        door.reservation = ledger.reserve(part.dataset_key, door.run_key, plan.event,
                                          description=f"{name} flow run {ctx.flow_run_id}{note}",
                                          allow_delta_at_least_one_over_n=door.opt_in)
    except BudgetExceededError as exc:  # say what does fit, for this config
        # spent above the cap (a lowered cap, or ε held from before a δ change): nothing fits
        largest = None if exc.spent > exc.cap else largest_fitting_target_epsilon(
            cfg, part.sizes, delta, ledger.counted_events(part.dataset_key), exc.cap)
        raise exc.with_hint(fitting_hint(largest), largest) from None


def train(door: Door, progress=None) -> tuple[Trained, float]:
    """The method's training on the private rows (the ONLY step that reads them), or on a retry
    the stored DP output (no private read, no training). Returns (trained, seconds)."""
    ctx, cfg, plan, name = door.ctx, door.ctx.cfg, door.plan, door.name
    door.mctx = MethodContext(cfg, ctx.paths, door.prepared, randomness.for_config(cfg), cfg.seed,
                              ctx.output_dir if plan.guarantee in PUBLISHED else ctx.private_run_dir,
                              ctx.part.dataset_key, private_dir=ctx.private_run_dir)
    if door.stored is not None:  # a retry: the stored DP output, no private read, no training
        return door.stored, 0.0
    if door.reservation is not None:
        _test_pause("reserved")
        # one attempt of a run reads, ever: the check and the mark are one transaction. An earlier
        # or concurrent attempt that claimed the read may have shown some of its mechanism's outputs
        # (progress of DP-OPT's queries), which the reservation covers; a second run of the
        # mechanism would need a second charge: refused, the reservation stays spent
        try:
            door.ledger.claim_read(door.run_key)  # from here on the reservation stays spent, whatever happens
        except ReadClaimedError as exc:
            raise ReleaseError(str(exc)) from None
    door.read_begun = plan.reads_private
    rows = (read_private_rows(ctx.part, door.method.uses_validation) if plan.reads_private
            else PrivateRows([], []))
    if door.reservation is not None:
        _test_pause("training")
    started = time.perf_counter()
    trained = door.method.train(door.mctx, plan, rows, progress=progress(name) if progress else None)
    del rows
    # the published training time stops here: the comparison below takes time in proportion to the
    # exact holdout (its rows and their lengths), a private statistic
    train_s = time.perf_counter() - started
    if plan.no_prompt is not None:  # the released comparison with no prompt: stored with the output
        from . import no_prompt

        trained.metrics.update(no_prompt.release(door.mctx, plan, door.method, trained.prompt, ctx.part,
                                                 ctx.part.sizes.n_holdout))
    if door.dp:
        trained = store(door, trained)
    return trained, train_s


def store(door: Door, trained: Trained) -> Trained:
    """A dp training's output stored with its charged event BEFORE the commit (the run's
    mechanism: the sizes release and the method's; per person by group privacy where the plan
    says so). When another attempt of this run stored first, that one is the run's output."""
    if trained.event is None:
        raise RuntimeError(f"{door.name}: a dp plan's training returned no privacy event")
    event, record_event = door.plan.charged(trained.event)
    trained.event = event
    if record_event is not None:  # charged per person (group privacy); the per-record event kept beside it
        trained.record_event = record_event
    if store_release(door.ctx.private_run_dir, door.name, door.run_key, trained):
        return trained
    # another attempt of this run, alive at the same time, stored its DP output first: that one
    # is the run's output; this attempt's is dropped, never published
    door.stored = stored_release(door.ledger, door.run_key, door.ctx.private_run_dir, door.name)
    return door.stored


def commit(door: Door, trained: Trained, train_s: float) -> tuple[dict, dict]:
    """The ledger's commit of what a dp run spent (≤ its reservation), the training's private
    history kept under private/, its audit statistics recorded as a non-private use. Returns the
    outcome's fields so far and the child run's metrics."""
    plan, name, ledger, delta = door.plan, door.name, door.ledger, door.plan.delta
    info: dict = {"method": name, "guarantee": plan.guarantee, "private": door.dp,
                  "params": thawed(plan.params), "steps": trained.steps, "compute": {"train": train_s},
                  "prompt_path": None, "source_prompt_path": None, "spend": None, "event": None,
                  "republished": door.stored is not None}
    metrics = dict(trained.metrics)
    if door.dp:
        if trained.event is None:
            raise RuntimeError(f"{name}: a dp plan's training returned no privacy event")
        ledger.commit(door.run_key, trained.event)  # refuses (after recording it) a spend above the reservation
        _test_pause("committed")
        spend = acct.spend(trained.event, delta)
        info.update({"spend": spend.to_dict(), "event": ev.event_to_dict(trained.event),
                     "reserved_new": door.reservation.new if door.reservation is not None else None})
        metrics.update({"privacy.epsilon": spend.epsilon, "privacy.delta": delta,
                        "privacy.epsilon_rdp": spend.epsilon_rdp})
        if trained.record_event is not None:  # privacy.epsilon is per person; the mechanism's per-record ε beside it
            per_record = acct.spend(trained.record_event, delta).epsilon
            info["spend"]["epsilon_per_record"] = per_record
            metrics["privacy.epsilon_per_record"] = per_record
    _write_private_history(door.ctx.private_run_dir, name, trained.history)
    if trained.audit_metrics:
        ledger.record_nonprivate(door.ctx.part.dataset_key, f"{door.run_key}:audit-statistics",
                                 f"{name}: audit statistics computed on private data (not DP): "
                                 + ", ".join(sorted(trained.audit_metrics)))
        metrics.update(trained.audit_metrics)
        info["audit_metrics"] = trained.audit_metrics
    info["train_metrics"] = dict(metrics)
    return info, metrics


def publish(door: Door, trained: Trained, info: dict, metrics: dict, progress=None) -> RunOutcome:
    """The training's record (its child run; a choice among settings on the parent), then its
    output post-processed (public data only) and written under the publish rule."""
    from .no_prompt import FALLBACK, decide

    choice = chosen(door, trained)
    recording.record_choice(door.ctx, choice.params, choice.tags)
    info["params"] = {**info["params"], **choice.params}
    decision = decide(door.ctx.cfg, metrics)  # the released comparison with no prompt (post-processing)
    metrics.update(decision)
    info["train_metrics"] = {**info["train_metrics"], **decision}
    recording.record_training(door.child, info["params"], metrics, door.opt_in)
    if trained.prompt is not None and not decision.get(FALLBACK):  # a prompt that lost to no prompt: none
        write_outputs(door, trained, info, choice, progress)
    door.child.end()
    info["published"] = door.plan.guarantee in PUBLISHED and info["prompt_path"] is not None
    return RunOutcome(**info)


def chosen(door: Door, trained: Trained) -> Choice:
    """What the method chose among settings (a selection: its winner), or nothing to say."""
    choose = getattr(door.method, "chosen", None)
    return Choice() if choose is None else choose(door.mctx, door.plan, trained.metrics)


def write_outputs(door: Door, trained: Trained, info: dict, choice: Choice, progress=None) -> None:
    """Post-process the output (public data only) and write it: ``outputs/`` and MLflow under the
    publish rule (a PEFT adapter and a registered model version with it), else ``private/``."""
    ctx, cfg, plan, name, method = door.ctx, door.ctx.cfg, door.plan, door.name, door.method
    published = plan.guarantee in PUBLISHED  # the publish rule
    directory = ctx.output_dir if published else ctx.private_run_dir
    meta = {"method": name, "privacy.guarantee": plan.guarantee, "model": method.published_model(cfg, door.prepared)}
    if info["spend"] is not None:
        meta.update({"privacy.epsilon": f"{info['spend']['epsilon']:.6f}", "privacy.delta": f"{plan.delta:.3g}",
                     "dataset.fingerprint": ctx.part.published_key})
    meta.update({k: str(v) for k, v in thawed(plan.params).items()})
    meta.update(choice.meta)
    started = time.perf_counter()
    post = method.post_process(choice.mctx or door.mctx, choice.plan or plan, trained.prompt,
                               progress=progress(f"{name}:post") if progress else None)
    if post.prompt is not trained.prompt:
        info["compute"]["post_process"] = time.perf_counter() - started
        info["source_prompt_path"] = str(save_prompt_file(directory, f"{name}_source", trained.prompt, {
            **meta, "model": method.source_model(cfg, door.prepared), "stage": "train"}))
    info["prompt_path"] = str(save_prompt_file(directory, name, post.prompt, meta))
    if info["source_prompt_path"] is None:
        info["source_prompt_path"] = info["prompt_path"]
    if published:
        _test_pause("publishing")
        door.child.log_file(info["prompt_path"], "prompt")
        from .publish import publish_usable  # PEFT adapter + registered model version

        tags = publish_usable(ctx, door.child, name, plan.guarantee, info["prompt_path"], info["spend"])
        if str(tags.get("registry.model", "")).startswith("models:/"):
            info["registered_model"] = tags["registry.model"]
    if post.child:
        recording.log_post_child(ctx, post.child, plan.guarantee)


def _release_unread(door: Door, exc: BaseException) -> None:
    """A failed pass: a reservation nothing was read under is released (recorded as such); the
    error says what the run used."""
    if door.reservation is None:
        return
    if not door.read_begun and door.stored is None:
        try:  # no private record was read: the reservation costs nothing (recorded as released)
            door.ledger.release(door.run_key, f"{type(exc).__name__} before any private record was read")
        except ValueError:
            pass  # an earlier attempt of this run began reading: it stays spent
    try:
        exc.add_note(f"budget: {budget_statement(door.ledger.entry(door.run_key))}")
    except Exception:  # noqa: BLE001 - the statement must never hide the error itself
        pass


def shadow_prompt(config: dict, method_name: str, prepared: dict, state_dir: str, rows: PrivateRows,
                  shadow_seed: int, sizes=None):
    """An audit shadow: the audited method's own ``train`` + ``post_process`` on ``rows`` (pool
    rows), no ledger, no tracking (shadows are private working data). Returns (prompt, steps).

    Calibrated as the audited run was (:func:`tasks.run_plan.shadow_plan` on its released
    ``sizes``, the partition's): the run's noise and sampling rate, not a fresh calibration to
    the whole target on the pool."""
    from .config import parse_config
    from .state import state_paths

    cfg = parse_config(config)  # its seed stays: models and splits are the audited run's
    method = get_method(method_name)
    index = rows.unit_index()
    plan = shadow_plan(cfg, method_name, sizes, len(rows) if index is None else index[1])
    mctx = MethodContext(cfg, state_paths(state_dir), prepared, randomness.for_shadow(cfg, shadow_seed), shadow_seed)
    trained = method.train(mctx, plan, rows)
    post = method.post_process(mctx, plan, trained.prompt)
    return post.prompt, trained.steps + post.steps
