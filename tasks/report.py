"""What a method flow reports on its parent run, the same for every method: the budget record
(``privacy/budget.json``), the privacy–utility plot and the method's tables."""

from __future__ import annotations

from privacy.ledger import Ledger

from . import plots

LEDGER_KEYS = ("epsilon_cap", "delta", "spent_epsilon", "remaining_epsilon", "nonprivate_uses", "ldp_uses",
               "ldp_releases", "ldp_eta_bound")


def budget_record(cfg, part, paths, published: dict, plan_note: str, stages_extra: list[dict]) -> dict:
    """``privacy/budget.json``: the dataset's ledger state, the published method's spend and its
    stages (what is accounted, what is post-processing or public-data only)."""
    row = Ledger(paths.ledger).dataset(part.dataset_key)
    budget = {"dataset": cfg.data.name, "dataset.fingerprint": part.dataset_key,
              "privacy.guarantee": published["guarantee"],
              "ledger": {k: row[k] for k in LEDGER_KEYS if k in row},
              "published": {k: published.get(k) for k in ("method", "prompt_path", "private", "published")}}
    if published["guarantee"] == "dp":
        spend = published["spend"]
        budget.update({"accountant": spend["accountant"], "total": spend,
                       "stages": [{"stage": f"{published['method']}: train", "event": published["event"], **spend},
                                  *stages_extra]})
        if plan_note:
            budget["note"] = plan_note
    else:
        budget.update({"total": None, "stages": stages_extra,
                       "note": plan_note or f"{published['method']} has no formal (ε, δ) guarantee: nothing was "
                                            "published but metrics, and its prompt stays under private/"})
    return budget


def log_privacy_utility(parent, points: list[dict], title: str) -> None:
    fig = plots.privacy_utility_plot(points, title)
    parent.log_figure(fig, "plots/privacy_utility.png")
    plots.close(fig)


def runtime_table(runtime: dict) -> str:
    lines = ["| stage | seconds |", "|---|---:|"]
    lines += [f"| {k} | {v if isinstance(v, str) else f'{v:.1f}'} |" for k, v in runtime.items()]
    return "\n".join(lines) + "\n"
