"""Audit shadows on 2 Dask workers vs 1 (issue: audit flow), one run each in this process.

Trains a DP target prompt on a small SST-2 sample with MiniLM, then runs the audit flow with
8 shadows on a local Dask cluster of 1 worker and of 2 workers (1 thread each), and prints the
speed-up of the shadow phase and of the whole audit, plus how often each worker loaded the model
(it must be once per worker, not once per shadow).

    .venv/bin/python bench/bench_audit.py [--shadows 8] [--train-size 96]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SST2_RECORDS = 67_349  # SST-2 training records: the splits are rates (per-record keyed hash), these give the sizes
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shadows", type=int, default=8)
    ap.add_argument("--train-size", type=int, default=96)
    args = ap.parse_args()

    state = Path(tempfile.mkdtemp(prefix="privprompt-bench-audit-"))
    os.environ["PRIVPROMPT_HOME"] = str(state)
    from tasks.state import configure_environment, state_paths

    paths = state_paths(str(state))
    configure_environment(paths)
    import privprompt_commands.run
    from flows.audit import run_audit, target_from_run
    from flows.method_flow import method_flow
    from tasks.config import parse_config

    config = {
        "method": "prompt_dpsgd", "experiment": "bench-audit", "seed": 0, "state_dir": str(state),
        "data": {"name": "sst2", "labels": ["negative", "positive"], "train_fraction": args.train_size / SST2_RECORDS,
                 "test_fraction": 0.0549, "holdout_fraction": args.train_size / SST2_RECORDS},  # expected sizes
        "models": {"local": "minilm", "max_length": 40},
        "privacy": {"target_epsilon": 8.0, "dataset_epsilon_cap": 100.0},
        "methods": {"prompt_dpsgd": {"n_tokens": 10, "epochs": 4, "batch_size": 16}},
        "mia": {"enabled": False},
        "audit": {"enabled": False, "shadows": args.shadows, "fprs": [0.05], "attacks": ["loss", "lira"]},
    }
    cfg = parse_config(config)
    results = {}
    with privprompt_commands.run._local_prefect_server():
        summary = method_flow(cfg.model_dump(mode="json") | {"state_dir": str(state)})
        for workers in (1, 2):
            target, acfg = target_from_run(summary["mlflow_run_id"], str(state), args.shadows)
            acfg = acfg.model_copy(update={"dask": acfg.dask.model_copy(update={"n_workers": workers})})
            started = time.perf_counter()
            out = run_audit(target, acfg)
            wall = time.perf_counter() - started
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri=f"sqlite:///{paths.mlflow_db}")
            details = json.loads(Path(client.download_artifacts(out["audit_run_id"], "audit/audit.json")).read_text())
            shadows = details["shadows"]
            loads = {}
            for s in shadows:
                loads[s["pid"]] = max(loads.get(s["pid"], 0), s["model_loads_in_process"])
            phase = max(s["ended_at"] for s in shadows) - min(s["started_at"] for s in shadows)
            results[workers] = {"audit_wall_s": wall, "shadow_phase_s": phase,
                                "shadow_compute_s": sum(s["compute_s"] for s in shadows),
                                "workers_seen": len(loads), "model_loads_per_worker": loads}
    one, two = results[1], results[2]
    print(json.dumps(results, indent=1))
    print("| workers | audit wall (s) | shadow phase (s, first start to last end) | shadow compute (s, summed) | model loads per worker |")
    print("|---|---:|---:|---:|---|")
    for w, r in results.items():
        print(f"| {w} | {r['audit_wall_s']:.1f} | {r['shadow_phase_s']:.1f} | {r['shadow_compute_s']:.1f} | "
              f"{list(r['model_loads_per_worker'].values())} |")
    shadow_speedup = one["shadow_phase_s"] / two["shadow_phase_s"]
    print(f"speed-up of the {args.shadows} shadow trainings 2 vs 1 workers: {shadow_speedup:.2f}x "
          f"(target >= 1.7: {'pass' if shadow_speedup >= 1.7 else 'MISS'})")
    speedup = one["audit_wall_s"] / two["audit_wall_s"]
    print(f"speed-up of the whole audit (pool, {args.shadows} shadows, attacks) 2 vs 1 workers: {speedup:.2f}x "
          f"(target >= 1.7: {'pass' if speedup >= 1.7 else 'MISS'})")


if __name__ == "__main__":
    main()
