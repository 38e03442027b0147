"""Tables and the plot of the issue-30 experiment, from its MLflow store alone.

    python docs/results/selection/summarize.py /tmp/sel-exp-state docs/results/selection \
        selection_sst2 selection_sst2_fallback
    # -> results.md, selection_vs_fixed.png

The first experiment holds the fixed-settings runs and the selection runs without the no-prompt
fallback (code of ddb32cd); the second, optional, the selection runs of the default with it.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


def main(state: str, out: str, experiment: str, fallback_experiment: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tasks.comparison import parent_runs
    from tasks.record import client
    from tasks.state import state_paths

    mlflow = client(state_paths(state))
    rows = parent_runs(mlflow, experiment)
    fb_rows = parent_runs(mlflow, fallback_experiment) if fallback_experiment else []
    fixed = {r["seed"]: r for r in rows if not r.get("selection")}
    selected = {r["seed"]: r for r in rows if r.get("selection")}
    fallback = {r["seed"]: r for r in fb_rows if r.get("selection")}
    seeds = sorted(set(fixed) | set(selected) | set(fallback), key=int)
    f = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731

    def sel(b):
        return "-" if not b else f"{f(b['accuracy'])} ({b['selection']['winner']}, released holdout " \
                                 f"{f(b['selection']['released_holdout_accuracy'])})"

    lines = ["| seed | zero-shot | fixed quickstart settings | selection, no fallback (ddb32cd) | "
             "selection, default with fallback (3f7d850) | ε spent: fixed / selection |",
             "|---:|---:|---:|---|---|---|"]
    zs, fx, sl, fb = [], [], [], []
    for seed in seeds:
        a, b, c = fixed.get(seed), selected.get(seed), fallback.get(seed)
        z = (a or b or c)["zero_shot"]
        zs.append(z)
        fx += [a["accuracy"]] if a else []
        sl += [b["accuracy"]] if b else []
        fb += [c["accuracy"]] if c else []
        eps_sel = (b or c or {}).get("epsilon")
        lines.append(f"| {seed} | {f(z)} | {f(a and a['accuracy'])} | {sel(b)} | {sel(c)} | "
                     f"{f(a and a['epsilon'])} / {f(eps_sel)} |")

    def ms(v):
        if not v:
            return "-"
        return (f"{statistics.mean(v):.4f} ± {statistics.stdev(v):.4f} (n = {len(v)})" if len(v) > 1
                else f"{v[0]:.4f} (n = 1)")

    lines += ["", "Test accuracy (balanced test split), mean ± sample std over the seeds that ran:", "",
              f"- zero-shot: {ms(zs)}", f"- fixed quickstart settings: {ms(fx)}",
              f"- selection without the fallback: {ms(sl)}", f"- selection with the fallback (default): {ms(fb)}"]
    Path(out, "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    fig, ax = plt.subplots(figsize=(7, 4))
    groups = [("zero-shot", zs), ("fixed quickstart\nsettings", fx), ("selection,\nno fallback", sl),
              ("selection,\nwith fallback", fb)]
    for i, (name, values) in enumerate(groups):
        ax.scatter([i] * len(values), values, color=f"C{i}", alpha=0.7)
        if values:
            ax.errorbar([i + 0.15], [statistics.mean(values)],
                        yerr=[statistics.stdev(values) if len(values) > 1 else 0], fmt="o", color="black", capsize=4)
    ax.set_xticks(range(len(groups)), [g[0] for g in groups])
    ax.set_ylabel("test accuracy (balanced)")
    ax.set_title("SST-2, ~1,500 training rows at 80% positive, MiniLM, ε = 8 in total\n"
                 "(dots: seeds; black: mean ± std)")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(Path(out, "selection_vs_fixed.png"), dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:5])
