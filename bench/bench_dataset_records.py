"""What knowing a dataset by its records costs (issue 25): SST-2's train + test (69,170 records)
from ../shared/data/sst2 registered in a fresh SQLite ledger, then a Parquet re-export with one
row appended matched and charged against it.

    .venv/bin/python bench/bench_dataset_records.py [--data ../shared/data/sst2] [--repeats 3] [--json OUT]

Phases, each timed with ``time.perf_counter`` (median over ``--repeats`` fresh ledgers):

* read: both splits read and normalised (``read_split``: what any run does anyway);
* digest: the keyed record digests and the records key (``record_digests``, ``records_key``);
* register: ``Ledger.register_source`` into an empty ledger (the overlap lookup finds nothing,
  one dataset row and every digest inserted in one transaction);
* same source again: ``register_source`` of the same records (its key is registered with its
  records: no lookup, no write) — what every later run on the source pays;
* re-export: ``match_source`` and ``register_source`` of the Parquet copy with a row appended (a
  new key: every digest looked up, the new one added).

Sizes: the ledger file (after a checkpoint: WAL folded in) before any dataset and after, and the
export's ``record_digests`` entry. Writes only to a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _size(path: Path) -> int:
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return path.stat().st_size


def one(data: Path, work: Path) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from privacy.ledger import Ledger
    from tasks.config import DataConfig
    from tasks.data import read_split, record_digests, records_key, source_records
    from tasks.state import installation_secret

    private = work / "state" / "private"
    private.mkdir(parents=True)
    key = installation_secret(private)
    cfg = DataConfig(name="sst2", path=str(data), labels=["negative", "positive"])
    out = {}
    t = time.perf_counter()
    texts = read_split(cfg, None, cfg.train_split)[0] + read_split(cfg, None, cfg.test_split)[0]
    out["read_s"] = time.perf_counter() - t
    t = time.perf_counter()
    digests = record_digests(key, texts)
    source = records_key(key, digests)
    out["digest_s"] = time.perf_counter() - t
    out["records"], out["distinct_records"] = len(texts), len(digests) // 16

    ledger = Ledger(work / "ledger.sqlite")
    out["ledger_bytes_empty"] = _size(ledger.path)
    t = time.perf_counter()
    row = ledger.register_source(source, "sst2", 8.0, 1e-6, digests)
    out["register_s"] = time.perf_counter() - t
    assert row["how"] == "new"
    out["ledger_bytes"] = _size(ledger.path)
    t = time.perf_counter()
    assert ledger.register_source(source, "sst2", 8.0, 1e-6, digests)["how"] == "key"
    out["same_source_again_s"] = time.perf_counter() - t

    # a Parquet re-export, shuffled, with one row appended
    copy = work / "copy"
    copy.mkdir()
    rows = [json.loads(line) for line in (data / "train.jsonl").open()]
    rows.append({"text": "an appended review that no export had before", "label": "positive"})
    random.Random(0).shuffle(rows)
    pq.write_table(pa.Table.from_pylist(rows), copy / "train.parquet")
    pq.write_table(pa.Table.from_pylist([json.loads(line) for line in (data / "test.jsonl").open()]),
                   copy / "test.parquet")
    t = time.perf_counter()
    records = source_records(cfg.model_copy(update={"path": str(copy), "name": "sst2-copy"}), None, private)
    out["reexport_read_and_digest_s"] = time.perf_counter() - t
    t = time.perf_counter()
    match = ledger.match_source(records.key, records.digests, name="sst2-copy")
    out["reexport_match_s"] = time.perf_counter() - t
    t = time.perf_counter()
    charged = ledger.register_source(records.key, "sst2-copy", 8.0, 1e-6, records.digests)
    out["reexport_register_s"] = time.perf_counter() - t
    assert match["fingerprint"] == charged["fingerprint"] == source and charged["how"] == "records"
    assert len(ledger.datasets()) == 1 and len(ledger.record_digests(source)) // 16 == out["distinct_records"] + 1
    out["ledger_bytes_after_copy"] = _size(ledger.path)
    out["export_record_digests_bytes"] = len(ledger.export()["record_digests"][source])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "sst2"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    runs = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            runs.append(one(Path(args.data), Path(tmp)))
    summary = {k: (statistics.median(r[k] for r in runs) if k.endswith("_s") else runs[0][k]) for k in runs[0]}
    for k, v in summary.items():
        print(f"{k:<32}{v:.3f} s" if k.endswith("_s") else f"{k:<32}{v:,}")
    per_record = (summary["ledger_bytes"] - summary["ledger_bytes_empty"]) / summary["distinct_records"]
    print(f"{'ledger bytes per record':<32}{per_record:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "median": summary}, indent=1))


if __name__ == "__main__":
    main()
