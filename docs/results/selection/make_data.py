"""Build the issue-30 cases into a folder OUTSIDE the repository (never commit data):

* ``sst2_skewed``: SST-2 train reshaped to a small, skewed private source: N_SOURCE records at ≈ 80%
  positive (sampled from SST-2's training split with a fixed seed: this builds the *source*, it is
  not a split of a private dataset, whose splits stay the per-record keyed hash of tasks/data.py);
  with data.holdout_fraction = 1/6 about 1,500 of them are training rows and ≈ 300 the holdout;
  a balanced test split from SST-2's validation split (428 negative + 428 positive).
* ``trec_skewed``: TREC (6 classes) train reshaped the same way: N_SOURCE records, 60% of them
  "entity", the other 40% in TREC's own proportions of the other five classes (80% of one class
  would leave ≈ 10 holdout rows of a class: too few to score); the test split is TREC's test set
  as it is (500 questions, its own class mix, unlike the training rows').
* ``agnews_balanced``: a second task, balanced: AG News (4 classes; the shared copy has only its
  test split, 7,600 rows) cut in two disjoint parts by a fixed seed: N_SOURCE records, 450 per
  class, as the private source, and 1,000 other rows, 250 per class, as the test split.

    python docs/results/selection/make_data.py /tmp/sel-data
    # -> /tmp/sel-data/{sst2_skewed,trec_skewed,agnews_balanced}/{train,test}.jsonl
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SHARED = Path("/work/shared/data")
N_SOURCE = 1800
POSITIVE = 0.8
TREC_MAJOR, TREC_SHARE = "entity", 0.6


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def by_label(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["label"], []).append(r)
    return out


def write(out: str, name: str, train: list[dict], test: list[dict]) -> None:
    folder = Path(out) / name
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", train), ("test", test)):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    count = lambda rows: {k: len(v) for k, v in sorted(by_label(rows).items())}  # noqa: E731
    print(f"{folder}: train {len(train)} {count(train)}, test {len(test)} {count(test)}")


def sst2(out: str) -> None:
    rng = random.Random(30)
    train = by_label(read(SHARED / "sst2" / "train.jsonl"))
    n_pos = round(N_SOURCE * POSITIVE)
    source = rng.sample(train["positive"], n_pos) + rng.sample(train["negative"], N_SOURCE - n_pos)
    rng.shuffle(source)
    val = by_label(read(SHARED / "sst2" / "validation.jsonl"))
    k = min(len(val["positive"]), len(val["negative"]))
    test = rng.sample(val["positive"], k) + rng.sample(val["negative"], k)
    rng.shuffle(test)
    write(out, "sst2_skewed", source, test)


def trec(out: str) -> None:
    rng = random.Random(31)
    train = by_label(read(SHARED / "trec" / "train.jsonl"))
    n_major = round(N_SOURCE * TREC_SHARE)
    others = {k: v for k, v in train.items() if k != TREC_MAJOR}
    n_others = sum(len(v) for v in others.values())
    source = rng.sample(train[TREC_MAJOR], n_major)
    rest = N_SOURCE - n_major
    for i, (label, rows) in enumerate(sorted(others.items())):
        share = round(rest * len(rows) / n_others) if i < len(others) - 1 else rest - sum(
            round(rest * len(r) / n_others) for _, r in sorted(others.items())[:-1])
        source += rng.sample(rows, share)
    rng.shuffle(source)
    write(out, "trec_skewed", source, read(SHARED / "trec" / "test.jsonl"))


def agnews(out: str) -> None:
    rng = random.Random(32)
    rows = by_label(read(SHARED / "agnews" / "test.jsonl"))
    source, test = [], []
    for label in sorted(rows):
        picked = rng.sample(rows[label], N_SOURCE // 4 + 250)
        source += picked[: N_SOURCE // 4]
        test += picked[N_SOURCE // 4:]
    rng.shuffle(source)
    rng.shuffle(test)
    write(out, "agnews_balanced", source, test)


def main(out: str) -> None:
    sst2(out)
    trec(out)
    agnews(out)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/sel-data")
