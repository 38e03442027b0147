"""User-level privacy units (issue 28): ``data.privacy_unit`` names the field whose value identifies
a person. Splits assign whole units by a keyed hash of the unit id, the contribution bound keeps a
unit's records by a keyed hash of each record (never the seed), a missing unit id is a one-line
error naming the field (never a value), and the released sizes count units."""

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tasks.config import DataConfig
from tasks.data import (partition_dataset, read_partition_split, read_partition_units, split_sizes,
                        unit_digests)
from tasks.errors import DataError
from tests.claims.test_neighbour_stable_splits import _write  # the same JSONL source writer

SIZES = [1, 1, 2, 3, 5, 8, 13, 21, 2, 1, 4, 1, 7, 1, 1, 3, 40, 2, 1, 6]  # records per user


def _users(prefix: str, sizes=SIZES) -> list[dict]:
    rows = []
    for u, k in enumerate(sizes):
        for j in range(k):
            rows.append({"text": f"{prefix} review {j} by person {u} about item {(u * 31 + j) % 17}",
                         "label": ["neg", "pos"][(u + j) % 2], "author": f"{prefix}-user-{u}"})
    return rows


def _cfg(folder: Path, **kw) -> DataConfig:
    kw = {"holdout_fraction": 0.25, "train_fraction": 0.6, "privacy_unit": "author", **kw}
    return DataConfig(name="toy", path=str(folder), labels=["neg", "pos"], **kw)


def _private(tmp_path: Path) -> Path:
    """A state folder with a FIXED installation secret: the keyed splits of these small sources are
    then the same on every test run (a fresh random secret could leave a split of 20 users empty)."""
    from tasks.state import SECRET_NAME

    (tmp_path / "secrets").mkdir(exist_ok=True)
    (tmp_path / "secrets" / SECRET_NAME).write_bytes(bytes(range(32)))
    return tmp_path / "private"


def _units_of(rows: list[dict]) -> dict[str, str]:
    return {r["text"]: r["author"] for r in rows}


def test_config_unit_rules():
    with pytest.raises(ValueError, match="max_records_per_unit bounds the records of a user unit"):
        DataConfig(name="x", labels=["a", "b"], max_records_per_unit=3)
    with pytest.raises(ValueError, match="which is data.text_field"):
        DataConfig(name="x", labels=["a", "b"], privacy_unit="text")
    assert not DataConfig(name="x", labels=["a", "b"]).user_unit
    assert DataConfig(name="x", labels=["a", "b"], privacy_unit="author").user_unit


def test_record_unit_keeps_partition_key_and_config_hash():
    """A record-unit config hashes as before the unit settings existed (its partition and its
    released sizes are reused, never drawn again)."""
    from tasks.data import data_dump

    cfg = DataConfig(name="x", labels=["a", "b"])
    assert "privacy_unit" not in data_dump(cfg) and "max_records_per_unit" not in data_dump(cfg)
    user = DataConfig(name="x", labels=["a", "b"], privacy_unit="author", max_records_per_unit=2)
    assert data_dump(user)["privacy_unit"] == "author" and data_dump(user)["max_records_per_unit"] == 2


def test_whole_units_are_split_and_never_in_both_train_and_test(tmp_path):
    train, test = _users("a"), _users("a")[::3]  # the test file holds records of the same people
    # (and of two people of its own: a test split of one class is refused)
    test = [{**r, "text": r["text"] + " (test copy)"} for r in test] + _users("b", [2, 3])
    folder = _write(tmp_path / "d", train, test)
    private = _private(tmp_path)
    part = partition_dataset(_cfg(folder), 0, private, None)
    owner = {**_units_of(train), **_units_of(test)}
    tr_texts, _ = read_partition_split(part.train_path)
    ho_texts, _ = read_partition_split(part.holdout_path)
    te_texts, _ = read_partition_split(part.test_path)
    tr_people = {owner[t] for t in tr_texts}
    ho_people = {owner[t] for t in ho_texts}
    te_people = {owner[t] for t in te_texts}
    assert tr_people and ho_people and te_people
    assert not tr_people & ho_people and not (tr_people | ho_people) & te_people
    # whole units: every record of a training person is in training (no cap)
    assert sum(1 for r in train if r["author"] in tr_people) == len(tr_texts)
    # the unit column is the keyed digest of each row's unit, never the id
    from tasks.state import installation_secret

    digests = read_partition_units(part.train_path)
    key = installation_secret(private)
    assert digests == unit_digests(key, [owner[t] for t in tr_texts])
    assert not set(digests) & {r["author"] for r in train}
    assert read_partition_units(part.test_path) is None  # the test file carries no unit
    # the manifest keeps the exact unit counts; the released sizes count units
    assert part.n_train_units == len(tr_people) and part.n_holdout_units == len(ho_people)
    assert part.unit == "author" and part.sizes.unit == "author"
    assert part.sizes.params()["data.sizes_count"] == "units"
    # split_sizes (plan's path) gives the same unit counts, writing nothing
    assert split_sizes(_cfg(folder), 0, private, None) == {
        "n_train": part.n_train_units, "n_holdout": part.n_holdout_units, "n_test": part.n_test_units}


def test_adding_or_removing_one_unit_changes_only_its_own_assignment(tmp_path):
    train = _users("a")
    private = _private(tmp_path)
    base = partition_dataset(_cfg(_write(tmp_path / "base", train, _users("t"))), 0, private, None)
    # remove user 7 (21 records) and add a new user with 9 records
    extra = _users("new", [9])
    changed = [r for r in train if r["author"] != "a-user-7"] + extra
    other = partition_dataset(_cfg(_write(tmp_path / "other", changed, _users("t"))), 0, private, None)
    where = lambda p: {**{t: "train" for t in read_partition_split(p.train_path)[0]},  # noqa: E731
                       **{t: "holdout" for t in read_partition_split(p.holdout_path)[0]}}
    a, b = where(base), where(other)
    for r in train:
        if r["author"] != "a-user-7":
            assert a.get(r["text"], "unused") == b.get(r["text"], "unused")


def test_contribution_bound_keeps_records_by_keyed_hash_not_seed(tmp_path):
    train = _users("a")
    folder = _write(tmp_path / "d", train, _users("t"))
    private = _private(tmp_path)
    cfg = _cfg(folder, max_records_per_unit=3, holdout_fraction=0.1, train_fraction=0.9)
    part = partition_dataset(cfg, 0, private, None)
    owner = _units_of(train)
    texts = read_partition_split(part.train_path)[0] + read_partition_split(part.holdout_path)[0]
    per_user: dict[str, int] = {}
    for t in texts:
        per_user[owner[t]] = per_user.get(owner[t], 0) + 1
    assert max(per_user.values()) == 3
    assert per_user["a-user-16"] == 3 if "a-user-16" in per_user else True
    # users with fewer records keep all of them
    small = {f"a-user-{u}" for u, k in enumerate(SIZES) if k <= 3}
    for u in small & set(per_user):
        assert per_user[u] == SIZES[int(u.rsplit("-", 1)[1])]
    # another seed (with canaries off, the seed is not in the partition key): the same records kept
    other = partition_dataset(cfg, 5, _private(tmp_path), None)
    assert sorted(read_partition_split(other.train_path)[0]) == sorted(read_partition_split(part.train_path)[0])
    # the records a unit keeps depend on its own records only: removing another user changes nothing for it
    fewer = [r for r in train if r["author"] != "a-user-4"]
    part2 = partition_dataset(_cfg(_write(tmp_path / "d2", fewer, _users("t")), max_records_per_unit=3,
                                   holdout_fraction=0.1, train_fraction=0.9), 0, private, None)
    kept = set(read_partition_split(part2.train_path)[0]) | set(read_partition_split(part2.holdout_path)[0])
    assert kept == {t for t in texts if owner[t] != "a-user-4"}


@pytest.mark.parametrize("bad", [None, "", "   ", "missing"])
def test_missing_or_empty_unit_is_a_one_line_error_naming_the_field(tmp_path, bad):
    train = _users("a")
    secret_text = train[5]["text"]
    if bad == "missing":
        del train[5]["author"]
    else:
        train[5]["author"] = bad
    folder = _write(tmp_path / "d", train, _users("t"))
    with pytest.raises(DataError) as err:
        partition_dataset(_cfg(folder), 0, _private(tmp_path), None)
    msg = str(err.value)
    assert "'author'" in msg and "data.privacy_unit" in msg and "\n" not in msg
    assert secret_text not in msg and "a-user" not in msg


def test_canaries_are_units_of_their_own(tmp_path):
    folder = _write(tmp_path / "d", _users("a"), _users("t"))
    part = partition_dataset(_cfg(folder, canaries=6), 3, _private(tmp_path), None)
    units = read_partition_units(part.train_path)
    canary_units = [u for u in units if u.startswith("canary-")]
    assert len(canary_units) == part.n_canaries_planted == len(set(canary_units)) == part.n_canary_units_planted
    assert part.n_train_units == len(set(units))


def test_canary_units_of_several_records(tmp_path):
    """Canary UNITS (data.canary_records_per_unit): each unit's records planted together, with
    probability ½ per unit; the canary file says which unit each canary record is in."""
    from tasks.data import draw_canaries

    folder = _write(tmp_path / "d", _users("a"), _users("t"))
    cfg = _cfg(folder, canaries=10, canary_records_per_unit=3)
    part = partition_dataset(cfg, 4, _private(tmp_path), None)
    table = pq.read_table(part.canaries_path)
    cunits = np.array(table.column("unit").to_pylist())
    planted = np.array(table.column("planted").to_pylist())
    assert len(cunits) == 30 and np.bincount(cunits).tolist() == [3] * 10
    for u in range(10):
        assert len(set(planted[cunits == u].tolist())) == 1  # a unit is planted whole or not at all
    train_units = read_partition_units(part.train_path)
    in_train = [u for u in train_units if u.startswith("canary-")]
    assert len(in_train) == int(planted.sum()) == 3 * part.n_canary_units_planted
    assert all(n == 3 for n in {u: in_train.count(u) for u in in_train}.values())
    # the record-unit draw is what it was (one record per canary, the same stream)
    from tasks.data import make_canaries

    rec = DataConfig(name="toy", labels=["neg", "pos"], canaries=10)
    rng = np.random.default_rng(4)
    texts, labels = make_canaries(10, ["neg", "pos"], rng)
    got_texts, got_labels, got_planted = draw_canaries(rec, 4)
    assert (got_texts, got_labels) == (texts, labels)
    assert got_planted.tolist() == (rng.random(10) < 0.5).tolist()
    with pytest.raises(ValueError, match="needs a user unit"):
        DataConfig(name="toy", labels=["neg", "pos"], canaries=10, canary_records_per_unit=2)


def test_record_unit_partition_has_no_unit_column(tmp_path):
    folder = _write(tmp_path / "d", _users("a"), _users("t"))
    part = partition_dataset(_cfg(folder, privacy_unit="record"), 0, _private(tmp_path), None)
    assert read_partition_units(part.train_path) is None
    assert "unit" not in pq.read_table(part.train_path).column_names
    assert part.sizes.unit == "record" and "data.sizes_count" not in part.sizes.params()
    assert part.n_train == int(np.sum([1 for _ in read_partition_split(part.train_path)[0]]))


# ---- the ledger: a dataset's cap is per unit; a run of another unit is refused ----------------------

def _event(eps_sigma: float = 2.0):
    from privacy import events as ev

    return ev.GaussianEvent(eps_sigma)


def test_ledger_refuses_a_record_level_run_on_a_dataset_of_people(tmp_path):
    from privacy.ledger import Ledger, UnitMismatchError

    ledger = Ledger(tmp_path / "ledger.sqlite")
    digests = bytes(range(16)) + bytes(range(1, 17))
    row = ledger.register_source("k1", "reviews", 5.0, 1e-6, digests, unit="author")
    assert row["how"] == "new" and row["unit"] == "author"
    ledger.require_unit("k1", "author")
    with pytest.raises(UnitMismatchError) as err:
        ledger.require_unit("k1", "record")
    msg = str(err.value)
    assert "group privacy" in msg and "data.privacy_unit: author" in msg and "\n" not in msg
    trail = len(ledger.trail())
    # the same records from a record-level source: refused before anything is recorded
    with pytest.raises(UnitMismatchError):
        ledger.register_source("k2", "reviews-copy", 5.0, 1e-6, digests[:16] + bytes(range(2, 18)), unit="record")
    assert len(ledger.trail()) == trail and [d["fingerprint"] for d in ledger.datasets()] == ["k1"]
    assert ledger.record_digests("k1") == digests
    # another field naming people does not compose either
    with pytest.raises(UnitMismatchError, match="another field"):
        ledger.require_unit("k1", "email")
    # a user-level run on a dataset registered per record: refused too (the charges are per record)
    ledger.register_dataset("k3", "tickets", 5.0, 1e-6)
    with pytest.raises(UnitMismatchError, match="set-unit"):
        ledger.register_dataset("k3", "tickets", 5.0, 1e-6, unit="customer")


def test_ledger_unit_changes_only_while_nothing_is_charged(tmp_path):
    from privacy.ledger import Ledger

    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.register_dataset("k", "tickets", 5.0, 1e-6)
    assert ledger.change_unit("k", "customer", "tickets are per customer")["unit"] == "customer"
    assert ledger.trail()[-1]["action"] == "unit_change"
    ledger.reserve("k", "run-1", _event())
    with pytest.raises(ValueError, match="never changed"):
        ledger.change_unit("k", "record", "back")
    assert ledger.dataset("k")["unit"] == "customer"


def test_a_version_5_ledger_gets_record_units(tmp_path):
    import sqlite3

    from privacy.ledger import Ledger

    path = tmp_path / "ledger.sqlite"
    Ledger(path).register_dataset("old", "sst2", 5.0, 1e-6)
    with sqlite3.connect(path) as db:  # as schema 5 left it: no unit column
        db.execute("ALTER TABLE datasets DROP COLUMN unit")
        db.execute("UPDATE ledger_meta SET value = '5' WHERE name = 'schema_version'")
        db.execute("PRAGMA user_version = 5")
    ledger = Ledger(path)
    assert ledger.dataset("old")["unit"] == "record"
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 8  # and on to the current schema


def test_lifecycle_charges_a_partition_to_its_units_dataset(tmp_path):
    from privacy.ledger import Ledger, UnitMismatchError
    from tasks.charge import ensure_dataset

    folder = _write(tmp_path / "d", _users("a"), _users("t"))
    private = _private(tmp_path)
    user = partition_dataset(_cfg(folder), 0, private, None)
    record = partition_dataset(_cfg(folder, privacy_unit="record"), 0, private, None)
    assert user.source_key == record.source_key  # the same records: the same dataset
    ledger = Ledger(tmp_path / "ledger.sqlite")
    assert ensure_dataset(ledger, user, 5.0, 1e-6)["unit"] == "author"
    with pytest.raises(UnitMismatchError, match="group privacy"):
        ensure_dataset(ledger, record, 5.0, 1e-6)


# ---- the audit at the unit level -------------------------------------------------------------------

def test_unit_scores_and_labels():
    from privacy.audit import unit_labels, unit_scores

    units = np.array([0, 0, 1, 2, 2, 2])
    scores = np.array([1.0, 3.0, -2.0, 0.5, 0.5, 2.0])
    assert unit_scores(scores, units, "sum").tolist() == [4.0, -2.0, 3.0]
    assert unit_scores(scores, units, "mean").tolist() == [2.0, -2.0, 1.0]
    assert unit_labels([1, 1, 0, 1, 1, 1], units).tolist() == [True, False, True]
    with pytest.raises(ValueError, match="all members or all non-members"):
        unit_labels([1, 0, 0, 1, 1, 1], units)


@pytest.mark.parametrize("above", [0, 3])  # released = exact unit counts; released 3 units above them
def test_audit_pool_holds_whole_units_in_half_the_shadows(tmp_path, monkeypatch, above):
    """The pool's unit counts are the RELEASED ones (published as audit.pool_members and in every
    rate's denominator); a split with fewer units than that gives copies of whole units, each copy
    in the same shadows as its unit, and a shadow trains on each person once."""
    from dataclasses import replace
    from types import SimpleNamespace

    from tasks import audit
    from tasks.audit import _build_unit_pool, check_pool_size
    from tasks.config import AuditConfig

    folder = _write(tmp_path / "d", _users("a", SIZES * 3), _users("t"))
    part = partition_dataset(_cfg(folder, holdout_fraction=0.4, train_fraction=0.6, canaries=4), 0,
                             _private(tmp_path), None)
    exact_train = part.n_train_units - part.n_canary_units_planted
    part = replace(part, released={**part.released, "n_train": part.n_train_units + above,
                                   "n_holdout": part.n_holdout_units + above})
    acfg = AuditConfig(shadows=4, fprs=[0.5])
    sizes = check_pool_size(part, acfg)  # released unit counts (canary units aside), never the exact ones
    assert sizes["n_members"] == min(part.sizes.n_train - part.n_canary_units_planted, part.sizes.n_holdout)
    assert sizes["n_members"] == min(exact_train, part.n_holdout_units) + above
    pool = _build_unit_pool(part, acfg, tmp_path, np.random.default_rng(0), sizes)
    table = pq.read_table(pool["pool_path"])
    units = np.array(table.column("unit").to_pylist())
    copy_of = np.array(table.column("copy_of").to_pylist())
    member = np.array(table.column("member").to_pylist())
    mask = np.load(pool["mask_path"])
    assert len(set(units[member].tolist())) == len(set(units[~member].tolist())) == sizes["n_members"]
    assert not any(t.startswith("canary ") for t in table.column("text").to_pylist())
    for u in set(units.tolist()):  # a unit's rows: one membership, one shadow column, in half the shadows
        rows = units == u
        assert len(set(member[rows].tolist())) == 1
        assert (mask[:, rows] == mask[:, rows][:, :1]).all() and mask[:, rows][:, 0].sum() == 2
        assert (mask[:, rows] == mask[:, units == copy_of[rows][0]][:, :1]).all()  # a copy: its unit's shadows
    # every record of a member unit is in the pool (a unit is a member when its records were in training)
    owner = {r["text"]: r["author"] for r in _users("a", SIZES * 3)}
    texts = table.column("text").to_pylist()
    people = {}
    for u in set(units[member].tolist()):
        person = owner[texts[int(np.flatnonzero(units == u)[0])]]
        people.setdefault(person, []).append(u)
        assert int((units == u).sum()) == sum(1 for t in read_partition_split(part.train_path)[0] if owner.get(t) == person)
    assert len(people) == min(sizes["n_members"], exact_train)
    assert (max(len(us) for us in people.values()) > 1) == (sizes["n_members"] > exact_train)
    # a shadow trains on each person of its half once, copies or not
    seen = {}
    monkeypatch.setattr(audit, "method_shadow",
                        lambda config, method, prepared, state, rows, seed, sizes=None: seen.update(rows=rows))
    audit.shadow_prompt(SimpleNamespace(config={}, method="m", prepared={}, state_dir="",
                                        part=SimpleNamespace(sizes=None)), pool["pool_path"],
                        np.flatnonzero(mask[0]), 0)
    in_shadow = {owner.get(t, t) for t, m in zip(texts, mask[0]) if m}
    assert len(set(seen["rows"].units)) == len(in_shadow)
    assert len(seen["rows"].texts) == len(set(seen["rows"].texts)) == sum(1 for t, m in zip(texts, mask[0]) if m) \
        - sum(1 for i, m in enumerate(mask[0]) if m and copy_of[i] != units[i])


def test_comparison_keeps_user_level_runs_apart(tmp_path):
    """A sweep over data.privacy_unit (separate ledgers) compares: the method's user-level runs get
    their own label, never pooled with its record-level ones."""
    from mlflow.tracking import MlflowClient

    from tasks.comparison import label_summary, parent_runs

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("e", artifact_location=str(tmp_path / "art"))
    for unit, acc in (("record", 0.8), ("author", 0.7)):
        run = client.create_run(exp, tags={"method": "prompt_dpsgd", "dataset": "reviews", "privacy.guarantee": "dp"})
        client.log_param(run.info.run_id, "privacy.target_epsilon", "8.0")
        client.log_param(run.info.run_id, "privacy.unit", unit)
        client.log_metric(run.info.run_id, "test.accuracy", acc)
        client.set_terminated(run.info.run_id)
    rows = sorted(parent_runs(client, "e"), key=lambda r: r["accuracy"])
    assert [(r["method"], r["unit"]) for r in rows] == [("prompt_dpsgd [unit: author]", "author"),
                                                         ("prompt_dpsgd", "record")]
    summary = label_summary(rows)
    assert "| reviews | prompt_dpsgd [unit: author] | - | its output | dp | 8 | 1 | 0.7000 |" in summary
    assert "| reviews | prompt_dpsgd | - | its output | dp | 8 | 1 | 0.8000 |" in summary


def test_another_cap_that_keeps_every_unit_in_place_finds_the_same_sizes_draw(tmp_path, monkeypatch):
    """The released sizes of a user unit count units: a cap that moves no unit (only how many of
    its records are kept) is no fresh look at the same counts (review2, finding 4)."""
    from tasks.data import split_release_inputs

    folder = _write(tmp_path / "d", _users("p"), _users("t"))
    private = _private(tmp_path)
    keys = set()
    for cap in (None, 3, 4):
        cfg = _cfg(folder, max_records_per_unit=cap)
        membership, exact, _ = split_release_inputs(cfg, 0, private, None)
        keys.add((membership, tuple(sorted(exact.items()))))
    assert len(keys) == 1
