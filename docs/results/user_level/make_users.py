"""Group SST-2 (or tweets) records into SYNTHETIC users of Zipf-distributed sizes (1 to 50 records),
for the user-level DP experiment of issue 28: no data set at hand has a real author field, so the
"people" here are synthetic — each is a random set of sentences, said so wherever the results are.

    python docs/results/user_level/make_users.py --source /work/shared/data/sst2 --out /tmp/sst2_users \
        --records 2000 --seed 0

Writes ``train.jsonl`` (text, label, author) and ``test.jsonl`` (the source's test records, each its
own author ``t<i>``) under ``--out`` (outside the repository: the data is never copied into it).
User sizes: Zipf(a) truncated to [1, max_size], drawn until the records are used up.

``--style K`` makes the users with >= K records look like people, in the two ways that matter for a
membership attack on a person: (1) a SIGNATURE — every record of the user starts with the user's own
made-up name, two random pronounceable words (``"zorvik plenna writes : <sentence>"``), so the user's
records resemble each other and carry something of that user alone; (2) a LABELLING IDIOSYNCRASY —
``--label-style lean`` (default): the user has a lean (a label drawn at random per user) and each of
the user's records is relabelled to the lean with probability ``--label-p`` (a reviewer who calls
everything great, or everything bad); ``flip``: each record's label is flipped with probability
``--label-p`` (a sarcastic reviewer). The lean is one direction per user, so all of a heavy user's
records push a model the same way; flips of random-sentiment sentences point both ways. Users with
fewer than K records and the test records are left as they are. The sentences themselves are SST-2's."""

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


SYLLABLES = ["ka", "zor", "vik", "plen", "na", "tru", "mo", "bex", "qui", "lan", "dro", "fes", "wy", "gol",
             "nim", "sha", "rup", "tel", "osk", "yar", "bri", "cul", "dap", "hev", "jin", "lom", "pax", "sev"]


def made_up_name(rng: np.random.Generator, taken: set[str]) -> str:
    """Two random pronounceable words (2-3 syllables each), not already taken."""
    while True:
        words = ["".join(rng.choice(SYLLABLES, size=int(rng.integers(2, 4)))) for _ in range(2)]
        name = " ".join(words)
        if name not in taken:
            taken.add(name)
            return name


def style_user(records: list[dict], labels: list[str], label_style: str, p: float, name: str,
               rng: np.random.Generator) -> tuple[list[dict], dict]:
    """The user's records with its signature and labelling idiosyncrasy (module docstring)."""
    lean = labels[int(rng.integers(len(labels)))]
    out, changed = [], 0
    for r in records:
        label = r["label"]
        if rng.random() < p:
            new = lean if label_style == "lean" else next(l for l in labels if l != label)
            changed += new != label
            label = new
        out.append({**r, "text": f"{name} writes : {r['text']}", "label": label})
    return out, {"lean": lean if label_style == "lean" else None, "relabelled": changed}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", required=True, help="folder with train.jsonl / test.jsonl (text, label)")
    p.add_argument("--out", required=True)
    p.add_argument("--records", type=int, default=2000, help="training-source records used (the first ones)")
    p.add_argument("--test-records", type=int, default=500)
    p.add_argument("--zipf", type=float, default=1.6, help="Zipf exponent of the user sizes")
    p.add_argument("--max-size", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--style", type=int, default=0, metavar="K",
                   help="users with >= K records get a signature and a labelling idiosyncrasy (0: none)")
    p.add_argument("--label-style", choices=["lean", "flip"], default="lean")
    p.add_argument("--label-p", type=float, default=0.5, help="probability a styled user's record is relabelled")
    args = p.parse_args(argv)
    if args.style < 0 or not 0.0 <= args.label_p <= 1.0:
        raise SystemExit("make_users: --style must be >= 0 and --label-p in [0, 1]")
    src, out = Path(args.source), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    rows = [json.loads(l) for l in (src / "train.jsonl").open() if l.strip()][: args.records]
    order = rng.permutation(len(rows))
    sizes = zipf_sizes(len(rows), args.zipf, args.max_size, rng)
    labels = sorted({r["label"] for r in rows})
    users, at, styled, taken = [], 0, [], set()
    for u, k in enumerate(sizes):
        recs = [{"text": rows[i]["text"], "label": rows[i]["label"], "author": f"u{u}"} for i in order[at:at + k]]
        if args.style and k >= args.style:
            recs, info = style_user(recs, labels, args.label_style, args.label_p, made_up_name(rng, taken), rng)
            styled.append({"records": k, **info})
        users.extend(recs)
        at += k
    (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in users))
    test = [json.loads(l) for l in (src / "test.jsonl").open() if l.strip()][: args.test_records]
    (out / "test.jsonl").write_text("".join(json.dumps({**r, "author": f"t{i}"}) + "\n" for i, r in enumerate(test)))
    s = np.array(sizes)
    print(json.dumps({"records": len(users), "users": len(sizes), "max": int(s.max()), "median": float(np.median(s)),
                      "users_with_1": int((s == 1).sum()), "users_with_10_plus": int((s >= 10).sum()),
                      "records_in_users_10_plus": int(s[s >= 10].sum()), "styled_users": len(styled),
                      "styled_records_relabelled": sum(x["relabelled"] for x in styled),
                      "styled_records": sum(x["records"] for x in styled)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
