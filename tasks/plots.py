"""Figures people compare: training curves, ROC curves (log FPR), privacy–utility bars."""

from __future__ import annotations

import os
import sys

import numpy as np

# every figure renders off-screen (task threads, headless machines), whoever imports pyplot first
if "matplotlib" in sys.modules:
    sys.modules["matplotlib"].use("Agg")
else:
    os.environ["MPLBACKEND"] = "Agg"


class _Pyplot:
    """``matplotlib.pyplot``, imported at the first figure: a second of start-up that ``privprompt
    plan`` and every run that draws nothing never pay."""

    def __getattr__(self, name: str):
        import matplotlib.pyplot as pyplot

        return getattr(pyplot, name)


plt = _Pyplot()


def training_curve(history: list[dict], title: str):
    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [h["step"] for h in history if h.get("loss") is not None]
    losses = [h["loss"] for h in history if h.get("loss") is not None]
    ax.plot(steps, losses, lw=1, alpha=0.4, label="batch loss")
    if len(losses) >= 10:
        k = max(1, len(losses) // 20)
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        ax.plot(steps[k - 1:], smooth, lw=2, label=f"moving average ({k})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return fig


def roc_curve_plot(curves: dict[str, tuple[np.ndarray, np.ndarray, float]], title: str):
    """``curves``: name -> (fpr, tpr, auc). Log-scaled FPR axis, chance diagonal."""
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    floor = 1e-4
    for name, (fpr, tpr, auc) in curves.items():
        ax.plot(np.maximum(fpr, floor), tpr, lw=1.5, label=f"{name} (AUC {auc:.3f})")
    grid = np.logspace(np.log10(floor), 0, 100)
    ax.plot(grid, grid, "k--", lw=0.8, label="chance")
    ax.set_xscale("log")
    ax.set_xlim(floor, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("false positive rate (log)")
    ax.set_ylabel("true positive rate")
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig


def privacy_utility_plot(points: list[dict], title: str, unit: str = "record"):
    """``points``: dicts with method, accuracy, epsilon (None for non-private / zero-shot); ``unit``:
    what every ε protects (``data.privacy_unit`` or a person's field), said beside each."""
    from tasks.statement import unit_phrase

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [p["method"] for p in points]
    accs = [p["accuracy"] for p in points]
    colors = ["tab:green" if p.get("epsilon") is not None else "tab:gray" for p in points]
    bars = ax.bar(names, accs, color=colors)
    for bar, p in zip(bars, points):
        eps = p.get("epsilon")
        label = f"{p['accuracy']:.3f}\n" + (f"ε={eps:.2f}" if eps is not None else p.get("guarantee", "no DP"))
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), label, ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("test accuracy")
    if any(p.get("epsilon") is not None for p in points):
        ax.set_xlabel(f"every ε {unit_phrase(unit)}")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def epsilon_ticks(ax, values, inf_x: float | None = None) -> None:
    """A log ε axis labelled at the ε values plotted (2 significant digits, plain numbers) and at
    ``inf_x`` as "∞" (runs without ε), with no minor-tick labels: matplotlib's own labels of a
    log axis spanning less than a decade are "3×10⁰ 4×10⁰ 6×10⁰", which collide."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ticks = sorted({float(f"{v:.2g}") for v in values if v and v > 0})
    labels = {t: f"{t:g}" for t in ticks}
    if inf_x is not None:
        ticks.append(inf_x)
        labels[inf_x] = "∞"
    if not ticks:
        return
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: labels.get(x, f"{x:g}")))
    ax.xaxis.set_minor_locator(NullLocator())


def drop_overlapping_tick_labels(fig, pad_px: float = 2.0) -> None:
    """Hide x tick labels that would overlap a neighbour once drawn (call after ``tight_layout``):
    the last label ("∞") is kept first, then labels left to right."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        labels = [t for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
        kept = []
        for label in labels[-1:] + labels[:-1]:
            box = label.get_window_extent(renderer).expanded(1.0, 1.0)
            if any(box.x0 < k.x1 + pad_px and k.x0 < box.x1 + pad_px for k in kept):
                label.set_visible(False)
            else:
                kept.append(box)


def close(fig) -> None:
    plt.close(fig)


def leakage_plot(rows: list[dict], title: str):
    """Attack AUCs and the canary ε lower bound per variant, next to its claimed ε."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r["variant"] for r in rows]
    x = np.arange(len(rows))
    for i, (key, label) in enumerate((("mia.loss.auc", "loss"), ("mia.lira.auc", "LiRA"))):
        vals = [r.get(key) or 0.0 for r in rows]
        ax1.bar(x + (i - 0.5) * 0.35, vals, width=0.35, label=label)
    ax1.axhline(0.5, color="k", lw=0.8, ls="--")
    ax1.set_xticks(x, names, rotation=20, ha="right", fontsize=8)
    ax1.set_ylim(0.4, 1.0)
    ax1.set_ylabel("attack AUC")
    ax1.legend(fontsize=8)
    lb = [r.get("audit.epsilon_lower_bound") or 0.0 for r in rows]
    eps = [r.get("privacy.epsilon") for r in rows]
    ax2.bar(x - 0.175, lb, width=0.35, label="canary ε lower bound")
    ax2.bar(x + 0.175, [e if e is not None else 0.0 for e in eps], width=0.35, label="claimed ε")
    for xi, e in zip(x, eps):
        if e is None:
            ax2.text(xi + 0.175, 0.05, "no DP", ha="center", fontsize=7, rotation=90)
    ax2.set_xticks(x, names, rotation=20, ha="right", fontsize=8)
    ax2.set_ylabel("ε")
    ax2.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig
