"""Build the issue-30 case into a folder OUTSIDE the repository (never commit data):

* SST-2 train reshaped to a small, skewed private source: N_SOURCE records at ≈ 80% positive
  (sampled from SST-2's training split with a fixed seed: this builds the *source*, it is not a
  split of a private dataset, whose splits stay the per-record keyed hash of tasks/data.py);
  with data.holdout_fraction = 1/6 about 1,500 of them are training rows and ≈ 300 the holdout;
* a balanced test split from SST-2's validation split (428 negative + 428 positive).

    python docs/results/selection/make_data.py /tmp/sel-data
    # -> /tmp/sel-data/sst2_skewed/{train,test}.jsonl
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SRC = Path("/work/shared/data/sst2")
N_SOURCE = 1800
POSITIVE = 0.8


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(out: str) -> None:
    rng = random.Random(30)
    train = read(SRC / "train.jsonl")
    pos = [r for r in train if r["label"] == "positive"]
    neg = [r for r in train if r["label"] == "negative"]
    n_pos = round(N_SOURCE * POSITIVE)
    source = rng.sample(pos, n_pos) + rng.sample(neg, N_SOURCE - n_pos)
    rng.shuffle(source)
    val = read(SRC / "validation.jsonl")
    vpos = [r for r in val if r["label"] == "positive"]
    vneg = [r for r in val if r["label"] == "negative"]
    k = min(len(vpos), len(vneg))
    test = rng.sample(vpos, k) + rng.sample(vneg, k)
    rng.shuffle(test)
    folder = Path(out) / "sst2_skewed"
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", source), ("test", test)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{folder}: train {len(source)} ({n_pos} positive), test {len(test)} (balanced)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/sel-data")
