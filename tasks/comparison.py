"""The privacy–utility report of an experiment, rebuilt from MLflow alone (``privprompt report
EXPERIMENT``, and the sweep's summary): parent runs only, pulled back with ``search_runs``.

Accuracy vs ε and MIA AUC vs ε, one line per method (its ``method.label``: a method whose runs
differ in kind labels them apart), markers by ``privacy.guarantee``; runs without an ε
(non-private methods, ``none``) stand at ε = ∞ on the right; local-DP runs (``ldp``, no ε) get
their own panel against their privacy parameter (the method's ``Report.ldp_level``).

What a method adds — metrics read into its runs' rows, summary columns, panels against the
privacy level, tables and figures — it declares (``Method.report``: ``Report.metrics`` /
``sections``); this module reads the declarations from the registry and names no method."""

from __future__ import annotations

import math

from . import plots
from .statement import unit_phrase
from .methods.base import LevelPanel, ReferenceAccuracy, ReportArtifact, SummaryColumn

MARKERS = {"dp": "o", "none": "x", "ldp": "s"}


def report_declarations() -> tuple[dict, list]:
    """What the registered methods add to the report: their row metrics (by method name) and their
    sections (each once, in registry order: a skeleton's, declared by all its methods, once)."""
    from .methods import METHODS

    metrics, sections = {}, []
    for method in METHODS.values():
        metrics[method.name] = method.report.metrics
        sections += [s for s in method.report.sections if s not in sections]
    return metrics, sections


def _declared(sections: list | None, kind: type) -> list:
    """The declared sections of ``kind`` (``sections`` None: the registered methods')."""
    return [s for s in (report_declarations()[1] if sections is None else sections) if isinstance(s, kind)]


def parent_runs(mlflow, experiment: str) -> list[dict]:
    """Finished parent runs of method flows in ``experiment`` (sweep summaries excluded); each
    row also holds what the run's method declares (``Report.metrics``), and every row the
    keys other methods declare (empty)."""
    declared, _ = report_declarations()
    empty = {d.key: d.empty() for ds in declared.values() for d in ds}
    everywhere = [d for ds in declared.values() for d in ds if d.every_run]
    exp = mlflow.get_experiment_by_name(experiment)
    if exp is None:
        from .errors import ConfigError

        raise ConfigError(f"no MLflow experiment {experiment!r}")
    rows, token = [], None
    while True:
        page = mlflow.search_runs([exp.experiment_id], "attributes.status = 'FINISHED'", max_results=1000,
                                  page_token=token)
        for run in page:
            tags = run.data.tags
            if "mlflow.parentRunId" in tags or tags.get("flow") == "sweep" or "method" not in tags:
                continue
            eta = _ldp_level(tags["method"], run.data.params)
            selected = run.data.params.get("selection.enabled") == "True"
            label, unit = _method_label(tags, run.data.params, selected)
            row = {"run_id": run.info.run_id, "method": label, "unit": unit,
                         "dataset": tags.get("dataset", ""),
                         "guarantee": tags.get("privacy.guarantee", "none"),
                         "variant": tags.get("sweep.variant", ""), "seed": run.data.params.get("seed"),
                         "epsilon": run.data.metrics.get("privacy.epsilon"), "eta": eta,
                         "delta": run.data.metrics.get("privacy.delta"),
                         "flow_run_id": tags.get("prefect.flow_run_id"),
                         # the settings but seed and target (runs recorded before it: "")
                         "config_family": tags.get("config.family", ""),
                         "epsilon_per_record": run.data.metrics.get("privacy.epsilon_per_record"),
                         "accuracy": run.data.metrics.get("test.accuracy"),
                         "balanced_accuracy": run.data.metrics.get("test.balanced_accuracy"),
                         "mia_auc": run.data.metrics.get("mia.loss.auc"),
                         "target_epsilon": float(run.data.params.get("privacy.target_epsilon", "nan")),
                         "note": tags.get("privacy.note", ""),
                         "below_no_prompt": tags.get("result.below_no_prompt") == "true",
                         # its prompt lost the released comparison with no prompt, and none was published
                         "fell_back": tags.get("result.fallback_to_no_prompt") == "true",
                         # a selection's published winner and its DP-released holdout accuracy (never an exact
                         # holdout number: none is logged)
                         "selection": _selection_of(run) if selected else None}
            for key, value in empty.items():
                row.setdefault(key, value)
            for metric in everywhere:  # what every run logs about a method (its accuracy as a baseline)
                row[metric.key] = metric.read(run.data.metrics)
            for metric in declared.get(tags["method"], ()):  # what the run's own method declares
                if not metric.every_run:
                    row[metric.key] = metric.read(run.data.metrics)
            rows.append(row)
        token = page.token
        if not token:
            break
    return rows


def _method_label(tags: dict, params: dict, selected: bool) -> tuple[str, str]:
    """(the label a run's rows are pooled under, its privacy unit)."""
    label = (tags.get("method.label") or tags["method"]) + (" + selection" if selected else "")
    unit = params.get("privacy.unit", "record")
    if unit != "record" and params.get("privacy.mechanism_unit") == "record":
        # a record-level run on a dataset of people: its ε (privacy.epsilon) is the per-person charge by
        # group privacy for at most k records; apart from the method's user-level runs and its plain ones
        label = f"{label} [record-level, charged per {unit}, k={params.get('data.max_records_per_unit', '?')}]"
    elif unit != "record":  # ε per person: never pooled with the record-level runs of the method
        label = f"{label} [unit: {unit}]"
    return label, unit


def _ldp_level(method: str, params: dict) -> float | None:
    """A local-DP run's privacy parameter, as its method reads it from the params (None for a
    method no longer registered)."""
    from .methods import METHODS

    try:
        level = METHODS.get(method).report.ldp_level
        return None if level is None else level(params)
    except KeyError:  # not registered, or a param its reading needs not logged
        return None


def comparison_table(rows: list[dict], sections: list | None = None) -> str:
    """One row per run, by dataset (runs of different datasets are never pooled), with each declared
    reference accuracy (a no-prompt baseline) on the same test split beside the method's accuracy
    (``sections``: the registered methods' when None)."""
    refs = _declared(sections, ReferenceAccuracy)
    # the dataset's composed spend from this machine's ledger (privprompt report prints it; never logged)
    composed = any(r.get("dataset_epsilon") for r in rows)
    lines = ["| dataset | method | guarantee | ε (spent, this run) | δ | unit | "
             + ("dataset ε (composed, ledger) | " if composed else "") + "η | test accuracy | "
             + "".join(f"{ref.label} accuracy | " for ref in refs) + "loss-MIA AUC (audit statistic) | seed | run |",
             "|---|---|---|---:|---:|---|" + ("---:|" if composed else "") + "---:|---:|" + "---:|" * len(refs)
             + "---:|---:|---|"]
    for r in sorted(rows, key=lambda r: (r.get("dataset", ""), r["method"],
                                         r["epsilon"] if r["epsilon"] is not None else math.inf)):
        f = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
        dp = r["epsilon"] is not None
        delta = f"{r['delta']:.3g}" if dp and r.get("delta") else "-"
        lines.append(f"| {r.get('dataset') or '-'} | {r['method']} | "
                     f"{r['guarantee']}{' (' + r['note'] + ')' if r['note'] else ''} | "
                     f"{f(r['epsilon'])} | {delta} | "
                     f"{unit_phrase(r.get('unit')) if dp else '-'} | "
                     + (f"{r.get('dataset_epsilon') or '-'} | " if composed else "")
                     + f"{f(r['eta'])} | {f(r['accuracy'])} | "
                     + "".join(f"{f(r.get(ref.key))} | " for ref in refs)
                     + f"{f(r['mia_auc'])} | {r['seed'] or '-'} | {r['run_id'][:8]} |")
    return "\n".join(lines + below_no_prompt_lines(rows, refs)) + "\n"


def below_no_prompt_lines(rows: list[dict], refs: list) -> list[str]:
    """The report's warning lines: DP runs whose published prompt scored below no prompt (test accuracy
    below a declared no-prompt reference's on the same test split, ``refs``, or the run's tag
    ``result.below_no_prompt``), runs that published no prompt because theirs lost the released
    comparison (tag ``result.fallback_to_no_prompt``), and selection runs with failed candidates (a count)."""
    out = []
    for r in rows:
        worse = [ref for ref in refs if isinstance(r.get(ref.key), float) and r["accuracy"] is not None
                 and r["accuracy"] < r[ref.key]]
        below = r.get("below_no_prompt") or (r["epsilon"] is not None and bool(worse))
        if below:
            out.append(f"WARNING: run {r['run_id'][:8]} ({r['method']}, {r.get('dataset') or '-'}): its prompt scored "
                       "below no prompt; the model without a prompt serves better")
        if r.get("fell_back"):
            out.append(f"NOTE: run {r['run_id'][:8]} ({r['method']}, {r.get('dataset') or '-'}): its prompt lost to no "
                       "prompt in the released holdout comparison: no prompt was published (fallback); its test "
                       "accuracy is the model's without a prompt")
        failed = (r.get("selection") or {}).get("failed_candidates")
        if failed:
            out.append(f"WARNING: run {r['run_id'][:8]} ({r['method']}): {int(failed)} selection candidate(s) failed "
                       "and were skipped")
    return [""] + out if out else []


def add_composed_spend(rows: list[dict], ledger) -> None:
    """Each DP run's row gets its dataset's composed spend from ``ledger`` (this machine's: the
    dataset a run was charged to is found by the run's ledger entry, ``<flow run id>:<method>``):
    ``dataset_epsilon`` = "ε spent of cap". Printed by ``privprompt report``, never logged to MLflow
    (which dataset a source is charged to depends on its records: ``tasks.report.budget_record``)."""
    by_flow: dict[str, str] = {}
    for e in ledger.entries():
        if e["kind"] == "dp" and e["status"] in ("committed", "reserved"):
            by_flow.setdefault(str(e["run_id"]).split(":", 1)[0], e["fingerprint"])
    datasets = {d["fingerprint"]: d for d in ledger.datasets()}
    for r in rows:
        d = datasets.get(by_flow.get(r.get("flow_run_id") or "", ""))
        if r["epsilon"] is not None and d is not None:
            r["dataset_epsilon"] = f"{d['spent_epsilon']:.4f} of cap {d['epsilon_cap']:g}"


def _selection_of(run) -> dict:
    """A selection run's published candidate, its released holdout score (and the score's name),
    and — when every candidate was tried once, which the selection's ε covers — each candidate's
    released score by name. Never an exact holdout number: none is logged."""
    params, metrics = run.data.params, run.data.metrics
    scores = {}
    for key, name in params.items():
        if key.startswith("selection.candidate_") and f"{key}.holdout_score" in metrics:
            scores[name] = metrics[f"{key}.holdout_score"]
    return {"winner": params.get("selection.winner"), "mode": params.get("selection.mode", "random_stopping"),
            "metric": params.get("selection.metric", "accuracy"),
            # runs before the scores' generic name logged the accuracy as selection.winner.holdout_accuracy
            "released_holdout_score": metrics.get("selection.winner.holdout_score",
                                                  metrics.get("selection.winner.holdout_accuracy")),
            "candidates": scores, "failed_candidates": metrics.get("selection.failed_candidates")}


def selection_table(rows: list[dict]) -> str | None:
    """The runs that selected their settings privately: the published candidate and its holdout
    score AS RELEASED by the mechanism (noisy, DP; random stopping's other trials are never
    published), then, for the runs that tried every candidate once, every candidate's released
    score. None when no run of the experiment selected."""
    selected = [r for r in rows if r.get("selection")]
    if not selected:
        return None
    lines = ["| dataset | method | published candidate | released holdout score (DP, noisy) | score | test accuracy | "
             "ε (spent, whole selection) | seed | run |", "|---|---|---|---:|---|---:|---:|---:|---|"]
    f = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
    ordered = sorted(selected, key=lambda r: (r.get("dataset", ""), r["method"], str(r["seed"])))
    for r in ordered:
        s = r["selection"]
        lines.append(f"| {r.get('dataset') or '-'} | {r['method']} | {s['winner'] or '-'} | "
                     f"{f(s['released_holdout_score'])} | {s.get('metric', 'accuracy')} | {f(r['accuracy'])} | "
                     f"{f(r['epsilon'])} | {r['seed'] or '-'} | {r['run_id'][:8]} |")
    every = [r for r in ordered if r["selection"].get("candidates")]
    if every:
        lines += ["", "Every candidate's released holdout score (runs that tried each once; DP, noisy):", "",
                  "| dataset | seed | run | candidate | released holdout score | published |",
                  "|---|---:|---|---|---:|---|"]
        for r in every:
            s = r["selection"]
            for name, score in s["candidates"].items():
                lines.append(f"| {r.get('dataset') or '-'} | {r['seed'] or '-'} | {r['run_id'][:8]} | {name} | "
                             f"{f(score)} | {'yes' if name == s['winner'] else ''} |")
    return "\n".join(lines) + "\n"


def privacy_level(r: dict) -> float | None:
    """The level a run's seeds are pooled at: its target ε (dp), its η (ldp), None (no guarantee)."""
    return r["target_epsilon"] if r["guarantee"] == "dp" else (r["eta"] if r["guarantee"] == "ldp" else None)


def mean_std(values) -> tuple[float, float, int] | None:
    """Mean, sample standard deviation (0 for one value) and count of the non-None values."""
    v = [float(x) for x in values if x is not None]
    if not v:
        return None
    mean = sum(v) / len(v)
    return mean, (math.sqrt(sum((x - mean) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else 0.0), len(v)


def _seed_groups(runs: list[dict], x_of, key: str) -> list[tuple[float, float, float, int, str]]:
    """Runs of one method pooled by :func:`privacy_level` (seeds together): (mean x, mean y, std y,
    n, guarantee) per level, sorted by x."""
    groups: dict = {}
    for r in runs:
        groups.setdefault(privacy_level(r), []).append(r)
    out = []
    for members in groups.values():
        mean, std, n = mean_std(r[key] for r in members)
        out.append((sum(x_of(r) for r in members) / len(members), mean, std, n, members[0]["guarantee"]))
    return sorted(out)


def _mean_line(ax, groups, label: str, marker: str | None = None):
    """One line through the group means, ± one standard deviation where a group has several seeds;
    the marker of each mean is its guarantee's (or ``marker``)."""
    n_max = max(g[3] for g in groups)
    line, = ax.plot([g[0] for g in groups], [g[1] for g in groups], lw=1.2, alpha=0.8,
                    label=label if n_max == 1 else f"{label} (mean ± sd, n≤{n_max})")
    for x, mean, std, n, guarantee in groups:
        ax.errorbar([x], [mean], yerr=[std] if n > 1 else None, marker=marker or MARKERS.get(guarantee, "o"),
                    color=line.get_color(), capsize=3, zorder=3)
    return line


def _epsilon_panel(ax, key: str, label: str, eps_rows: list[dict], ldp_rows: list[dict], datasets: list[str],
                   sections: list) -> None:
    """``key`` against ε spent (log; runs without ε at "∞", right of a dotted line) per method:
    the means over seeds, every run faint behind them; on the accuracy panel, each declared
    :class:`ReferenceAccuracy` per dataset as a horizontal line."""
    finite = [r["epsilon"] for r in eps_rows if r["epsilon"] is not None]
    inf_x = (max(finite) * 1.6) if finite else 1.0
    for method in sorted({r["method"] for r in eps_rows}):
        runs = [r for r in eps_rows if r["method"] == method and r[key] is not None]
        if not runs:
            continue
        groups = _seed_groups(runs, lambda r: r["epsilon"] if r["epsilon"] is not None else inf_x, key)
        line = _mean_line(ax, groups, method)
        for x, y, g in sorted((r["epsilon"] if r["epsilon"] is not None else inf_x, r[key], r["guarantee"])
                              for r in runs):  # every run, faint behind the means
            ax.scatter([x], [y], marker=MARKERS.get(g, "o"), color=line.get_color(), alpha=0.35, s=14, zorder=2)
    for ref in _declared(sections, ReferenceAccuracy) if key == "accuracy" else ():
        for i, dataset in enumerate(datasets):  # each dataset's reference, on its own test split
            mean = mean_std(r.get(ref.key) for r in eps_rows + ldp_rows if r.get("dataset", "") == dataset)
            if mean is not None:
                ax.axhline(mean[0], color="0.45", lw=1, ls=("--", "-.", ":")[i % 3],
                           label=ref.label + (f" · {dataset}" if len(datasets) > 1 else ""))
    if finite:
        ax.axvline(inf_x / 1.25, color="0.7", lw=0.8, ls=":")
    ax.set_xscale("log")
    plots.epsilon_ticks(ax, finite, inf_x if any(r["epsilon"] is None for r in eps_rows) else None)
    units = sorted({unit_phrase(r.get("unit")) for r in eps_rows if r["epsilon"] is not None}) or ["per record"]
    ax.set_xlabel(f"ε spent, {' / '.join(units)} (log); no DP at ε=∞")
    ax.set_ylabel(label)


def _level_panel(ax, rows: list[dict], key: str, ylabel: str) -> None:
    """``key`` against the local privacy level η per method (ldp runs: no ε), means over seeds."""
    for method in sorted({r["method"] for r in rows}):
        runs = [r for r in rows if r["method"] == method and r["eta"] is not None]
        if runs:
            _mean_line(ax, _seed_groups(runs, lambda r: r["eta"], key), method, "s")
    ax.set_xlabel("η (local d_X privacy; no ε)")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)


def comparison_figure(rows: list[dict], title: str, sections: list | None = None):
    """Accuracy and MIA AUC vs ε (∞ for runs without ε) per method — a line through the means over
    seeds at each privacy level with ± one standard deviation, every run a faint marker behind it;
    panels against the privacy level for ldp runs: accuracy, and each declared :class:`LevelPanel`
    that a run logged (``sections``: the registered methods' when None)."""
    from .plots import plt

    datasets = sorted({r.get("dataset", "") for r in rows})
    if len(datasets) > 1:  # one line per (method, dataset): runs of different datasets are never pooled
        rows = [{**r, "method": f"{r['method']} · {r.get('dataset') or '?'}"} for r in rows]
    eps_rows = [r for r in rows if r["guarantee"] != "ldp"]
    ldp_rows = [r for r in rows if r["guarantee"] == "ldp"]
    sections = report_declarations()[1] if sections is None else sections
    level_panels = [(p, [r for r in ldp_rows if r.get(p.key) is not None]) for p in _declared(sections, LevelPanel)]
    level_panels = [(p, runs) for p, runs in level_panels if runs]
    eps_panels = 2 if eps_rows or not ldp_rows else 0  # only-ldp experiments get the η panels only
    n_panels = eps_panels + bool(ldp_rows) + len(level_panels)
    fig, axes = plt.subplots(1, n_panels, figsize=(4.6 * n_panels, 3.8), squeeze=False)
    axes = list(axes[0])
    eps_axes = ((axes[0], "accuracy", "test accuracy"), (axes[1], "mia_auc", "loss-MIA AUC (not DP)")) if eps_panels else ()
    for ax, key, label in eps_axes:
        _epsilon_panel(ax, key, label, eps_rows, ldp_rows, datasets, sections)
    if eps_panels:
        axes[0].legend(fontsize=7, title="o dp · x none", title_fontsize=7)
    if ldp_rows:
        _level_panel(axes[eps_panels], [r for r in ldp_rows if r["accuracy"] is not None], "accuracy", "test accuracy")
    for i, (panel, panel_rows) in enumerate(level_panels):
        _level_panel(axes[eps_panels + 1 + i], panel_rows, panel.key, panel.ylabel)
    fig.suptitle(title)
    fig.tight_layout()
    plots.drop_overlapping_tick_labels(fig)
    return fig


def label_summary(rows: list[dict], sections: list | None = None) -> str:
    """Per dataset, method label, config (its settings but seed and target: ``config.family``),
    what was published (a prompt, or no prompt after a fallback) and target ε (η for ldp runs):
    runs (seeds), test accuracy, balanced accuracy, each declared reference accuracy and loss-MIA AUC
    as mean ± sample std over them, ε spent, and a column per declared :class:`SummaryColumn`
    (``sections``: the registered methods' when None). Runs that differ in any of those are never
    averaged together."""
    sections = report_declarations()[1] if sections is None else sections
    refs, columns = _declared(sections, ReferenceAccuracy), _declared(sections, SummaryColumn)

    def stat(values):
        ms = mean_std(values)
        if ms is None:
            return "-"
        return f"{ms[0]:.4f} ± {ms[1]:.4f}" if ms[2] > 1 else f"{ms[0]:.4f}"

    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r.get("dataset", ""), r["method"], r.get("config_family", ""), bool(r.get("fell_back")),
                           r["guarantee"], privacy_level(r)), []).append(r)
    lines = ["| dataset | method | config | published | guarantee | target ε (dp) / η (ldp) | runs | test accuracy | "
             "balanced accuracy | "
             + "".join(f"{ref.label} accuracy | " for ref in refs) + "loss-MIA AUC (audit statistic) | ε spent |"
             + "".join(f" {c.header} |" for c in columns),
             "|---|---|---|---|---|---:|---:|---:|---:|" + "---:|" * len(refs) + "---:|---:|" + "---:|" * len(columns)]
    for (dataset, label, family, fell_back, guarantee, eps), members in sorted(
            groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2], kv[0][3], kv[0][5] or 0)):
        spent = [m["epsilon"] for m in members if m["epsilon"] is not None]
        unit = unit_phrase(members[0].get("unit"))
        lines.append(f"| {dataset or '-'} | {label} | {family[:8] or '-'} | "
                     f"{'no prompt (fallback)' if fell_back else 'its output'} | {guarantee} | "
                     f"{'-' if eps is None else f'{eps:g}'} | "
                     f"{len(members)} | {stat(m['accuracy'] for m in members)} | "
                     f"{stat(m.get('balanced_accuracy') for m in members)} | "
                     + "".join(f"{stat(m.get(ref.key) for m in members)} | " for ref in refs)
                     + f"{stat(m['mia_auc'] for m in members)} | "
                     f"{f'{max(spent):.4f} {unit}' if spent else '-'} |"
                     + "".join(f" {stat(c.value(m) for m in members)} |" for c in columns))
    return "\n".join(lines) + "\n"


def log_report(record, rows: list[dict], title: str) -> dict:
    """Log the table (Markdown) and figures (PNG) on ``record``, then each artifact the registered
    methods declare (:class:`ReportArtifact`) that has something to show; returns their paths."""
    sections = report_declarations()[1]
    table = comparison_table(rows, sections)
    record.log_text(table, "report/comparison.md")
    fig = comparison_figure(rows, title, sections)
    record.log_figure(fig, "report/privacy_utility.png")
    plots.close(fig)
    record.log_text(label_summary(rows, sections), "report/summary.md")
    selected = selection_table(rows)
    if selected is not None:
        record.log_text(selected, "report/selection.md")
    for artifact in _declared(sections, ReportArtifact):
        built = artifact.build(rows)
        if built is None:
            continue
        if isinstance(built, str):
            record.log_text(built, artifact.path)
        else:
            record.log_figure(built, artifact.path)
            plots.close(built)
    from prefect.artifacts import create_markdown_artifact
    from prefect.context import get_run_context
    from prefect.exceptions import MissingContextError

    try:
        get_run_context()
    except MissingContextError:  # `privprompt report` outside a flow: MLflow artifacts only
        pass
    else:  # inside a flow run: also a Prefect Markdown artifact
        create_markdown_artifact(markdown=f"# {title}\n\n{table}", key="privacy-utility-report",
                                 description="privacy–utility comparison (from MLflow)")
    return {"table": "report/comparison.md", "figure": "report/privacy_utility.png", "n_runs": len(rows)}
