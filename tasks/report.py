"""What a method flow reports on its parent run, the same for every method: the budget record
(``privacy/budget.json``), the privacy–utility plot and the method's tables."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from . import plots

if TYPE_CHECKING:
    from .outcome import RunOutcome



def prompt_record(published: RunOutcome, run_id: str | None = None) -> dict:
    """Where the method's prompt is and what it is, in names that say so (``budget.json``'s and the
    summary's ``published`` block): ``prompt_published`` — released (``outputs/`` and the parent
    run's ``prompt/`` artifact, ``artifact_uri``) or kept under ``private/`` (never published);
    ``formal_dp_guarantee`` — an (ε, δ)-DP output of the private training partition."""
    path = published.prompt_path
    released = bool(published.published) and path is not None
    return {"method": published.method, "prompt_path": path, "prompt_published": released,
            "guarantee": published.guarantee, "formal_dp_guarantee": published.guarantee == "dp",
            "artifact_uri": f"runs:/{run_id}/prompt/{Path(path).name}" if released and run_id else None}


def budget_record(cfg, part, paths, published: RunOutcome, plan_note: str, stages_extra: list[dict],
                  run_id: str | None = None) -> dict:
    """``privacy/budget.json``: the run's privacy statement (``dataset.fingerprint``: a keyed hash
    of the SOURCE's records, :attr:`Partition.published_key`; ``data.partition``: the keyed hash of
    this run's training partition), the published method's spend and its stages (what is accounted,
    what is post-processing or public-data only), and where its prompt is (:func:`prompt_record`).
    The ledger's state of the dataset the source is charged to (its total spend, what remains) is
    not published: which dataset that is, and so its totals, depends on whether a record also lies
    in another source; ``privprompt ledger`` shows it on the machine."""
    budget = {"dataset": cfg.data.name, "dataset.fingerprint": part.published_key, "data.partition": part.fingerprint,
              "privacy.guarantee": published.guarantee,
              "ledger": {"epsilon_cap": cfg.privacy.dataset_epsilon_cap,
                         "where": "the dataset's spend and what remains: privprompt ledger (not published)"},
              "published": prompt_record(published, run_id)}
    if published.guarantee == "dp":
        spend = published.spend
        budget.update({"accountant": spend["accountant"], "total": spend,
                       "stages": [{"stage": f"{published.method}: train", "event": published.event, **spend},
                                  *stages_extra]})
        if plan_note:
            budget["note"] = plan_note
    else:
        budget.update({"total": None, "stages": stages_extra,
                       "note": plan_note or f"{published.method} has no formal (ε, δ) guarantee: nothing was "
                                            "published but metrics, and its prompt stays under private/"})
    return budget


def log_privacy_utility(parent, points: list[dict], title: str, unit: str = "record") -> None:
    fig = plots.privacy_utility_plot(points, title, unit)
    parent.log_figure(fig, "plots/privacy_utility.png")
    plots.close(fig)


def runtime_table(runtime: dict) -> str:
    lines = ["| stage | seconds |", "|---|---:|"]
    lines += [f"| {k} | {v if isinstance(v, str) else f'{v:.1f}'} |" for k, v in runtime.items()]
    return "\n".join(lines) + "\n"
