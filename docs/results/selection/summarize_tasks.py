"""Tables and the plot of issue 30's three tasks (every candidate once, balanced accuracy), from the
MLflow store alone.

    python docs/results/selection/summarize_tasks.py /tmp/sel-exp-state docs/results/selection
    # -> results_tasks.md, selection_tasks.png

Experiments read (see README.md for the commands that made them): SST-2 skewed — fixed settings in
``selection_sst2``, selection (σ_s = 5) in ``selection_sst2_every``, selection (default σ_s) in
``selection_sst2_auto``; TREC skewed and AG News balanced — fixed settings and both selections in
``selection_trec`` / ``selection_agnews``, told apart by the param selection.score_noise_multiplier.
Only runs with ``selection.mode = every_candidate`` are read as selections (the random-stopping
runs of the first version are in results.md).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

TASKS = [("SST-2, 80% positive (balanced test)", "sst2", ["selection_sst2", "selection_sst2_every", "selection_sst2_auto"]),
         ("TREC, 60% entity (TREC test)", "trec", ["selection_trec"]),
         ("AG News, balanced (balanced test)", "agnews", ["selection_agnews"])]


def _runs(mlflow, experiment: str) -> list:
    exp = mlflow.get_experiment_by_name(experiment)
    if exp is None:
        return []
    runs = mlflow.search_runs([exp.experiment_id], "attributes.status = 'FINISHED'", max_results=500)
    return [r for r in runs if "mlflow.parentRunId" not in r.data.tags and "method" in r.data.tags]


def _arm(run) -> str | None:
    p = run.data.params
    if p.get("selection.enabled") != "True":
        return "fixed"
    if p.get("selection.mode") != "every_candidate":
        return None  # the first version's random-stopping runs: results.md
    return "selection, σ_s = 5" if float(p["selection.score_noise_multiplier"]) == 5.0 else "selection, default σ_s"


def main(state: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tasks.record import client
    from tasks.state import state_paths

    mlflow = client(state_paths(state))
    f = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731

    def ms(v):
        if not v:
            return "-"
        return f"{statistics.mean(v):.4f} ± {statistics.stdev(v):.4f}" if len(v) > 1 else f"{v[0]:.4f}"

    lines = ["| task | arm | seed | test accuracy | zero-shot | published | released holdout score (balanced acc., "
             "DP) | no prompt's released score | score σ_s | ε | wall (s) |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    summary = ["| task | zero-shot | fixed settings (3 seeds) | selection, σ_s = 5 | selection, default σ_s | "
               "seeds below zero-shot: fixed / σ_s = 5 / default |", "|---|---:|---:|---:|---:|---|"]
    plot = []
    for title, short, experiments in TASKS:
        arms: dict[str, list] = {}
        for experiment in experiments:
            for run in _runs(mlflow, experiment):
                arm = _arm(run)
                if arm is not None:
                    arms.setdefault(arm, []).append(run)
        zero = None
        for arm in ("fixed", "selection, σ_s = 5", "selection, default σ_s"):
            for run in sorted(arms.get(arm, []), key=lambda r: int(r.data.params.get("seed", 0))):
                m, p = run.data.metrics, run.data.params
                zero = m.get("test.accuracy.zero_shot", zero)
                wall = (run.info.end_time - run.info.start_time) / 1000 if run.info.end_time else None
                lines.append(
                    f"| {short} | {arm} | {p.get('seed')} | {f(m.get('test.accuracy'))} | "
                    f"{f(m.get('test.accuracy.zero_shot'))} | {p.get('selection.winner', '(configured)')} | "
                    f"{f(m.get('selection.winner.holdout_score'))} | {f(m.get('selection.no_prompt.holdout_score'))} | "
                    f"{p.get('selection.score_noise_multiplier', '-')} | {f(m.get('privacy.epsilon'))} | "
                    f"{'-' if wall is None else f'{wall:.0f}'} |")
        accs = {arm: [r.data.metrics["test.accuracy"] for r in runs] for arm, runs in arms.items()}
        below = " / ".join(str(sum(a < zero - 1e-9 for a in accs.get(arm, []))) + f" of {len(accs.get(arm, []))}"
                           for arm in ("fixed", "selection, σ_s = 5", "selection, default σ_s"))
        summary.append(f"| {title} | {f(zero)} | {ms(accs.get('fixed'))} | {ms(accs.get('selection, σ_s = 5'))} | "
                       f"{ms(accs.get('selection, default σ_s'))} | {below} |")
        plot.append((title, zero, accs))
    text = "\n".join(summary) + "\n\nEvery run:\n\n" + "\n".join(lines) + "\n"
    Path(out, "results_tasks.md").write_text(text)
    print(text)

    fig, axes = plt.subplots(1, len(plot), figsize=(4.2 * len(plot), 4), sharey=False)
    for ax, (title, zero, accs) in zip(axes, plot):
        names = ["fixed", "selection, σ_s = 5", "selection, default σ_s"]
        for i, name in enumerate(names):
            values = accs.get(name, [])
            ax.scatter([i] * len(values), values, color=f"C{i}", alpha=0.7)
            if len(values) > 1:
                ax.errorbar([i + 0.15], [statistics.mean(values)], yerr=[statistics.stdev(values)], fmt="o",
                            color="black", capsize=4)
        if zero is not None:
            ax.axhline(zero, color="grey", linestyle="--", label="zero-shot (no prompt)")
        ax.set_xticks(range(len(names)), ["fixed\nsettings", "selection\nσ_s = 5", "selection\ndefault σ_s"])
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("test accuracy")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("Private selection (every candidate once, balanced accuracy), MiniLM, ε = 8 in total; dots: seeds")
    fig.tight_layout()
    fig.savefig(Path(out, "selection_tasks.png"), dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:3])
