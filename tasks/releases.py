"""The kinds of release a run is made of, each a class the door (``tasks/lifecycle.py``) runs in
the plan's order: ``for release in releases_of(plan): trained = release.run(door, trained)``.

The plan (``privacy.plan.RunPlan``) describes a run as a tuple of :class:`privacy.plan.Release`
values, as dp-accounting describes a mechanism by its events; :func:`releases_of` gives each value
the kind that runs it:

* ``sizes`` (:class:`SizesRelease`): the partition's released sizes — drawn when the partition was
  made (``tasks.data``), before the door opened; the door checks that the plan it runs was
  calibrated on exactly those sizes;
* the method's own release — ``method`` (:class:`OwnRelease`: the method's training, the only step
  that reads the private training rows) or ``selection`` (:class:`SelectionRelease`: every trial and
  the noisy holdout scores, one mechanism, and the winner it publishes);
* ``no_prompt`` (:class:`NoPromptRelease`): the released comparison of the output with no prompt on
  the holdout (``tasks/no_prompt.py``), stored with the output before the commit.

A plan without a dp claim has no releases; its run is the method's own step alone (its output stays
under ``private/`` unless the guarantee is ldp). Each kind returns what the run has trained and
released so far (a :class:`~tasks.methods.base.Trained`); what the ledger is charged for the
realised run is the plan's composition of the same releases (``RunPlan.charged``). A new release is
a new kind here, never a branch in the door.
"""

from __future__ import annotations

import time
from typing import Any

from privacy.plan import NO_PROMPT, Release

from .methods.base import Choice, PrivateRows, Trained

Door = Any  # tasks.lifecycle.Door: the one pass of a run through the door (not imported: the door imports this)


class SizesRelease:
    """The partition's released sizes: drawn before the door opened (the partition drew them with
    the run's secret randomness), so running it in the door does nothing. Built by
    :func:`releases_of` only for a plan calibrated on this run's released sizes (their noise and
    the ñ the method planned with): a plan handed in from another partition would state the wrong
    ε, and is refused before the reservation."""

    def __init__(self, release: Release, plan, sizes):
        if sizes.event != release.event:
            raise ValueError(f"run of {plan.method!r}: its plan was made for other released sizes than this run's "
                             "partition; nothing was reserved")
        if plan.n_train != sizes.n_train:
            raise ValueError(f"run of {plan.method!r}: its plan is for n_train = {plan.n_train}, not the run's released "
                             "training size (a method's plan must keep the n_train it was given); nothing was reserved")
        self.release = release

    def run(self, door: Door, trained: Trained | None, progress=None) -> Trained | None:
        return trained


class OwnRelease:
    """The method's own release: its training on the private rows — the only step that reads them —
    after the read is claimed in the ledger (one attempt of a run reads, ever). Returns what the
    method trained; its training time goes to ``door.train_s``. ``release`` is None for a plan
    without a dp claim (nothing is released, the method still runs)."""

    def __init__(self, release: Release | None = None, plan=None, sizes=None):
        self.release = release

    def run(self, door: Door, trained: Trained | None, progress=None) -> Trained:
        plan = door.plan
        if door.reservation is not None:
            door.stage("reserved")
            door.claim_read()  # from here on the reservation stays spent, whatever happens
        door.read_begun = plan.reads_private
        rows = door.read_rows(door.method.traits.uses_validation) if plan.reads_private else PrivateRows([], [])
        if door.reservation is not None:
            door.stage("training")
        started = time.perf_counter()
        out = door.method.mechanism.train(door.mctx, plan, rows, progress=progress(door.name) if progress else None)
        del rows
        # the published training time stops here: what follows (the comparison with no prompt) takes
        # time in proportion to the exact holdout (its rows and their lengths), a private statistic
        door.train_s = time.perf_counter() - started
        return out

    def choice(self, door: Door, trained: Trained) -> Choice:
        """What the run publishes of the method's own choice (``Method.chosen``), post-processed under
        the run's own context and plan."""
        made = door.method.mechanism.chosen(door.mctx, door.plan, trained.metrics)
        return Choice(made.params, made.tags, made.meta, made.mctx or door.mctx, made.plan or door.plan)


class SelectionRelease(OwnRelease):
    """A private selection of the method's settings (``tasks.selected.Selection`` trains it): every
    trial and the noisy holdout scores, one mechanism; the winner is published by name from released
    numbers only, its output post-processed under its own settings."""

    def choice(self, door: Door, trained: Trained) -> Choice:
        from . import selection

        mctx, plan, metrics = door.mctx, door.plan, trained.metrics
        won = selection.winner_of(plan, metrics)
        winner = "none" if won is None else (selection.NO_PROMPT if won[2] else won[0])
        params = {"selection.winner": winner}
        best = selection.best_trial_name(plan, metrics)
        if best is not None:  # no prompt published instead of the best trial (released numbers only)
            params["selection.best_trial"] = best
        tags = {}
        if not selection.every_candidate(mctx.cfg.selection):  # the opt-in check_selection_config asked for
            tags["selection.timing_channel"] = ("the run's duration grows with the secret number of trials K and "
                                                "shows in MLflow's and Prefect's timestamps; its ε assumes K secret "
                                                "(selection.accept_timing_channel: true)")
        post_mctx, post_plan = selection.winner_context(door.method.mechanism.method, mctx, plan, metrics)
        return Choice(params, tags, {"selection.winner": winner}, post_mctx, post_plan)


class NoPromptRelease:
    """The comparison of the trained output with no prompt on the private holdout: one Gaussian
    number (``tasks.no_prompt.release``), added to the output's metrics so it is stored, committed
    and republished with it."""

    def __init__(self, release: Release, plan=None, sizes=None):
        self.release = release

    def run(self, door: Door, trained: Trained | None, progress=None) -> Trained:
        from . import no_prompt

        if trained is None:
            raise RuntimeError(f"{door.name}: the comparison with no prompt runs after the method's release")
        trained.metrics.update(no_prompt.release(door.mctx, door.plan, door.method, trained.prompt, door.ctx.part,
                                                 door.ctx.part.sizes.n_holdout))
        return trained


KINDS = {"sizes": SizesRelease, "method": OwnRelease, "selection": SelectionRelease, NO_PROMPT: NoPromptRelease}


def releases_of(plan, sizes) -> tuple:
    """The kinds that run ``plan``'s releases, in its order, for a run on the released ``sizes``; a
    plan without releases (no dp claim) is the method's own step alone. A release of a kind not
    known here, or a plan with no own release, is refused before anything is reserved."""
    if not plan.releases:
        return (OwnRelease(),)
    unknown = [r.name for r in plan.releases if r.name not in KINDS]
    if unknown:
        raise ValueError(f"{plan.method}: its plan has a release of unknown kind {', '.join(unknown)}; nothing was "
                         "reserved")
    releases = tuple(KINDS[r.name](r, plan, sizes) for r in plan.releases)
    own_release(releases)
    return releases


def own_release(releases: tuple) -> OwnRelease:
    """The method's own release among ``releases`` (there is exactly one)."""
    own = [r for r in releases if isinstance(r, OwnRelease)]
    if len(own) != 1:
        raise ValueError(f"a run's plan has {len(own)} own releases of its method, not one; nothing was reserved")
    return own[0]
