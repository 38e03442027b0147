"""Pool the heavy users of several runs of ``experiment.py`` (e.g. replicates with other seeds) into one
unit-level LiRA AUC per arm, with two 95% CIs: a bootstrap over (user, target) pairs (as ``experiment.py``
reports, which treats the pairs as independent) and a CLUSTER bootstrap over users (a user's M pairs
resampled together: the honest one, since a user's pairs share its records and the models).

    python docs/results/user_level/pool.py --states /tmp/ul_state_240_p09 /tmp/ul_state_240_p09_s1 \\
        /tmp/ul_state_240_p09_s2 --out docs/results/user_level/results_pooled_p09.json

Reads each run's kept scores (``scores_<arm>.npz`` in its private state folder: per-record scores and
memberships, never text) and writes only the AUCs and CIs. Users' scores are the same as
``experiment.py``'s (sum of online-LiRA log-likelihood ratios; each model in turn the target)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from scipy.stats import rankdata

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def auc(scores: np.ndarray, member: np.ndarray) -> float:
    """Mann–Whitney AUC (ties count ½)."""
    pos, neg = member.sum(), (~member).sum()
    r = rankdata(scores)
    return float((r[member].sum() - pos * (pos + 1) / 2) / (pos * neg))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--states", nargs="+", required=True, help="the runs' --state folders")
    p.add_argument("--out", required=True)
    p.add_argument("--arms", default="nonprivate,record,user")
    p.add_argument("--heavy", type=int, default=10)
    p.add_argument("--resamples", type=int, default=2000)
    args = p.parse_args(argv)
    from experiment import unit_lira

    out = {"states": len(args.states), "heavy": args.heavy, "resamples": args.resamples, "arms": {}}
    for arm in args.arms.split(","):
        s_all, m_all, c_all = [], [], []
        for k, state in enumerate(args.states):
            d = np.load(Path(state) / f"scores_{arm}.npz")
            scores, row_in, units = d["scores"], d["row_in"], d["units"]
            U, M = units.max() + 1, scores.shape[0]
            unit_in = np.stack([np.bincount(units, weights=r, minlength=U) > 0 for r in row_in])
            us, mem = unit_lira(scores, row_in, units, unit_in)
            big = np.tile(np.bincount(units) >= args.heavy, M)
            s_all.append(us[big])
            m_all.append(mem[big])
            c_all.append(np.tile(np.arange(U), M)[big] + 100_000 * k)  # cluster: (run, user)
        s, m, c = np.concatenate(s_all), np.concatenate(m_all), np.concatenate(c_all)
        g = np.random.default_rng(1)
        pair_boot, cluster_boot = [], []
        ids = np.unique(c)
        rows_of = {i: np.flatnonzero(c == i) for i in ids}
        for _ in range(args.resamples):
            i = g.integers(len(s), size=len(s))
            if m[i].any() and (~m[i]).any():
                pair_boot.append(auc(s[i], m[i]))
            i = np.concatenate([rows_of[j] for j in g.choice(ids, size=len(ids))])
            if m[i].any() and (~m[i]).any():
                cluster_boot.append(auc(s[i], m[i]))
        out["arms"][arm] = {"auc_heavy": auc(s, m), "users": int(len(ids)), "pairs": int(len(s)),
                            "members": int(m.sum()),
                            "pair_ci": [float(np.quantile(pair_boot, 0.025)), float(np.quantile(pair_boot, 0.975))],
                            "user_cluster_ci": [float(np.quantile(cluster_boot, 0.025)),
                                                float(np.quantile(cluster_boot, 0.975))]}
        a = out["arms"][arm]
        print(f"{arm}: heavy users AUC {a['auc_heavy']:.3f}, pairs CI [{a['pair_ci'][0]:.3f}, {a['pair_ci'][1]:.3f}], "
              f"user-cluster CI [{a['user_cluster_ci'][0]:.3f}, {a['user_cluster_ci'][1]:.3f}] "
              f"({a['users']} users, {a['pairs']} pairs)", flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
