"""How a run states its privacy where a user reads it: every ε with its unit and δ (and, where
known, the accountant), in one wording for the plan, the run summary, the ledger table, the report,
the MLflow run's description (``mlflow.note.content``) and the Prefect flow run's markdown artifact.

Only numbers that are already public in the run record go into these texts: the committed (ε, δ),
the unit's field NAME (never a value), the accountant's name, test accuracies on the public test
split and released (noisy, DP) scores. Never private text or an exact statistic of private data.
"""

from __future__ import annotations

from typing import Any


def unit_phrase(unit: str | None) -> str:
    """``per record`` or ``per person (customer_id)``: what one ε protects."""
    if not unit or unit == "record":
        return "per record"
    return f"per person ({unit})"


def recall_phrase(metrics: dict) -> str:
    """``neg 0.7368, pos 0.8704``: the run's ``test.recall.<label>`` metrics, by label."""
    return ", ".join(f"{k[len('test.recall.'):]} {v:.4f}" for k, v in sorted(metrics.items())
                     if k.startswith("test.recall."))


def epsilon_statement(epsilon: float, delta: float | None, unit: str | None, accountant: str | None = None) -> str:
    """``ε = 3.8964 per person (customer_id), δ = 1e-05 (accountant min_pld_rdp)``."""
    text = f"ε = {epsilon:.4f} {unit_phrase(unit)}"
    if delta is not None:
        text += f", δ = {delta:.3g}"
    if accountant:
        text += f" (accountant {accountant})"
    return text


def _fmt(value: Any) -> str:
    return "-" if value is None else (f"{value:.4f}" if isinstance(value, float) else str(value))


def run_markdown(summary: dict) -> str:
    """The run's privacy and result in a few markdown lines (the MLflow run's description and the
    Prefect flow run's artifact), from the flow's summary: its public metrics, unit, accountant,
    warnings and registered model. Exact private statistics are never in ``summary`` to begin with."""
    m = summary.get("metrics", {})
    method = summary.get("method", "?")
    lines = [f"## PrivPrompt run: {method} on {summary.get('dataset', '?')}", ""]
    if "privacy.epsilon" in m:
        lines.append("**Privacy:** " + epsilon_statement(m["privacy.epsilon"], m.get("privacy.delta"),
                                                         summary.get("unit"), summary.get("accountant")))
        if m.get("privacy.epsilon_per_record") is not None:
            lines.append(f"(record-level mechanism: ε = {m['privacy.epsilon_per_record']:.4f} per record; "
                         "the ledger charges the per-person ε above by group privacy)")
    elif summary.get("guarantee") == "ldp":
        lines.append("**Privacy:** local d_X privacy of the inputs (metric LDP; no (ε, δ) claim)")
    else:
        lines.append("**Privacy:** no formal guarantee (nothing but metrics published)")
    lines.append("")
    whose = " (no prompt's: none was published)" if m.get("no_prompt.fallback") else ""
    rows = [("test accuracy" + whose, m.get("test.accuracy"))]
    if "test.balanced_accuracy" in m:
        rows.append(("test balanced accuracy (mean recall per class)", m["test.balanced_accuracy"]))
        rows += [(f"test recall, {k[len('test.recall.'):]}", v) for k, v in sorted(m.items())
                 if k.startswith("test.recall.")]
    rows += [(f"test accuracy, {k[len('test.accuracy.'):]}", v) for k, v in sorted(m.items())
             if k.startswith("test.accuracy.")]
    if "selection.winner.holdout_score" in m:
        rows.append(("released holdout score (DP, noisy)", m["selection.winner.holdout_score"]))
    if "no_prompt.released_difference" in m:  # tasks/no_prompt.py: the released comparison with no prompt
        rows.append(("holdout records right with the prompt − without (DP, noisy)", m["no_prompt.released_difference"]))
        rows.append(("its noise σ", m.get("no_prompt.noise_sigma")))
        rows.append(("no prompt published instead (fallback)", "yes" if m.get("no_prompt.fallback") else "no"))
    if m.get("selection.failed_candidates") is not None:
        rows.append(("failed selection candidates (count)", int(m["selection.failed_candidates"])))
    lines += ["| | |", "|---|---:|"] + [f"| {k} | {_fmt(v)} |" for k, v in rows]
    if summary.get("registered_model"):
        lines += ["", f"**Registered model:** `{summary['registered_model']}`"]
    for warning in summary.get("warnings", []):
        lines += ["", f"**Warning:** {warning}"]
    return "\n".join(lines) + "\n"
