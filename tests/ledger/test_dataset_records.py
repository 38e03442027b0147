"""Datasets known by their records (issue 25, item 3).

The ledger keys a private dataset by its records, not by its files: each source comes with its
keyed record digests (HMAC of the whitespace-normalised text under the installation secret, 16
bytes), and a source is charged to the registered dataset that holds any of its records.

* The same records as JSONL, CSV and Parquet, reordered, with one row appended, or with another
  test file, are ONE ledger dataset: their runs compose in one budget, and the cap refusal is
  reached across them. A disjoint dataset gets its own budget.
* A source sharing records with two registered datasets is refused, by plan and run alike, with
  one line naming both (name and short key), never a record nor a count of shared records.
* A version-4 ledger file is migrated in place; its datasets (keyed by their files' bytes) keep
  their spend and get their digests at the next run on their source.
* Export / import keep the digests; the ledger never holds a record's text.
"""

import csv
import json
import random
import re
import sqlite3
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.pipeline.test_flow import _config

N_TRAIN, N_TEST = 120, 20


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.open()]


def _write(folder: Path, train: list[dict], test: list[dict], fmt: str = "jsonl", int_labels: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", train), ("test", test)):
        if int_labels:  # another export: labels as 0/1 under other column names
            rows = [{"sentence": r["text"], "y": ["negative", "positive"].index(r["label"])} for r in rows]
        if fmt == "jsonl":
            (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        elif fmt == "csv":
            with (folder / f"{split}.csv").open("w", newline="", encoding="utf-8") as fh:
                writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
                writer.writeheader()
                writer.writerows(rows)
        else:
            pq.write_table(pa.Table.from_pylist(rows), folder / f"{split}.parquet")
    return folder


@pytest.fixture(scope="module")
def sources(sst2_dir, tmp_path_factory):
    """The same SST-2 sample in several exports, a grown copy, and a disjoint sample."""
    root = tmp_path_factory.mktemp("records")
    all_train, all_test = _rows(sst2_dir / "train.jsonl"), _rows(sst2_dir / "test.jsonl")
    train, test = all_train[:N_TRAIN], all_test[:N_TEST]
    shuffled = list(train)
    random.Random(7).shuffle(shuffled)
    out = {
        "jsonl": _write(root / "jsonl", train, test),
        "csv": _write(root / "csv", train, test, "csv", int_labels=True),
        "parquet": _write(root / "parquet", shuffled, list(reversed(test)), "parquet"),
        "reordered": _write(root / "reordered", shuffled, test),
        "appended": _write(root / "appended", train + [all_train[N_TRAIN]], test),
        "other-test": _write(root / "other-test", train, all_test[N_TEST:2 * N_TEST]),
        "disjoint": _write(root / "disjoint", all_train[1000:1000 + N_TRAIN], all_test[500:500 + N_TEST]),
    }
    # two datasets and a source holding records of both
    out["half-a"] = _write(root / "half-a", all_train[2000:2100], all_test[600:610])
    out["half-b"] = _write(root / "half-b", all_train[3000:3100], all_test[700:710])
    out["both"] = _write(root / "both", all_train[2000:2050] + all_train[3000:3050], all_test[800:810])
    return out


def _data_cfg(folder: Path, name: str, state: Path, **extra) -> dict:
    cfg = _config(folder, state, **{"privacy.target_delta": 1e-4, **extra})  # one δ: sizes differ by a row
    cfg["data"]["name"] = name
    if (folder / "train.csv").is_file():  # the 0/1 export: its columns and label words
        cfg["data"].update({"text_field": "sentence", "label_field": "y",
                            "label_map": {"0": "negative", "1": "positive"}})
    for m in ("zero_shot", "prompt_sgd"):
        cfg["methods"][m]["enabled"] = False
    cfg["mia"]["enabled"] = False
    return cfg


def _charge(cfg_dict: dict):
    """What a run does before its reservation: partition, resolve the source's ledger dataset
    (the flow), register it (the lifecycle). Returns (the partition with its ledger key, row)."""
    from tasks.config import parse_config
    from tasks.data import Partition, partition_dataset
    from tasks.charge import ensure_dataset, resolve_partition
    from tasks.run_plan import resolve_delta
    from tasks.state import state_paths

    cfg = parse_config(cfg_dict)
    paths = state_paths(cfg.state_dir).create()
    part = partition_dataset(cfg.data, cfg.seed, paths.private, None)
    ledger = paths.open_ledger()
    resolved, _ = resolve_partition(ledger, part.to_dict())
    part = Partition(**resolved)
    row = ensure_dataset(ledger, part, cfg.privacy.dataset_epsilon_cap, resolve_delta(cfg, part.sizes.n_for_delta))
    assert row["fingerprint"] == part.dataset_key  # the flow's answer is the lifecycle's
    return part, row, ledger


def _event():
    from privacy import events as ev

    return ev.ExponentialEvent(1.0)  # ε = 1 alone (pure DP): composes to the sum


def _contents(ledger):
    return ledger.datasets(), ledger.entries(), ledger.cap_changes(), ledger.export()["record_digests"]


def test_the_same_records_in_any_export_share_one_budget(sources, tmp_path):
    from privacy.ledger import BudgetExceededError

    state = tmp_path / "state"
    names = ["jsonl", "csv", "parquet", "reordered", "appended", "other-test"]
    keys, hows = set(), []
    for i, name in enumerate(names):
        part, row, ledger = _charge(_data_cfg(sources[name], f"toy-{name}", state,
                                              **{"privacy.dataset_epsilon_cap": 5.5}))
        keys.add(part.dataset_key)
        hows.append(row["how"])
        if i < 5:  # five runs of ε = 1, each on another export of the records
            ledger.reserve(part.dataset_key, f"run-{name}", _event())
            ledger.commit(f"run-{name}", _event())
    assert len(keys) == 1 and len(ledger.datasets()) == 1
    (ds,) = ledger.datasets()
    assert ds["name"] == "toy-jsonl" and ds["records_known"]  # the first registration's name
    # JSONL → CSV with 0/1 labels and other columns → the same record set (text is the record)
    assert hows == ["new", "key", "key", "key", "records", "records"]
    assert ds["committed_runs"] == 5 and ds["spent_epsilon"] == pytest.approx(5.0, rel=1e-3)
    # the sixth source (another test file) hits the cap the other five spent
    with pytest.raises(BudgetExceededError, match="toy-jsonl") as info:
        ledger.reserve(part.dataset_key, "run-other-test", _event())
    assert info.value.spent == pytest.approx(5.0, rel=1e-3)
    # the appended row and the other test records were taken into the dataset
    n = len(ledger.record_digests(ds["fingerprint"])) // 16
    assert n == N_TRAIN + 1 + 2 * N_TEST


def test_a_disjoint_dataset_gets_its_own_budget(sources, tmp_path):
    state = tmp_path / "state"
    a, row_a, ledger = _charge(_data_cfg(sources["jsonl"], "toy-a", state))
    b, row_b, _ = _charge(_data_cfg(sources["disjoint"], "toy-b", state))
    assert row_a["how"] == row_b["how"] == "new" and a.dataset_key != b.dataset_key
    assert sorted(d["name"] for d in ledger.datasets()) == ["toy-a", "toy-b"]
    ledger.reserve(a.dataset_key, "run-a", _event())
    assert ledger.spent(b.dataset_key).epsilon == 0.0


@pytest.mark.slow  # suite time: runs with -m slow
def test_plan_names_the_registered_dataset_a_copy_is_charged_to(sources, tmp_path):
    """`privprompt plan` on a re-export: the registered dataset's key, name and spend, and a note
    that names it; never a record nor a count of shared records."""
    from tasks.planning import format_plan

    state = tmp_path / "state"
    part, _, ledger = _charge(_data_cfg(sources["jsonl"], "toy-sst2", state))
    ledger.reserve(part.dataset_key, "earlier", _event())
    ledger.commit("earlier", _event())
    cfg = _data_cfg(sources["appended"], "toy-grown", state)
    plan = _plan(cfg)
    (key,) = plan["datasets"]
    d = plan["datasets"][key]
    assert key == part.dataset_key and d["name"] == "toy-sst2" and d["spent_epsilon"] == pytest.approx(1.0, rel=1e-3)
    text = format_plan(plan)
    (note,) = d["notes"]
    assert note in text
    assert "'toy-grown' shares records with registered dataset 'toy-sst2'" in note and key[:12] in note
    _no_record_in(note, sources["appended"])
    assert not re.search(rf"\b({N_TRAIN}|{N_TRAIN + 1}|{N_TEST})\b", note), note  # no count of records
    assert f"dataset toy-sst2 ({key[:12]}): spent ε={d['spent_epsilon']:.4f}" in text  # what the CLI prints
    # the run then charges the same dataset
    grown, row, _ = _charge(cfg)
    assert grown.dataset_key == key and row["how"] == "records" and len(ledger.datasets()) == 1


def test_a_source_sharing_records_with_two_datasets_is_refused(sources, tmp_path):
    from privacy.ledger import RecordOverlapError

    state = tmp_path / "state"
    a, _, ledger = _charge(_data_cfg(sources["half-a"], "toy-a", state))
    b, _, _ = _charge(_data_cfg(sources["half-b"], "toy-b", state))
    before = _contents(ledger)
    cfg = _data_cfg(sources["both"], "toy-both", state)
    with pytest.raises(RecordOverlapError) as planned:
        _plan(cfg)
    with pytest.raises(RecordOverlapError) as ran:
        _charge(cfg)
    message = str(ran.value)
    assert str(planned.value) == message and "\n" not in message
    assert "'toy-a' (fingerprint " + a.dataset_key[:12] in message
    assert "'toy-b' (fingerprint " + b.dataset_key[:12] in message
    assert "'toy-both'" in message and "nothing was recorded" in message
    _no_record_in(message, sources["both"])
    assert not re.search(r"\b(50|100|110)\b", message), message  # no count of shared records
    assert _contents(ledger) == before  # nothing registered, no record added

    # the CLI: one line, exit 2
    import subprocess
    import sys

    import yaml

    cfg_file = tmp_path / "both.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "privprompt_cli", "plan", str(cfg_file)], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path,
                          env={**_env(), "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"privprompt: error: {message}"


def test_a_version_4_ledger_is_migrated_and_its_datasets_get_their_records(sources, tmp_path):
    """A v4 ledger file (no record tables; datasets keyed by their files' bytes): opened, it is
    schema 5; the next run on the same files is charged to the old dataset (its spend kept),
    which then knows its records, so a CSV re-export is charged to it too."""
    from privacy.ledger import Ledger
    from privacy.ledger.schema import SCHEMA_VERSION
    from tasks.config import parse_config
    from tasks.data import legacy_dataset_key
    from tasks.state import state_paths

    assert SCHEMA_VERSION == 8
    state = tmp_path / "state"
    cfg = _data_cfg(sources["jsonl"], "toy-sst2", state)
    paths = state_paths(str(state)).create()
    old_key = legacy_dataset_key(parse_config(cfg).data, None, paths.private)
    _make_v4_ledger(paths.ledger, old_key)
    with sqlite3.connect(paths.ledger) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 4

    ledger = Ledger(paths.ledger)  # migrates in place
    with sqlite3.connect(paths.ledger) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 8
        assert db.execute("SELECT value FROM ledger_meta WHERE name = 'schema_version'").fetchone()[0] == "8"
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"record_sets", "dataset_records"} <= tables
    (ds,) = ledger.datasets()
    assert ds["fingerprint"] == old_key and not ds["records_known"]
    assert ds["spent_epsilon"] == pytest.approx(1.0, rel=1e-3) and ledger.trail()[0]["action"] == "register"

    part, row, _ = _charge(cfg)
    assert part.dataset_key == old_key and row["how"] == "legacy"
    (ds,) = ledger.datasets()
    assert ds["records_known"] and ds["spent_epsilon"] == pytest.approx(1.0, rel=1e-3)
    assert ledger.trail()[-1]["action"] == "records" and ledger.trail()[-1]["detail"]["matched_by"] == "legacy"
    csv_copy, row, _ = _charge(_data_cfg(sources["csv"], "toy-csv", state))
    assert csv_copy.dataset_key == old_key and row["how"] == "records" and len(ledger.datasets()) == 1


def test_export_and_import_keep_the_digests_and_no_text(sources, tmp_path):
    from privacy.ledger import Ledger
    from tasks.state import state_paths

    src_state, dst_state = tmp_path / "src", tmp_path / "dst"
    part, _, src = _charge(_data_cfg(sources["jsonl"], "toy-sst2", src_state))
    _charge(_data_cfg(sources["disjoint"], "toy-other", src_state))
    data = json.loads(json.dumps(src.export()))  # through JSON, as `privprompt ledger --json` writes it
    assert sorted(data["record_digests"]) == sorted(d["fingerprint"] for d in src.datasets())
    _no_record_in(json.dumps(data), sources["jsonl"])
    # the same key: the destination state folder is a restore of the source's (installation.key copied)
    (dst_state / "secrets").mkdir(parents=True)
    (dst_state / "secrets" / "installation.key").write_bytes((src_state / "secrets" / "installation.key").read_bytes())
    dst = state_paths(str(dst_state)).create().open_ledger()
    counts = dst.import_ledger(data)
    assert counts["datasets"] == 2 and counts["record_digests"] == 2 * (N_TRAIN + N_TEST)
    for d in src.datasets():
        assert dst.record_digests(d["fingerprint"]) == src.record_digests(d["fingerprint"]) != b""
    assert dst.datasets() == src.datasets()
    # a re-export run against the restored ledger is charged to the restored dataset
    grown, row, _ = _charge(_data_cfg(sources["appended"], "toy-grown", dst_state))
    assert grown.dataset_key == part.dataset_key and row["how"] == "records" and len(dst.datasets()) == 2
    # the ledger file holds no record text (keyed digests only)
    for path in (src.path, dst.path):
        raw = Path(path).read_bytes() + (Path(str(path) + "-wal").read_bytes()
                                         if Path(str(path) + "-wal").is_file() else b"")
        for r in _rows(sources["jsonl"] / "train.jsonl")[:40]:
            assert r["text"].encode() not in raw
    # a corrupt export is refused whole
    bad = json.loads(json.dumps(data))
    bad["record_digests"][part.dataset_key] = "not base64!"
    from privacy.ledger import LedgerError

    with pytest.raises(LedgerError, match="not 16-byte digests"):
        Ledger(tmp_path / "x.sqlite").import_ledger(bad)


# ---- helpers ----------------------------------------------------------------------------------

def _plan(cfg_dict):
    from tasks.config import parse_config
    from tasks.planning import plan_runs
    from tasks.state import state_paths

    cfg = parse_config(cfg_dict)
    return plan_runs([("", cfg)], state_paths(cfg.state_dir))


def _env():
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}


def _no_record_in(text: str, folder: Path) -> None:
    for split in ("train", "test"):
        path = folder / f"{split}.jsonl"
        rows = _rows(path) if path.is_file() else []
        for r in rows:
            assert r["text"] not in text


def _make_v4_ledger(path: Path, fingerprint: str) -> None:
    """A ledger file as schema 4 left it: this code's tables without the record tables, version 4,
    one dataset (keyed by its files' bytes) with one committed run of ε = 1."""
    from privacy.ledger import Ledger

    ledger = Ledger(path)
    ledger.register_dataset(fingerprint, "toy-sst2", 50.0, 1e-4)
    ledger.reserve(fingerprint, "v4-run", _event())
    ledger.commit("v4-run", _event())
    with sqlite3.connect(path) as db:
        db.execute("DROP TABLE dataset_records")
        db.execute("DROP TABLE record_sets")
        db.execute("UPDATE ledger_meta SET value = '4' WHERE name = 'schema_version'")
        db.execute("PRAGMA user_version = 4")


@pytest.mark.slow  # suite time: runs with -m slow
def test_a_flow_on_a_copy_is_tagged_and_charged_as_the_registered_dataset(prefect_harness, sources, tmp_path):
    """The method flow on a re-export of registered records with one row appended: its reservation and commit
    are the registered dataset's, yet it publishes `dataset.fingerprint` = its own source's keyed
    records hash, never the registered dataset's key (which dataset a source is charged to depends
    on single records: published, it would tell one record's presence), and no ledger totals; its
    record digests reach neither MLflow nor Prefect (they stay in the ledger and under private/)."""
    from flows.method_flow import method_flow
    from tests.pipeline.test_flow import _mlflow

    state = tmp_path / "state"
    part, _, ledger = _charge(_data_cfg(sources["jsonl"], "toy-sst2", state))
    summary = method_flow(_data_cfg(sources["appended"], "toy-parquet", state))  # the records + one more
    run = _mlflow(state).get_run(summary["mlflow_run_id"])
    (copy,) = [json.loads(m.read_text()) for m in (state / "private" / "partitions").glob("*/manifest.json")
               if json.loads(m.read_text())["dataset"] == "toy-parquet"]
    assert copy["source_key"] != part.dataset_key
    assert run.data.tags["dataset.fingerprint"] == copy["source_key"]  # its own source, not the charged dataset
    assert run.data.tags["dataset"] == "toy-parquet"
    (ds,) = ledger.datasets()
    assert ds["fingerprint"] == part.dataset_key and ds["committed_runs"] == 1  # charged to the registered one
    assert ds["spent_epsilon"] == pytest.approx(run.data.metrics["privacy.epsilon"], rel=1e-3)
    assert summary["budget"]["dataset.fingerprint"] == copy["source_key"]
    assert "spent_epsilon" not in json.dumps(summary["budget"]) and part.dataset_key not in json.dumps(summary, default=str)
    digests = ledger.record_digests(part.dataset_key)
    logged = json.dumps({"tags": run.data.tags, "params": run.data.params, "summary": summary}, default=str)
    for i in range(0, 64 * 16, 16):  # no digest, in hex, reaches the run record
        assert digests[i:i + 16].hex() not in logged


@pytest.mark.servers
def test_the_record_rule_on_a_postgres_ledger(tmp_path, request):
    """The same rule on a team's PostgreSQL ledger: register, a grown copy charged to it, a source
    over two datasets refused, export / import (PostgreSQL → SQLite) keeping the digests."""
    import hashlib
    import hmac

    from privacy.ledger import Ledger, RecordOverlapError

    postgres = request.getfixturevalue("postgres")
    led = Ledger(postgres.database())

    def digests(texts):
        return sorted(hmac.new(b"k" * 32, t.encode(), hashlib.sha256).digest()[:16] for t in texts)

    a, b = digests(f"a{i}" for i in range(5000)), digests(f"b{i}" for i in range(3000))
    assert led.register_source("a" * 64, "A", 8.0, 1e-5, a)["how"] == "new"
    assert led.register_source("b" * 64, "B", 8.0, 1e-5, b"".join(b))["how"] == "new"
    grown = a + digests(["a-new"])
    assert led.match_source("c" * 64, grown)["fingerprint"] == "a" * 64
    row = led.register_source("c" * 64, "A grown", 8.0, 1e-5, grown)
    assert row["fingerprint"] == "a" * 64 and row["how"] == "records" and len(led.datasets()) == 2
    with pytest.raises(RecordOverlapError, match="'A' .*'B'"):
        led.register_source("d" * 64, "mix", 8.0, 1e-5, a[:1] + b[:1])
    assert len(led.record_digests("a" * 64)) == 16 * 5001
    data = json.loads(json.dumps(led.export()))
    back = Ledger(tmp_path / "back.sqlite")
    assert back.import_ledger(data)["record_digests"] == 8001
    assert back.record_digests("a" * 64) == led.record_digests("a" * 64)
    assert back.match_source("e" * 64, b[:10])["fingerprint"] == "b" * 64


def _postgres_fixture():
    from tests.ledger.test_ledger_team import postgres  # noqa: F401 - the throwaway cluster fixture

    return postgres


postgres = _postgres_fixture()


@pytest.mark.slow  # suite time: runs with -m slow
def test_a_run_whose_source_was_charged_elsewhere_meanwhile_stops_before_its_reservation(sources, tmp_path):
    """The flow tags a run with the dataset its source resolves to; if another run registers records
    of that source in between, the run stops before its reservation (one line) instead of
    reserving against a dataset other than the one it was tagged and planned with."""
    from privacy.ledger import LedgerError
    from tasks.config import parse_config
    from tasks.data import partition_dataset
    from tasks.charge import resolve_partition
    from tasks.lifecycle import run_method
    from tasks.record import RunRecord, client, ensure_experiment
    from tasks.stages import StageContext
    from tasks.state import state_paths

    state = tmp_path / "state"
    cfg = parse_config(_data_cfg(sources["appended"], "toy-grown", state))
    paths = state_paths(str(state)).create()
    part = partition_dataset(cfg.data, cfg.seed, paths.private, None)
    resolved, note = resolve_partition(paths.open_ledger(), part.to_dict())  # the flow: a new dataset then
    assert resolved["dataset_key"] == part.source_key and note is None
    other, _, ledger = _charge(_data_cfg(sources["jsonl"], "toy-sst2", state))  # meanwhile, another run
    mlflow = client(paths)
    parent = RunRecord.create(mlflow, ensure_experiment(mlflow, cfg.experiment, paths), "parent", {})
    ctx = StageContext(cfg=cfg, state_dir=str(state), partition=resolved,
                       parent_run_id=parent.run_id, flow_run_id="flow-run-1")
    with pytest.raises(LedgerError, match="nothing was reserved: run it again") as info:
        run_method(ctx, "prompt_dpsgd", {})
    assert other.dataset_key[:12] not in str(info.value) and "\n" not in str(info.value)
    assert ledger.entries() == [] and [d["fingerprint"] for d in ledger.datasets()] == [other.dataset_key]


@pytest.mark.slow  # suite time: runs with -m slow
def test_a_plan_of_several_sources_applies_the_rule_among_them(sources, tmp_path):
    """Variants of one plan on sources no ledger has seen: a grown copy of an earlier variant's
    records is charged with it (one dataset, the runs composed), and a source over two earlier
    variants' datasets is refused, as the runs in that order would be."""
    from privacy.ledger import RecordOverlapError
    from tasks.config import parse_config
    from tasks.planning import plan_runs
    from tasks.state import state_paths

    state = tmp_path / "state"
    variants = [(name, parse_config(_data_cfg(sources[name], f"toy-{name}", state))) for name in ("jsonl", "appended")]
    plan = plan_runs(variants, state_paths(str(state)))
    (key,) = plan["datasets"]
    d = plan["datasets"][key]
    assert d["name"] == "toy-jsonl" and len(plan["runs"]) == 2
    assert d["total_epsilon"] > max(r["epsilon"] for r in plan["runs"])  # both runs composed in one budget
    (note,) = d["notes"]
    assert "'toy-appended' shares records with dataset 'toy-jsonl'" in note
    variants = [(name, parse_config(_data_cfg(sources[name], f"toy-{name}", state))) for name in ("half-a", "half-b", "both")]
    with pytest.raises(RecordOverlapError, match="'toy-both' .* 2 datasets that earlier runs of this plan register: "
                                                 "'toy-half-a' .*'toy-half-b'"):
        plan_runs(variants, state_paths(str(state)))
    assert not state_paths(str(state)).ledger_exists()  # a plan writes nothing


def test_a_text_normalised_copy_holds_the_same_records():
    """Lower-cased, another Unicode form, HTML-escaped, other spaces: the same record (a review
    registered a lower-cased re-export as a new dataset with a cap of its own)."""
    import unicodedata

    from tasks.data import RECORD_DIGEST_BYTES, record_digests

    key = b"k" * 32
    texts = ["Café & Crème — it's “great”", "A  second\trecord"]
    variants = [
        [t.lower() for t in texts],
        [unicodedata.normalize("NFD", t) for t in texts],
        [t.replace("&", "&amp;").replace("'", "&#39;") for t in texts],
        [t.replace(" ", "\u00a0") for t in texts],
    ]
    original = record_digests(key, texts)
    assert len(original) == 2 * RECORD_DIGEST_BYTES
    for variant in variants:
        assert record_digests(key, variant) == original, variant
    assert record_digests(key, ["Café & Crème — it's “good”", texts[1]]) != original  # another text is another record
