"""The one privacy lifecycle every method runs through:

    plan (pure, once: ``tasks.run_plan.plan_for``) → register dataset / check δ → reserve the
    plan's worst case (dp) or record the use (ldp / none) → run each of the plan's releases in
    order (the method's training is the only read of private training rows) → store the DP output
    → commit what was spent (≤ the reservation) → post-process (public data only) → publish.

:func:`run_method` is that door, one small function a step (:func:`open_door`, :func:`reserve`,
:func:`run_releases`, :func:`store`, :func:`commit`, :func:`publish`); each kind of release is a
class in ``tasks/releases.py`` (a new release is a new kind there, not a branch here); what the
door records on MLflow is in ``tasks/recording.py``, the usable forms of a published output in
``tasks/publish.py``. A selection of a method's settings is a release kind and a method wrapper
(``tasks.selected.selected``): the door never asks whether a run selects.

Everything that needs no private data is checked first (``tasks.preflight``), the dataset a run
is charged to and its terms in ``tasks.charge``, the stored release a retry republishes in
``tasks.release_store``. A run that fails after its reservation but before its first private read
releases the reservation (recorded as such); from the first read on (``Ledger.claim_read``), the
reservation stays spent. A run killed outright (SIGKILL, out of memory) releases nothing: its
reservation stays counted until an operator releases it (``privprompt budget release``), which the
ledger refuses once the run was marked read (tests/claims/test_crash_stages.py).

Publish rule, in this one place: the output of a ``dp`` (or ``ldp``) run goes to ``outputs/`` and
MLflow; every other output, and every exact statistic of private data (training losses), stays
under ``private/``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from privacy import accountant as acct
from privacy import events as ev
from privacy.ledger import BudgetExceededError, Ledger, ReadClaimedError
from privacy.plan import RunPlan, thawed

from . import randomness, recording
from .charge import budget_statement, charge_run_dataset, refusals_to_operator
from .data import Partition, read_partition_split, read_partition_units
from .methods import MethodContext, PrivateRows
from .methods.base import Choice, Trained
from .outcome import RunOutcome
from .prompts import save_prompt_file
from .releases import own_release, releases_of
from .release_store import ReleaseError, store_release, stored_release, write_private_history
from .run_plan import delta_opt_in, fitting_hint, largest_fitting_target_epsilon, plan_for, planned_epsilon, runner
from .state import operator_note


# The publish rule: outputs of a formal guarantee — central DP, or local d_X privacy (the model
# only ever saw privatized inputs) — go to outputs/ and MLflow; everything else stays in private/.
PUBLISHED = ("dp", "ldp")


def read_private_rows(part: Partition, validation: bool = False) -> PrivateRows:
    texts, labels = read_partition_split(part.train_path)
    rows = PrivateRows(texts, labels, units=read_partition_units(part.train_path))
    if validation:
        rows.validation = PrivateRows(*read_partition_split(part.holdout_path),
                                      units=read_partition_units(part.holdout_path))
    return rows


# The door's stage points, in order: reserved (after the reservation, before the first private
# read), training (after the read claim and the private read, before training), committed (after the
# ledger's commit, before post-processing), publishing (the output written to outputs/, not yet logged
# to MLflow). A hook added to STAGE_HOOKS is called with the stage's name at each (the crash tests kill
# a run there); none is registered in a run.
STAGES = ("reserved", "training", "committed", "publishing")
STAGE_HOOKS: list[Callable[[str], None]] = []


def stage(name: str) -> None:
    for hook in STAGE_HOOKS:
        hook(name)


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
    releases: tuple = ()
    train_s: float = 0.0

    @property
    def dp(self) -> bool:
        return self.plan.guarantee == "dp"

    def stage(self, name: str) -> None:  # the door's stage point ``name`` (STAGES) for the release kinds
        stage(name)

    def read_rows(self, validation: bool) -> PrivateRows:  # the training rows (and the holdout)
        return read_private_rows(self.ctx.part, validation)

    def claim_read(self) -> None:
        """One attempt of a run reads, ever: the check and the mark are one ledger transaction. An
        earlier or concurrent attempt that claimed the read may have shown some of its mechanism's
        outputs (progress of DP-OPT's queries), which the reservation covers; a second run of the
        mechanism would need a second charge: refused, the reservation stays spent."""
        try:
            self.ledger.claim_read(self.run_key)
        except ReadClaimedError as exc:
            raise ReleaseError(str(exc)) from None


def run_method(ctx, name: str, prepared: dict, progress=None, plan: RunPlan | None = None) -> RunOutcome:
    """Run method ``name`` through the lifecycle inside flow run ``ctx`` under its ``plan`` (the
    flow's, computed once by :func:`tasks.run_plan.plan_for`; None: planned here by that function),
    through the door: :func:`open_door` → :func:`reserve` → :func:`run_releases` (and :func:`store`) →
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
        # a refusal at the reservation names the dataset the source is charged to, and its spend
        with refusals_to_operator(ctx.paths, charged_elsewhere=ctx.part.dataset_key != ctx.part.published_key):
            reserve(door)
        trained = run_releases(door, progress)
        info, metrics = commit(door, trained)
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
    elif plan.method != name:  # a plan handed in is this method's, or nothing runs
        raise ValueError(f"run of method {name!r} was handed the plan of {plan.method!r}; nothing was reserved")
    method = runner(cfg, name)
    opt_in = delta_opt_in(cfg, part.sizes.n_for_delta, plan.delta)
    ledger = ctx.paths.open_ledger()  # the state folder's file, or the team's ledger by URL
    charge_run_dataset(ctx, ledger, plan.delta)  # the dataset the run is charged to, under its terms
    if name not in ctx.preflighted:  # before the reservation; the flow checked its run methods already
        method.mechanism.preflight(cfg, prepared)
    releases = releases_of(plan, part.sizes)  # an unknown kind, or a plan of other sizes: refused here
    child = recording.open_training(ctx, name, plan.guarantee, opt_in)
    return Door(ctx, name, method, plan, prepared, f"{ctx.flow_run_id}:{name}", ledger, child, opt_in,
                releases=releases)


def reserve(door: Door) -> None:
    """Before any private row is read: reserve the plan's worst case (dp), or record the use as
    what it is (ldp, none); a retry whose output is stored finds it here."""
    ctx, plan, name, ledger = door.ctx, door.plan, door.name, door.ledger
    if not plan.reads_private:
        return
    part = ctx.part
    if plan.guarantee != "dp":  # a use recorded as what it is: local d_X privacy, or no formal guarantee
        ldp = plan.guarantee == "ldp"
        (ledger.record_ldp if ldp else ledger.record_nonprivate)(part.dataset_key, door.run_key, f"{name}: " + (
            "local d_X privacy, no (ε, δ) claim" if ldp else plan.note or "no formal guarantee"))
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


def run_releases(door: Door, progress=None) -> Trained:
    """The plan's releases in order (``tasks.releases``): the method's training on the private rows
    (the ONLY step that reads them) and what the plan releases beside it, then a dp output stored;
    on a retry the stored DP output instead (no private read, no training)."""
    ctx, cfg, plan = door.ctx, door.ctx.cfg, door.plan
    door.mctx = MethodContext(cfg, ctx.paths, door.prepared, randomness.for_config(cfg), cfg.seed,
                              ctx.output_dir if plan.guarantee in PUBLISHED else ctx.private_run_dir,
                              ctx.part.dataset_key, private_dir=ctx.private_run_dir)
    if door.stored is not None:  # a retry: the stored DP output, no private read, no training
        return door.stored
    trained = None
    for release in door.releases:
        trained = release.run(door, trained, progress)
    return store(door, trained) if door.dp else trained


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


def commit(door: Door, trained: Trained) -> tuple[dict, dict]:
    """The ledger's commit of what a dp run spent (≤ its reservation), the training's private
    history kept under private/, its audit statistics recorded as a non-private use. Returns the
    outcome's fields so far and the child run's metrics."""
    plan, name, ledger, delta = door.plan, door.name, door.ledger, door.plan.delta
    info: dict = {"method": name, "guarantee": plan.guarantee, "private": door.dp,
                  "params": thawed(plan.params), "steps": trained.steps, "compute": {"train": door.train_s},
                  "prompt_path": None, "source_prompt_path": None, "spend": None, "event": None,
                  "republished": door.stored is not None}
    metrics = dict(trained.metrics)
    if door.dp:
        if trained.event is None:
            raise RuntimeError(f"{name}: a dp plan's training returned no privacy event")
        ledger.commit(door.run_key, trained.event)  # refuses (after recording it) a spend above the reservation
        stage("committed")
        spend = acct.spend(trained.event, delta)
        info.update({"spend": spend.to_dict(), "event": ev.event_to_dict(trained.event),
                     "reserved_new": door.reservation.new if door.reservation is not None else None})
        metrics.update({"privacy.epsilon": spend.epsilon, "privacy.delta": delta,
                        "privacy.epsilon_rdp": spend.epsilon_rdp})
        if trained.record_event is not None:  # privacy.epsilon is per person; the mechanism's per-record ε beside it
            per_record = acct.spend(trained.record_event, delta).epsilon
            info["spend"]["epsilon_per_record"] = per_record
            metrics["privacy.epsilon_per_record"] = per_record
    write_private_history(door.ctx.private_run_dir, name, trained.history)
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

    choice = own_release(door.releases).choice(door, trained)
    recording.record_choice(door.ctx, choice.params, choice.tags)
    info["params"] = {**info["params"], **choice.params}
    decision = decide(door.ctx.cfg, metrics)  # the released comparison with no prompt (post-processing)
    metrics.update(decision)
    info["train_metrics"] = {**info["train_metrics"], **decision}
    recording.record_training(door.child, info["params"], metrics, door.opt_in)
    if trained.prompt is not None and not decision.get(FALLBACK):  # a prompt that lost to no prompt: none
        write_outputs(door, trained, info, choice, progress)
    elif door.plan.guarantee in PUBLISHED:  # no prompt won: the model without one is the usable result
        write_no_prompt(door, info)
    door.child.end()
    info["published"] = door.plan.guarantee in PUBLISHED and info["prompt_path"] is not None
    return RunOutcome(**info)


def write_outputs(door: Door, trained: Trained, info: dict, choice: Choice, progress=None) -> None:
    """Post-process the output (public data only) and write it: ``outputs/`` and MLflow under the
    publish rule (a PEFT adapter and a registered model version with it), else ``private/``."""
    ctx, cfg, plan, name, method = door.ctx, door.ctx.cfg, door.plan, door.name, door.method
    published = plan.guarantee in PUBLISHED  # the publish rule
    directory = ctx.output_dir if published else ctx.private_run_dir
    meta = {"method": name, "privacy.guarantee": plan.guarantee, "model": method.extras.published_model(cfg, door.prepared)}
    if info["spend"] is not None:
        meta.update({"privacy.epsilon": f"{info['spend']['epsilon']:.6f}", "privacy.delta": f"{plan.delta:.3g}",
                     "dataset.fingerprint": ctx.part.published_key})
    meta.update({k: str(v) for k, v in thawed(plan.params).items()})
    meta.update(choice.meta)
    started = time.perf_counter()
    post = method.mechanism.post_process(choice.mctx, choice.plan, trained.prompt,
                               progress=progress(f"{name}:post") if progress else None)
    if post.prompt is not trained.prompt:
        info["compute"]["post_process"] = time.perf_counter() - started
        info["source_prompt_path"] = str(save_prompt_file(directory, f"{name}_source", trained.prompt, {
            **meta, "model": method.extras.source_model(cfg, door.prepared), "stage": "train"}))
    info["prompt_path"] = str(save_prompt_file(directory, name, post.prompt, meta))
    if info["source_prompt_path"] is None:
        info["source_prompt_path"] = info["prompt_path"]
    if published:
        stage("publishing")
        door.child.log_file(info["prompt_path"], "prompt")
        from .publish import publish_usable  # PEFT adapter + registered model version

        tags = publish_usable(ctx, door.child, name, plan.guarantee, info["prompt_path"], info["spend"])
        if str(tags.get("registry.model", "")).startswith("models:/"):
            info["registered_model"] = tags["registry.model"]
    if post.child:
        recording.log_post_child(ctx, post.child, plan.guarantee)


def write_no_prompt(door: Door, info: dict) -> None:
    """No prompt won (the released comparison fell back, or a selection chose none): the result is
    the model without a prompt — its template and label words, an empty text prompt — registered as
    a version of the method's model, tagged ``prompt.source = none`` with the run's ε, so
    ``predict``, ``serve`` and ``promote`` work on it and say what it is. Nothing trained is in it.
    ``info["prompt_path"]`` stays None: the run published no prompt."""
    from models.prompts.text import TextPrompt

    from .prompts import save_prompt_file
    from .publish import publish_usable

    ctx, plan, name = door.ctx, door.plan, door.name
    meta = {"method": name, "privacy.guarantee": plan.guarantee, "prompt.source": "none",
            "model": door.method.extras.published_model(ctx.cfg, door.prepared)}
    path = save_prompt_file(ctx.output_dir, f"{name}_no_prompt", TextPrompt(""), meta)
    tags = publish_usable(ctx, door.child, name, plan.guarantee, str(path), info["spend"], source="none")
    if str(tags.get("registry.model", "")).startswith("models:/"):
        info["registered_model"] = tags["registry.model"]


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
        entry = door.ledger.entry(door.run_key)
        exc.add_note(f"budget: {budget_statement(entry, named=False)}")  # the note reaches Prefect's log
        operator_note(door.ctx.paths, f"run {door.run_key}: {budget_statement(entry)}")
    except Exception:  # noqa: BLE001 - the statement must never hide the error itself
        pass
