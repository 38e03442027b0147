"""What RAPT adds to the comparison report (``tasks/comparison.py`` reads it from the method's
declarations): its empirical privacy (1 − hidden-state inversion success, an audit statistic of
its runs) as a row metric and a panel against η, and its Table 1 shape (``report/ldp_table.md``)."""

from __future__ import annotations

from ..base import LevelPanel, ReportArtifact, ReportMetric


def one_minus(success: float) -> float:
    return 1.0 - success


def ldp_table(rows: list[dict]) -> str | None:
    """RAPT's Table 1 shape: one row per variant (its label), one column per η; each cell the
    test accuracy and the empirical privacy (1 − hidden-state inversion), mean over seeds."""
    rows = [r for r in rows if r["guarantee"] == "ldp" and r["eta"] is not None]
    if not rows:
        return None
    etas = sorted({r["eta"] for r in rows})
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    lines = ["| variant | " + " | ".join(f"η = {e:g}" for e in etas) + " |", "|---|" + "---:|" * len(etas)]
    for label in sorted({r["method"] for r in rows}):
        cells = []
        for e in etas:
            sel = [r for r in rows if r["method"] == label and r["eta"] == e]
            acc = mean([r["accuracy"] for r in sel if r["accuracy"] is not None])
            priv = mean([r["empirical_privacy"] for r in sel if r.get("empirical_privacy") is not None])
            cells.append("-" if acc is None else f"{acc:.4f}" + (f" ({priv:.3f})" if priv is not None else "")
                         + (f" n={len(sel)}" if len(sel) > 1 else ""))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return ("test accuracy (empirical privacy = 1 − hidden-state inversion success, an audit statistic); "
            "mean over seeds\n\n" + "\n".join(lines) + "\n")


# runs before the audit.* names logged it as attack.inversion_hidden.success
METRICS = (ReportMetric("empirical_privacy", ("audit.attack.inversion_hidden.success",
                                              "attack.inversion_hidden.success"), transform=one_minus),)
SECTIONS = (LevelPanel("empirical_privacy", "empirical privacy: 1 − hidden-state inversion"),
            ReportArtifact("report/ldp_table.md", ldp_table))
