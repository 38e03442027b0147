"""Tables and the plot of the issue-30 experiment, from its MLflow store alone.

    python docs/results/selection/summarize.py /tmp/sel-exp-state selection_sst2 docs/results/selection
    # -> results.md, selection_vs_fixed.png
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


def main(state: str, experiment: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tasks.comparison import parent_runs
    from tasks.record import client
    from tasks.state import state_paths

    rows = parent_runs(client(state_paths(state)), experiment)
    fixed = {r["seed"]: r for r in rows if not r.get("selection")}
    selected = {r["seed"]: r for r in rows if r.get("selection")}
    seeds = sorted(set(fixed) | set(selected), key=int)
    lines = ["| seed | zero-shot (test) | fixed quickstart settings, ε = 8 (test) | selection, ε = 8 in total (test) | "
             "published candidate | its released holdout accuracy (DP, noisy) | ε spent (fixed / selection) |",
             "|---:|---:|---:|---:|---|---:|---|"]
    f = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
    zs, fx, sl = [], [], []
    for seed in seeds:
        a, b = fixed.get(seed), selected.get(seed)
        z = (a or b)["zero_shot"]
        zs.append(z)
        if a:
            fx.append(a["accuracy"])
        if b:
            sl.append(b["accuracy"])
        lines.append(f"| {seed} | {f(z)} | {f(a and a['accuracy'])} | {f(b and b['accuracy'])} | "
                     f"{b['selection']['winner'] if b else '-'} | "
                     f"{f(b['selection']['released_holdout_accuracy']) if b else '-'} | "
                     f"{f(a and a['epsilon'])} / {f(b and b['epsilon'])} |")

    def ms(v):
        if not v:
            return "-"
        return f"{statistics.mean(v):.4f} ± {statistics.stdev(v):.4f} (n = {len(v)})" if len(v) > 1 else \
            f"{v[0]:.4f} (n = 1)"

    lines += ["", f"- zero-shot: {ms(zs)}", f"- fixed quickstart settings: {ms(fx)}", f"- selection: {ms(sl)}"]
    Path(out, "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    fig, ax = plt.subplots(figsize=(6, 4))
    groups = [("zero-shot", zs), ("fixed quickstart\nsettings, ε = 8", fx), ("selection,\nε = 8 in total", sl)]
    for i, (name, values) in enumerate(groups):
        ax.scatter([i] * len(values), values, color="C%d" % i, alpha=0.6, label=None)
        if values:
            ax.errorbar([i + 0.15], [statistics.mean(values)], yerr=[statistics.stdev(values) if len(values) > 1 else 0],
                        fmt="o", color="black", capsize=4)
    ax.set_xticks(range(len(groups)), [g[0] for g in groups])
    ax.set_ylabel("test accuracy (balanced SST-2 sample)")
    ax.set_title("SST-2, 1,500 training rows at 80% positive, MiniLM\n(dots: seeds; black: mean ± std)")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(Path(out, "selection_vs_fixed.png"), dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:4])
