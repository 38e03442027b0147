"""DP-ICL (Wu et al.) at equal ε and equal query volume on three tasks, beside the one-time methods (issue 38).

    python bench/compare_dp_icl.py --out docs/results/dp_icl [--datasets sst2,trec,agnews] [--queries 100]
    python bench/compare_dp_icl.py --out docs/results/dp_icl --report-only   # table and figures from MLflow

For each task, with SmolLM2-135M-Instruct as the local LLM, M subsets of N demonstrations answer the
first ``--queries`` test inputs:
* zero-shot (the template with no demonstration);
* the non-private ICL ensemble (majority vote, ε = ∞), of the fixed partition and of Poisson samples;
* ``dp_icl`` with ONE fixed secret keyed partition (``sampling: partition``) and with a fresh Poisson
  sample per query (``sampling: poisson``, the paper's amplification, q = M·N / n), each with σ calibrated
  so that 100, or 10,000, answered queries spend ε ∈ {1, 3, 8} at δ = 1e-5; ``--noise-seeds`` fresh noise
  draws per setting (mean and sd).
Every setting is one MLflow run (params: task, method, sampling, volume, ε, σ, q; metrics: accuracy mean/sd,
ε after 1 / 100 / 10,000 answered queries); the table and figures are built from MLflow's runs and logged
to a summary run as artifacts.

The private rows stand in for a team's data (public benchmarks): SST-2's and TREC's first ``--rows``
training rows (2,000: the DP-OPT config's scale), AG News's test articles after the queries (its train
split is not in ../shared/data; all 7,600 − queries of them). The votes are computed here without the ledger (the
served path's charging is tested in tests/pipeline/test_dp_icl_served.py) by the server's own histogram
and noisy vote; q here uses the exact row count (the served path uses the released one).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TASKS = {
    "sst2": {"template": "Review: {text}\nSentiment:", "labels": ["negative", "positive"]},
    "trec": {"template": "Question: {text}\nAnswer type:",
             "labels": ["description", "entity", "expression", "human", "location", "number"]},
    "agnews": {"template": "Article: {text}\nTopic:", "labels": ["world", "sports", "business", "technology"]},
}
VOLUMES = (100, 10_000)
EPSILONS = (1.0, 3.0, 8.0)
EXPERIMENT = "dp_icl_comparison"


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rows_and_queries(data_root: Path, task: str, n_rows: int, n_queries: int):
    """(private rows, query texts, their labels) of one task."""
    from tasks.methods import PrivateRows

    if task == "agnews":  # only a test split here: the queries first, the private rows after them
        test = _jsonl(data_root / "agnews" / "test.jsonl")
        queries, train = test[:n_queries], test[n_queries:]
    else:
        train = _jsonl(data_root / task / "train.jsonl")[:n_rows]
        queries = _jsonl(data_root / task / "test.jsonl")[:n_queries]
    return (PrivateRows([r["text"] for r in train], [r["label"] for r in train]),
            [r["text"] for r in queries], [r["label"] for r in queries])


def accuracy(answers, truth) -> float:
    return sum(a == t for a, t in zip(answers, truth)) / len(truth)


def epsilon_after(sigma: float, queries: int, delta: float, q: float | None = None) -> float:
    from privacy import accountant as acct
    from tasks.dp_icl import batch_event

    return acct.spend(batch_event(sigma, queries, q), delta).epsilon


class _Ledger:  # the server asks its dataset's unit once; the votes here are not charged (see docstring)
    def dataset(self, fingerprint):
        return {"unit": "record"}


def _progress(task: str, what: str, done: int, total: int, t0: float) -> None:
    print(f"\r{task}: {what} {done}/{total} ({time.perf_counter() - t0:.0f} s)", end="", file=sys.stderr, flush=True)


def histograms(server, queries: list[str], task: str, what: str) -> np.ndarray:
    t0, out = time.perf_counter(), []
    for i, q in enumerate(queries):
        out.append(server.histogram(q))
        _progress(task, what, i + 1, len(queries), t0)
    print(file=sys.stderr)
    return np.array(out)


def run_task(task: str, a, engine, mlflow) -> None:
    from tasks.dp_icl import DPICLServer, DPICLSettings, noise_for_queries, noisy_vote
    from tasks.randomness import DpRandomness

    spec = TASKS[task]
    labels, template = spec["labels"], spec["template"]
    rows, queries, truth = rows_and_queries(Path(a.data_root), task, a.rows, a.queries)
    q = min(1.0, a.subsets * a.shots / len(rows.texts))
    base = {"task": task, "queries": len(queries), "private_rows": len(rows.texts), "subsets": a.subsets,
            "shots": a.shots, "delta": a.delta, "local_llm": "SmolLM2-135M-Instruct"}

    def log(method: str, sampling: str, accs: list[float], volume=None, eps=None, sigma=None, rate=None, wall=0.0):
        with mlflow.start_run(run_name=f"{task}-{method}-{sampling}-{volume}-{eps}"):
            mlflow.log_params({**base, "method": method, "sampling": sampling, "volume": volume, "epsilon": eps,
                               "sigma": sigma, "sample_rate": rate, "noise_seeds": a.noise_seeds,
                               "sample_sets": a.sample_sets if rate is not None else 1, "draws": len(accs)})
            metrics = {"accuracy_mean": float(np.mean(accs)), "accuracy_sd": float(np.std(accs)), "wall_s": wall}
            if sigma:
                metrics.update({f"epsilon_after_{n}": epsilon_after(sigma, n, a.delta, rate) for n in (1, 100, 10_000)})
            mlflow.log_metrics(metrics)

    t0 = time.perf_counter()
    label_ids = [engine.ids(" " + label)[0] for label in labels]
    zero = [labels[int(engine.last_logits([engine.ids(template.replace("{text}", x))])[0][label_ids].argmax())]
            for x in queries]
    log("zero_shot", "-", [accuracy(zero, truth)], wall=time.perf_counter() - t0)
    for sampling, rate in (("partition", None), ("poisson", q)):
        if sampling not in a.samplings.split(","):
            continue
        t0, sets = time.perf_counter(), []
        for k in range(a.sample_sets if rate is not None else 1):  # a partition's votes are the same every pass
            server = DPICLServer(engine, labels, rows, DPICLSettings(a.subsets, a.shots, 1e-9, "", template, rate),
                                 _Ledger(), "bench", DpRandomness())
            sets.append(histograms(server, queries, task, f"{sampling} {k + 1}/{a.sample_sets}"))
        wall = (time.perf_counter() - t0) / len(sets)  # one pass over the queries
        log("icl_ensemble", sampling, [accuracy([labels[int(h.argmax())] for h in hists], truth) for hists in sets],
            wall=wall)
        for volume in VOLUMES:
            for eps in EPSILONS:
                sigma = noise_for_queries(eps, a.delta, volume, rate)
                accs = [accuracy([noisy_vote(h, labels, sigma, noise) for h in hists], truth)
                        for hists in sets for noise in (DpRandomness().numpy(2) for _ in range(a.noise_seeds))]
                log("dp_icl", sampling, accs, volume, eps, sigma, rate, wall)
                print(f"{task} dp_icl {sampling} σ for {volume} queries at ε={eps:g}: σ={sigma:.3g} "
                      f"accuracy {np.mean(accs):.3f} ± {np.std(accs):.3f}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/results/dp_icl")
    ap.add_argument("--datasets", default="sst2,trec,agnews")
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--rows", type=int, default=2000, help="private rows of SST-2 / TREC (AG News: its test split "
                    "after the queries)")
    ap.add_argument("--subsets", type=int, default=10)
    ap.add_argument("--shots", type=int, default=4)
    ap.add_argument("--noise-seeds", type=int, default=3)
    ap.add_argument("--sample-sets", type=int, default=1, help="poisson: fresh sets of per-query Poisson samples "
                    "(each a pass over the queries); accuracy over sample sets × noise draws")
    ap.add_argument("--samplings", default="partition,poisson")
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--tracking-uri", default=None, help="default: sqlite in OUT/../ (not committed)")
    ap.add_argument("--data-root", default=str(Path(__file__).resolve().parents[2] / "shared" / "data"))
    ap.add_argument("--report-only", action="store_true", help="the table and figures again from MLflow")
    a = ap.parse_args()
    import mlflow

    out = Path(a.out)
    mlflow.set_tracking_uri(a.tracking_uri or f"sqlite:///{Path('/tmp') / 'dp_icl_comparison.db'}")
    mlflow.set_experiment(EXPERIMENT)
    if not a.report_only:
        import torch

        from models.backbones import load_backbone
        from tasks.methodkit.causal_engine import CausalEngine

        bb = load_backbone("smollm2", device="cuda" if torch.cuda.is_available() else "cpu")
        engine = CausalEngine(bb.model, bb.tokenizer, max_batch=16)
        for task in a.datasets.split(","):
            t0 = time.perf_counter()
            run_task(task, a, engine, mlflow)
            print(f"{task}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    report(out, mlflow, a.delta)


def _runs(mlflow):
    frame = mlflow.search_runs(experiment_names=[EXPERIMENT], order_by=["attributes.start_time ASC"])
    rows = []
    for _, r in frame.iterrows():
        if r.get("tags.summary") == "1":
            continue
        row = {k.split(".", 1)[1]: v for k, v in r.items() if k.startswith(("params.", "metrics.")) and v == v}
        rows.append(row)
    latest = {}
    for row in rows:  # a rerun of a setting replaces the earlier one
        latest[(row["task"], row["method"], row["sampling"], row.get("volume"), row.get("epsilon"))] = row
    return list(latest.values())


def report(out: Path, mlflow, delta: float) -> None:
    """The table (table.md) and figures from MLflow's runs, also logged to a summary run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    runs = _runs(mlflow)
    out.mkdir(parents=True, exist_ok=True)
    tasks = [t for t in TASKS if any(r["task"] == t for r in runs)]
    lines = ["| task | method | sampling | σ for | ε | σ | accuracy (mean ± sd) | ε after 1 | after 100 | after 10,000 |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        if r["method"] == "dp_icl":
            after = " | ".join(f"{r[f'epsilon_after_{n}']:.3f}" for n in (1, 100, 10_000))
            cells = (f"{int(r['volume']):,} queries", r["epsilon"], f"{float(r['sigma']):.3g}")
        else:
            after = " | ".join(["0" if r["method"] == "zero_shot" else "∞"] * 3)
            cells = ("–", "–" if r["method"] == "zero_shot" else "∞", "–")
        lines.append(f"| {r['task']} ({r['queries']} queries) | {r['method']} | {r['sampling']} | " + " | ".join(cells)
                     + f" | {r['accuracy_mean']:.3f} ± {r['accuracy_sd']:.3f} | {after} |")
    table = "\n".join(lines)
    print(table)
    (out / "table.md").write_text(table + "\n")
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        mine = [r for r in runs if r["task"] == task]
        for r in mine:
            if r["method"] != "dp_icl":
                style = {"zero_shot": ("k", "-"), "icl_ensemble": ("tab:green", ":" if r["sampling"] == "poisson" else "--")}
                color, ls = style[r["method"]]
                ax.axhline(r["accuracy_mean"], color=color, ls=ls, lw=1,
                           label="zero-shot" if r["method"] == "zero_shot" else f"ICL ensemble ({r['sampling']}, ε=∞)")
        for sampling, color in (("partition", "tab:red"), ("poisson", "tab:blue")):
            for volume, ls in ((100, "-"), (10_000, "--")):
                pts = sorted((float(r["epsilon"]), r["accuracy_mean"], r["accuracy_sd"]) for r in mine
                             if r["method"] == "dp_icl" and r["sampling"] == sampling and int(r["volume"]) == volume)
                if pts:
                    x, y, e = zip(*pts)
                    ax.errorbar(x, y, yerr=e, color=color, ls=ls, marker="o", ms=3, capsize=2,
                                label=f"dp_icl {sampling}, σ for {volume:,} queries")
        ax.set_xscale("log"), ax.set_xticks(EPSILONS, [f"{e:g}" for e in EPSILONS])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel(f"ε over the query volume (δ = {delta:g})"), ax.set_ylabel("accuracy")
        ax.set_title(task, fontsize=10)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_epsilon.png", dpi=120)
    fig, ax = plt.subplots(figsize=(6.4, 4))
    ns = np.unique(np.logspace(0, 4, 25).astype(int))
    for r in runs:
        if r["method"] == "dp_icl" and int(r["volume"]) == 100 and r["task"] == tasks[0]:
            rate = None if r["sampling"] == "partition" else float(r["sample_rate"])
            ax.plot(ns, [epsilon_after(float(r["sigma"]), int(n), delta, rate) for n in ns],
                    ls="-" if rate is None else "--", label=f"{r['sampling']}, σ for 100 queries at ε = {r['epsilon']}")
    for eps in EPSILONS:
        ax.axhline(eps, ls=":", lw=0.8, color="grey")
    ax.set_xscale("log"), ax.set_yscale("log")
    ax.set_xlabel("answered queries"), ax.set_ylabel(f"ε spent (δ = {delta:g}, per record)")
    ax.set_title(f"dp_icl's ε grows with every answer ({tasks[0]}; one-time methods stay flat)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "epsilon_after_queries.png", dpi=120)
    (out / "results.json").write_text(json.dumps(runs, indent=1, default=str))
    with mlflow.start_run(run_name="summary"):
        mlflow.set_tag("summary", "1")
        for name in ("table.md", "accuracy_vs_epsilon.png", "epsilon_after_queries.png"):
            mlflow.log_artifact(str(out / name))


if __name__ == "__main__":
    main()
