"""The budget plan of a config before anything runs (``privprompt plan``, sweeps): every run's
planned events per dataset, composed with what the ledger holds, WITHOUT writing anything and
without reading private rows (only the size of the source and its keyed hash)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from privacy import accountant as acct
from privacy.ledger import Ledger

from .data import find_split_file, partition_key, resolve_data_folder
from .errors import ConfigError
from .lifecycle import resolve_delta
from .methods import get_method
from .state import default_data_root


def _count_records(path: Path) -> int:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    with path.open("rb") as fh:
        lines = sum(1 for line in fh if line.strip())
    return lines - 1 if suffix == ".csv" else lines


def estimate_n_train(cfg, private_dir: Path) -> int:
    """The training-partition size a run of ``cfg`` will have: from its partition manifest when it
    exists, else from the number of source records and the split rule of ``partition_dataset``
    (planted canaries counted at their expected number)."""
    data_root = default_data_root(cfg.data_root)
    manifest = Path(private_dir) / "partitions" / f"{cfg.data.name}-{partition_key(cfg.data, cfg.seed, data_root)}" / "manifest.json"
    if manifest.is_file():
        return int(json.loads(manifest.read_text())["n_train"])
    if cfg.data.hub:
        if cfg.data.train_size is None:
            raise ConfigError(f"data.hub={cfg.data.hub!r}: the plan needs data.train_size (or one run that "
                              "partitions the dataset)")
        return cfg.data.train_size + cfg.data.canaries // 2
    n = _count_records(find_split_file(resolve_data_folder(cfg.data, data_root), cfg.data.train_split))
    n_pool = n if cfg.data.train_size is None else min(cfg.data.train_size, n)
    n_holdout = int(round(cfg.data.holdout_fraction * n_pool))
    n_train = n_pool if n - n_pool >= n_holdout else n_pool - n_holdout
    return n_train + cfg.data.canaries // 2


def plan_runs(variants: list, state_paths) -> dict:
    """``variants``: [(label, config)]. Returns {"runs": [...], "datasets": {key: preview}, "fits": bool}."""
    from .data import dataset_key

    runs, events, meta = [], {}, {}
    for label, cfg in variants:
        n = estimate_n_train(cfg, state_paths.private)
        key = dataset_key(cfg.data, default_data_root(cfg.data_root), state_paths.private)
        delta = resolve_delta(cfg, n)
        meta.setdefault(key, {"name": cfg.data.name, "delta": delta, "cap": cfg.privacy.dataset_epsilon_cap})
        if abs(meta[key]["delta"] - delta) > 1e-15:
            raise ConfigError(f"{label or cfg.method}: δ={delta:g} differs from δ={meta[key]['delta']:g} of another "
                              f"run on dataset {cfg.data.name!r}; runs on one dataset compose at one δ")
        for name in cfg.run_methods:
            plan = get_method(name).plan(cfg, n, delta)
            row = {"variant": label, "method": name, "dataset": cfg.data.name, "n_train": n,
                   "guarantee": plan.guarantee, "delta": delta, "epsilon": None}
            if plan.event is not None:
                row["epsilon"] = acct.spend(plan.event, delta).epsilon
                events.setdefault(key, []).append(plan.event)
            runs.append(row)
    ledger = Ledger(state_paths.ledger) if state_paths.ledger.is_file() else None
    datasets = {}
    for key, m in meta.items():
        planned = events.get(key, [])
        if ledger is not None:
            d = ledger.preview(key, planned, m["delta"], cap=m["cap"], name=m["name"])
        else:
            d = Ledger.preview_new(planned, m["delta"], cap=m["cap"], name=m["name"])
        if m["cap"] < d["cap"]:  # a run lowers the stored cap to its config's (never raises it)
            d.update(cap=m["cap"], remaining_after=m["cap"] - d["total_epsilon"], fits=d["total_epsilon"] <= m["cap"])
        datasets[key] = d
    return {"runs": runs, "datasets": datasets, "fits": all(d["fits"] for d in datasets.values())}


_DOTTED_KEY = re.compile(r"(?<![\w.])(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)=")


def short_labels(labels: list[str]) -> list[str]:
    """Variant labels with every dotted key cut to its last part (``methods.rapt.eta=100.0`` →
    ``eta=100.0``), where that keeps distinct labels distinct; otherwise the labels as they are."""
    short = [_DOTTED_KEY.sub(r"\1=", label) for label in labels]
    return short if len(set(short)) == len(set(labels)) else list(labels)


def format_plan(plan: dict) -> str:
    labels = short_labels([r["variant"] or "(config)" for r in plan["runs"]])
    width = max([len("variant"), *map(len, labels)]) + 2
    lines = [f"{'variant':<{width}}{'method':<16}{'guarantee':<10}{'n_train':>8}{'planned ε':>12}"]
    for r, label in zip(plan["runs"], labels):
        eps = "-" if r["epsilon"] is None else f"{r['epsilon']:.4f}"
        lines.append(f"{label:<{width}}{r['method']:<16}{r['guarantee']:<10}{r['n_train']:>8}{eps:>12}")
    for key, d in plan["datasets"].items():
        lines.append(f"dataset {d.get('name', '?')} ({key[:12]}): spent ε={d['spent_epsilon']:.4f}, "
                     f"with this plan ε={d['total_epsilon']:.4f} of cap ε={d['cap']:.4f}; "
                     f"remaining after ε={max(0.0, d['cap'] - d['total_epsilon']):.4f} "
                     f"({'fits' if d['fits'] else 'OVER THE CAP'})")
    return "\n".join(lines)
