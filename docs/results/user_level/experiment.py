"""Record-level vs user-level DP at equal ε, with a unit-level LiRA on both (issue 28).

SYNTHETIC users: SST-2 training sentences grouped into users of Zipf-distributed sizes 1–50
(``make_users.py``; no data set at hand has a real author field). One partition with
``data.privacy_unit: author`` (whole users per split); its training split is the audit pool of users.
M = K + 1 soft prompts per arm are trained, each on a random half of the pool's users (each user in
each model independently with probability ½), with the library's trainer (``models.dp_prompt_training.train_prompt``):

* ``record``: record-level DP-SGD at ε (Poisson sampling of records, per-record clipping; q = B/n records);
* ``user``: user-level DP-SGD at the same ε (Poisson sampling of users, one clipped mean gradient per
  user; q = B_u/n users, B_u = B / mean records per user: the same expected records per step);
* ``nonprivate``: plain training (reference for what an attack can find at all).

Unit-level LiRA (online, fixed variance; Carlini et al. 2022): each model in turn is the target and the
other M−1 its shadows; a user's score is the sum of its records' log-likelihood ratios; a user is a member
when its records were in the target's training set. AUCs with bootstrap CIs (privacy.audit.mia_metrics)
over all users and over users with ≥ 10 records; test accuracy mean ± sd over the M models.

    python docs/results/user_level/experiment.py --data /tmp/sst2_users --out docs/results/user_level \
        --shadows 6 --epsilon 8

``--tag T`` writes ``results_T.json`` / ``roc_users_T.png``; arms of one tag may run as parallel processes
(``--arms user`` in one, ``--arms record`` in another, ``--threads 1`` each): each merges its arm into the
file under a lock and refuses a file from other data or settings. Besides the user groups above, every arm
reports users with ``--heavy`` or more records, users with 2 to ``--heavy``−1, and a record-level LiRA (each
record its own unit) for comparison.

σ is calibrated once per arm for the arm's expected training size (half the pool), so each model's ε is
the target up to that size's variation (said in the results). Everything runs on CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # this checkout's packages, not an installed copy


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="folder from make_users.py")
    p.add_argument("--out", required=True)
    p.add_argument("--state", default="/tmp/user_level_state", help="private working folder (partition)")
    p.add_argument("--model", default="minilm")
    p.add_argument("--shadows", type=int, default=6)
    p.add_argument("--epsilon", type=float, default=8.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--epochs", type=float, default=8.0)
    p.add_argument("--batch", type=int, default=32, help="expected records per step")
    p.add_argument("--n-tokens", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--max-length", type=int, default=48)
    p.add_argument("--arms", default="nonprivate,record,user")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heavy", type=int, default=10, help="users with >= this many records are the 'heavy' group")
    p.add_argument("--tag", default="", help="results_<tag>.json / roc_users_<tag>.png (default: results.json)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--replot", action="store_true",
                   help="no training: add the heavy users' ROC to results_<tag>.json from --state's scores, and plot")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    suffix = f"_{args.tag}" if args.tag else ""
    if args.replot:
        return replot(Path(args.out) / f"results{suffix}.json", Path(args.state), args.heavy,
                      Path(args.out) / f"roc_users{suffix}.png")

    from models import DPConfig, PromptTrainingConfig, build_classifier, load_backbone, train_prompt
    from models.scoring import true_label_logit_scores
    from privacy import accountant as acct
    from privacy import audit as stats
    from tasks.config import DataConfig
    from tasks.data import partition_dataset, read_partition_split, read_partition_units

    labels = ["negative", "positive"]
    cfg = DataConfig(name="sst2-users", path=args.data, labels=labels, privacy_unit="author",
                     holdout_fraction=0.02, train_fraction=0.98, test_fraction=1.0)
    part = partition_dataset(cfg, args.seed, Path(args.state) / "private", None)
    texts, ys = read_partition_split(part.train_path)
    digests = read_partition_units(part.train_path)
    index: dict[str, int] = {}
    units = np.array([index.setdefault(d, len(index)) for d in digests])
    U, N = len(index), len(texts)
    sizes = np.bincount(units)
    test_texts, test_ys = read_partition_split(part.test_path)

    bb = load_backbone(args.model, seed=args.seed)
    clf = build_classifier(bb, labels, {"negative": "a negative, bad movie review",
                                        "positive": "a positive, great movie review"} if bb.kind == "encoder" else None)
    enc = clf.encode(texts, max_length=args.max_length)
    y = torch.tensor([labels.index(l) for l in ys])
    test_enc = clf.encode(test_texts, max_length=args.max_length)
    test_y = torch.tensor([labels.index(l) for l in test_ys])

    M = args.shadows + 1
    rng = np.random.default_rng(args.seed)
    # (M, U): each user in each model independently with probability ½. Not a balanced design (each
    # user in exactly M/2 models): with each model in turn the target, a balanced design makes the
    # number of a user's in-shadows depend on its membership of the target (M/2 − 1 vs M/2), and the
    # noisier mean of the smaller side then biases LiRA below 0.5 (seen here: AUC 0.43 / 0.15)
    unit_in = rng.random((M, U)) < 0.5
    row_in = unit_in[:, units]
    n_rec, n_units = row_in.sum(1).mean(), unit_in.sum(1).mean()
    per_user = n_rec / n_units
    results = {"data": {"records": int(N), "users": int(U), "max_user": int(sizes.max()),
                        "users_10_plus": int((sizes >= 10).sum()), "users_heavy": int((sizes >= args.heavy).sum()),
                        "users_1": int((sizes == 1).sum()), "records_per_user_mean": float(sizes.mean()),
                        "test_records": len(test_texts), "synthetic_users": True},
               "settings": {k: v for k, v in vars(args).items() if k not in ("data", "out", "state")},
               "models": M, "arms": {}}
    print(json.dumps(results["data"]), flush=True)

    for arm in args.arms.split(","):
        started = time.time()
        dp, unit_batch = None, None
        if arm == "record":
            q = args.batch / n_rec
        elif arm == "user":
            unit_batch = args.batch / per_user
            q = unit_batch / n_units
        if arm != "nonprivate":
            steps = max(1, math.ceil(args.epochs / q))
            sigma = acct.calibrate_noise_multiplier(args.epsilon, args.delta, q, steps)
            eps = acct.spend(acct_event(q, sigma, steps), args.delta).epsilon
            dp = {"q": q, "steps": steps, "sigma": sigma, "epsilon": eps}
            print(f"{arm}: q={q:.4f} steps={steps} sigma={sigma:.4f} eps={eps:.4f}", flush=True)
        scores, accs = [], []
        for m in range(M):
            rows = np.flatnonzero(row_in[m])
            sub = {k: v[rows] for k, v in enc.items()}
            tc = PromptTrainingConfig(n_tokens=args.n_tokens, lr=args.lr, epochs=args.epochs, batch_size=args.batch,
                                      max_length=args.max_length, seed=args.seed + m, physical_batch_size=64)
            kw = {}
            if dp is not None:
                tc.steps = dp["steps"]
                kw = {"dp": DPConfig(dp["sigma"], args.clip, dp["q"]),
                      "sample_generator": torch.Generator().manual_seed(10_000 * args.seed + 2 * m),
                      "noise_generator": torch.Generator().manual_seed(10_000 * args.seed + 2 * m + 1)}
                if arm == "user":
                    local = np.unique(units[rows], return_inverse=True)[1]
                    kw["units"] = torch.tensor(local)
            res = train_prompt(clf, sub, y[rows], tc, **kw)
            scores.append(true_label_logit_scores(clf, enc, y, res.prompt, 128).numpy())
            pred = torch.cat([clf(  # test accuracy
                {k: v[i:i + 128] for k, v in test_enc.items()}, res.prompt).argmax(1) for i in range(0, len(test_y), 128)])
            accs.append(float((pred == test_y).float().mean()))
            print(f"  {arm} model {m + 1}/{M}: acc {accs[-1]:.4f} ({time.time() - started:.0f} s)", flush=True)
        scores = np.stack(scores)  # (M, N)
        np.savez(Path(args.state) / f"scores_{arm}.npz", scores=scores, row_in=row_in, units=units)  # private side
        unit_scores, member = unit_lira(scores, row_in, units, unit_in)
        big = np.tile(sizes >= 10, M)
        heavy = np.tile(sizes >= args.heavy, M)
        mid = np.tile((sizes >= 2) & (sizes < args.heavy), M)
        g = np.random.default_rng(1)
        entry = {"test_accuracy_mean": float(np.mean(accs)), "test_accuracy_sd": float(np.std(accs, ddof=1)),
                 "test_accuracies": accs, "dp": dp, "seconds": time.time() - started,
                 "lira_users": stats.mia_metrics(unit_scores, member, rng=g, fprs=(0.1,)),
                 "lira_users_10_plus": stats.mia_metrics(unit_scores[big], member[big], rng=g, fprs=(0.1,)),
                 "lira_users_1": stats.mia_metrics(unit_scores[np.tile(sizes == 1, M)],
                                                   member[np.tile(sizes == 1, M)], rng=g, fprs=(0.1,)),
                 "lira_users_heavy": stats.mia_metrics(unit_scores[heavy], member[heavy], rng=g, fprs=(0.1,)),
                 "lira_users_2_to_heavy": stats.mia_metrics(unit_scores[mid], member[mid], rng=g, fprs=(0.1,)),
                 "lira_records": record_lira(scores, row_in, g)}
        fpr, tpr, _ = stats.roc_curve(unit_scores, member)
        entry["roc"] = thin_roc(fpr, tpr)
        entry["roc_heavy"] = thin_roc(*stats.roc_curve(unit_scores[heavy], member[heavy])[:2])
        results["arms"][arm] = entry
        print(f"{arm}: acc {entry['test_accuracy_mean']:.4f} ± {entry['test_accuracy_sd']:.4f}; unit LiRA AUC "
              f"{entry['lira_users']['auc']:.3f} [{entry['lira_users']['auc_low']:.3f}, "
              f"{entry['lira_users']['auc_high']:.3f}], users ≥10 records "
              f"{entry['lira_users_10_plus']['auc']:.3f} [{entry['lira_users_10_plus']['auc_low']:.3f}, "
              f"{entry['lira_users_10_plus']['auc_high']:.3f}]", flush=True)
        results = save_arm(Path(args.out) / f"results{suffix}.json", results, arm, entry)
    plot(results, Path(args.out) / f"roc_users{suffix}.png")
    return 0


def unit_lira(scores: np.ndarray, row_in: np.ndarray, units: np.ndarray, unit_in: np.ndarray):
    """Each model in turn the target, the others its shadows: (user scores, memberships), pooled
    over the M targets; a user's score is the sum of its records' online-LiRA log-likelihood ratios."""
    from privacy import audit as stats

    M = scores.shape[0]
    unit_scores, member = [], []
    for t in range(M):
        others = [m for m in range(M) if m != t]
        llr = stats.lira_scores_online(scores[t], scores[others], row_in[others])
        unit_scores.append(stats.unit_scores(llr, units, "sum"))
        member.append(unit_in[t])
    return np.concatenate(unit_scores), np.concatenate(member)


def thin_roc(fpr, tpr) -> dict:
    step = max(1, len(fpr) // 200)
    return {"fpr": np.asarray(fpr)[::step].tolist(), "tpr": np.asarray(tpr)[::step].tolist()}


def replot(path: Path, state: Path, heavy: int, png: Path) -> int:
    """The heavy users' ROC of every arm in ``path`` from the scores its run kept in ``state``."""
    from privacy import audit as stats

    results = json.loads(path.read_text())
    for arm, entry in results["arms"].items():
        d = np.load(state / f"scores_{arm}.npz")
        scores, row_in, units = d["scores"], d["row_in"], d["units"]
        unit_in = np.stack([np.bincount(units, weights=r, minlength=units.max() + 1) > 0 for r in row_in])
        unit_scores, member = unit_lira(scores, row_in, units, unit_in)
        big = np.tile(np.bincount(units) >= heavy, scores.shape[0])
        g = np.random.default_rng(1)
        check = stats.mia_metrics(unit_scores, member, rng=g, fprs=(0.1,))["auc"]
        if abs(check - entry["lira_users"]["auc"]) > 1e-9:
            raise SystemExit(f"{state}/scores_{arm}.npz does not reproduce {path}'s AUC for {arm}")
        entry["roc_heavy"] = thin_roc(*stats.roc_curve(unit_scores[big], member[big])[:2])
    path.write_text(json.dumps(results, indent=1))
    plot(results, png)
    return 0


def record_lira(scores: np.ndarray, row_in: np.ndarray, g: np.random.Generator) -> dict:
    """Record-level LiRA (each record its own unit), pooled over the M targets: for comparison."""
    from privacy import audit as stats

    M = scores.shape[0]
    llr = [stats.lira_scores_online(scores[t], scores[[m for m in range(M) if m != t]],
                                    row_in[[m for m in range(M) if m != t]]) for t in range(M)]
    return stats.mia_metrics(np.concatenate(llr), row_in.reshape(-1), rng=g, fprs=(0.1,))


def save_arm(path: Path, results: dict, arm: str, entry: dict) -> dict:
    """Merge this arm into ``path`` under a file lock (arms may run as parallel processes with
    the same data, settings other than ``arms``/``threads``, and tag); returns the merged results."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(Path("/tmp") / f"user_level_{path.name}.lock", "w") as lock:  # outside the repository
        fcntl.flock(lock, fcntl.LOCK_EX)
        merged = json.loads(path.read_text()) if path.exists() else None
        mine = {k: v for k, v in results["settings"].items() if k not in ("arms", "threads")}
        if merged is not None and ({k: v for k, v in merged["settings"].items() if k not in ("arms", "threads")} != mine
                                   or merged["data"] != results["data"]):
            raise SystemExit(f"{path} holds a run with other data or settings; use another --tag")
        if merged is None:
            merged = {**results, "arms": {}}
        merged["arms"][arm] = entry
        path.write_text(json.dumps(merged, indent=1))
    return merged


def acct_event(q, sigma, steps):
    from privacy import events as ev

    return ev.dpsgd_event(q, sigma, steps)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("roc", "lira_users", "all users")]
    if all("roc_heavy" in e for e in results["arms"].values()):
        panels.append(("roc_heavy", "lira_users_heavy", f"users with ≥ {results['settings'].get('heavy', 10)} records"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 5), squeeze=False)
    colours = {"record": "tab:green", "user": "tab:blue", "nonprivate": "tab:orange"}
    arms = sorted(results["arms"], key=lambda a: list(colours).index(a) if a in colours else len(colours))
    for ax, (roc, key, title) in zip(axes[0], panels):
        for arm in arms:
            e, a = results["arms"][arm], results["arms"][arm][key]
            ax.plot(e[roc]["fpr"], e[roc]["tpr"], color=colours.get(arm),
                    label=f"{arm}: AUC {a['auc']:.3f} [{a['auc_low']:.3f}, {a['auc_high']:.3f}]")
        ax.plot([0, 1], [0, 1], "k:", lw=0.8)
        ax.set_xlabel("FPR (users)")
        ax.set_ylabel("TPR (users)")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8, loc="lower right")
    eps, tag = results["settings"]["epsilon"], results["settings"].get("tag") or ""
    fig.suptitle(f"unit-level LiRA, synthetic SST-2 users{' (' + tag + ')' if tag else ''}, "
                 f"{results['models']} prompts per arm; ε = {eps:g} for the DP arms", fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
