"""Group SST-2 (or tweets) records into SYNTHETIC users of Zipf-distributed sizes (1 to 50 records),
for the user-level DP experiment of issue 28: no data set at hand has a real author field, so the
"people" here are synthetic — each is a random set of sentences, said so wherever the results are.

    python docs/results/user_level/make_users.py --source /work/shared/data/sst2 --out /tmp/sst2_users \
        --records 2000 --seed 0

Writes ``train.jsonl`` (text, label, author) and ``test.jsonl`` (the source's test records, each its
own author ``t<i>``) under ``--out`` (outside the repository: the data is never copied into it).
User sizes: Zipf(a) truncated to [1, max_size], drawn until the records are used up."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def zipf_sizes(n_records: int, a: float, max_size: int, rng: np.random.Generator) -> list[int]:
    sizes, total = [], 0
    while total < n_records:
        k = int(rng.zipf(a))
        if k > max_size:
            continue
        k = min(k, n_records - total)
        sizes.append(k)
        total += k
    return sizes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", required=True, help="folder with train.jsonl / test.jsonl (text, label)")
    p.add_argument("--out", required=True)
    p.add_argument("--records", type=int, default=2000, help="training-source records used (the first ones)")
    p.add_argument("--test-records", type=int, default=500)
    p.add_argument("--zipf", type=float, default=1.6, help="Zipf exponent of the user sizes")
    p.add_argument("--max-size", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    src, out = Path(args.source), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    rows = [json.loads(l) for l in (src / "train.jsonl").open() if l.strip()][: args.records]
    order = rng.permutation(len(rows))
    sizes = zipf_sizes(len(rows), args.zipf, args.max_size, rng)
    users, at = [], 0
    for u, k in enumerate(sizes):
        for i in order[at:at + k]:
            users.append({"text": rows[i]["text"], "label": rows[i]["label"], "author": f"u{u}"})
        at += k
    (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in users))
    test = [json.loads(l) for l in (src / "test.jsonl").open() if l.strip()][: args.test_records]
    (out / "test.jsonl").write_text("".join(json.dumps({**r, "author": f"t{i}"}) + "\n" for i, r in enumerate(test)))
    s = np.array(sizes)
    print(json.dumps({"records": len(users), "users": len(sizes), "max": int(s.max()), "median": float(np.median(s)),
                      "users_with_1": int((s == 1).sum()), "users_with_10_plus": int((s >= 10).sum()),
                      "records_in_users_10_plus": int(s[s >= 10].sum())}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
