"""The model card of a registered version: its description in the MLflow registry
(``MlflowClient.update_model_version``), written when the version is registered and again by
``privprompt promote`` with the gates' results.

Only what the run record already publishes goes in: the version's privacy tags (method, ε, δ,
accountant, unit, dataset fingerprint), what its prompt is (``prompt.source``), the run's test
accuracy, balanced accuracy and per-class recall beside no prompt's, the warnings the run printed,
the records-per-person cap, its lineage, the gates' tags, and the NAMES of the published statistics
that the guarantee does not cover (docs/privacy-claims.md, "What is published beside ε, and is not
covered by it"). No value computed on private data beyond the run record's is added here.
"""

from __future__ import annotations

from .statement import recall_phrase, unit_phrase

# metric-name prefixes of published statistics that ε does not cover (docs/privacy-claims.md)
NOT_COVERED = (
    ("test.", "accuracy, balanced accuracy and per-class recall on the test split: exact statistics of that split "
              "(evaluation data, not the training data ε protects); the test split's size shows through them"),
    ("mia.", "membership-inference statistics: exact functions of the audit pool's rows (audit statistics, "
             "recorded in the ledger as a non-private use)"),
    ("audit.", "audit statistics (canary ε lower bound, leakage reports): exact, computed without noise"),
    ("flatness.", "flatness of the prefix: test loss on at most 256 test examples"),
    ("runtime.", "wall-clock times: a side channel that depends weakly on the data"),
)
ALWAYS = (
    "the backbone's own pre-training data and any public data the method reads (distillation, transfer, "
    "retargeting): they are not the private source",
    "label set and text lengths where the method does not privatize them (a local-DP method's inputs)",
)


def _gates(tags: dict) -> list[str]:
    from .release_gates import GATES

    rows = ["| gate | result | why |", "|---|---|---|"]
    for name in GATES:
        status = tags.get(f"gate.{name}")
        if status is None:
            rows.append(f"| {name} | not checked | `privprompt promote` runs it |")
        else:
            rows.append(f"| {name} | {status} | {tags.get(f'gate.{name}.reason', '').replace('|', '/')} |")
    return rows


def _not_covered(metric_names) -> list[str]:
    lines = []
    for prefix, what in NOT_COVERED:
        names = sorted(k for k in metric_names if k.startswith(prefix))
        if names:
            shown = ", ".join(f"`{n}`" for n in names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
            lines.append(f"- {shown}: {what}")
    return lines + [f"- {line}" for line in ALWAYS]


def _quality(metrics: dict, no_prompt: bool) -> list[str]:
    """The run's test numbers (exact, on evaluation data) beside no prompt's."""
    if "test.accuracy" not in metrics:
        return []
    whose = " (no prompt's: this version is the model without one)" if no_prompt else ""
    lines = ["", "### Quality on the test split", "", f"- **test accuracy:** {metrics['test.accuracy']:.4f}{whose}"]
    if "test.balanced_accuracy" in metrics:
        lines.append(f"- **balanced accuracy:** {metrics['test.balanced_accuracy']:.4f} (recall per class: "
                     f"{recall_phrase(metrics)})")
    if "test.accuracy.zero_shot" in metrics and not no_prompt:
        lines.append(f"- **no prompt (zero-shot) test accuracy:** {metrics['test.accuracy.zero_shot']:.4f}")
    return lines


def model_card(name: str, version: str, tags: dict, spec: dict | None, metric_names=(), metrics: dict | None = None,
               run_tags: dict | None = None, params: dict | None = None) -> str:
    """Markdown: what the version is, its privacy statement, its quality and the run's warnings
    (``metrics`` / ``run_tags`` / ``params`` of the DP run, when given), lineage, gates and what ε
    does not cover."""
    spec, metrics, run_tags, params = spec or {}, metrics or {}, run_tags or {}, params or {}
    no_prompt = tags.get("prompt.source") == "none"
    eps, delta = tags.get("privacy.epsilon", "none"), tags.get("privacy.delta", "none")
    try:  # four decimals, as every other place states ε
        eps = f"{float(eps):.4f}"
    except ValueError:
        pass
    lines = [f"## {name} v{version}", ""]
    if no_prompt:
        lines += ["**No prompt.** This version is the model without a prompt (its template and label words): the "
                  "run's prompt did not beat it on the holdout, so none was published. ε is what the run spent.", ""]
    lines += [f"- **method:** {spec.get('method', tags.get('method', '?'))}",
             f"- **model:** {spec.get('model', tags.get('model.target', '?'))}",
             f"- **guarantee:** {tags.get('privacy.guarantee', '?')}",
             f"- **ε:** {eps} {unit_phrase(tags.get('privacy.unit'))}",
             f"- **δ:** {delta}",
             f"- **accountant:** {tags.get('privacy.accountant', 'none')}",
             f"- **privacy unit:** {tags.get('privacy.unit', 'record')} (every ε holds for adding or removing one "
             "such unit of the SOURCE dataset)",
             f"- **dataset fingerprint:** `{tags.get('dataset.fingerprint', '?')}` (keyed: identifies the dataset to "
             "the ledger; confirms nothing about a record to anyone without the installation's key)"]
    if tags.get("prompt.registry"):
        lines.append(f"- **text prompt:** `{tags['prompt.registry']}` in MLflow's Prompt Registry "
                     "(`mlflow.genai.load_prompt`; its alias `production` moves with this model's)")
    if params.get("data.max_records_per_unit"):
        lines.append(f"- **records per person:** at most {params['data.max_records_per_unit']} "
                     "(data.max_records_per_unit: the rest of a person's records were left out)")
    if tags.get("lineage.parent"):
        lines.append(f"- **lineage:** retargeted from `{tags['lineage.parent']}` on public data only "
                     "(post-processing: no ε spent, no ledger entry)")
    if not tags.get("lineage.parent"):  # a retargeted version's quality is of another target: its own run's
        lines += _quality(metrics, no_prompt)
    warnings = [w for w in str(run_tags.get("warning", "")).split(" | ") if w]
    if warnings:
        lines += ["", "### Warnings the run printed", ""] + [f"- {w}" for w in warnings]
    lines += ["", "### Release gates", ""] + _gates(tags)
    if tags.get("gate.forced"):
        lines += ["", f"**Promoted with --force:** {tags['gate.forced']}"]
    lines += ["", "### What the guarantee does not cover", ""] + _not_covered(metric_names)
    return "\n".join(lines) + "\n"


def write_card(client, version, spec: dict | None = None) -> str:
    """Write the card of ``version`` (a ModelVersion, re-read for its current tags) as its description."""
    import json
    import tempfile
    from pathlib import Path

    current = client.get_model_version(version.name, str(version.version))
    if spec is None:
        from .registry_model import MODEL_ARTIFACT, SPEC_FILE

        try:
            with tempfile.TemporaryDirectory(prefix="privprompt-card-") as tmp:
                spec = json.loads(Path(client.download_artifacts(
                    current.run_id, f"{MODEL_ARTIFACT}/artifacts/{SPEC_FILE}", tmp)).read_text())
        except Exception:  # noqa: BLE001 - a card without the spec's names still states the privacy
            spec = {}
    tags = dict(current.tags or {})
    dp_run = tags.get("lineage.dp_run") or current.run_id
    data = client.get_run(dp_run).data if dp_run else None
    metrics = dict(data.metrics) if data else {}
    text = model_card(current.name, str(current.version), tags, spec, set(metrics), metrics,
                      dict(data.tags) if data else {}, dict(data.params) if data else {})
    client.update_model_version(current.name, str(current.version), description=text)
    return text
